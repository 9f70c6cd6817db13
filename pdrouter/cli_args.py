"""argparse flags with environment mirrors: --foo-bar reads PDROUTER_FOO_BAR when not given.

The only place (with the two CLI modules) that reads the environment for settings.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "PDROUTER_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """parser.add_argument(flag, ...) whose default comes from PDROUTER_<FLAG> when set.

    List flags (nargs) read the variable as whitespace- or comma-separated values.
    """
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is not None:
        conv = kwargs.get("type", str)
        if kwargs.get("action") == "store_true":
            kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif kwargs.get("nargs") in ("+", "*"):
            kwargs["default"] = [conv(v) for v in raw.replace(",", " ").split()]
            kwargs["required"] = False
        else:
            kwargs["default"] = conv(raw)
            kwargs["required"] = False
    help_text = kwargs.get("help", "")
    default = kwargs.get("default")
    shown = f" (default: {default})" if default not in (None, [], False) else ""
    kwargs["help"] = f"{help_text}{shown} [env {env}]"
    parser.add_argument(flag, **kwargs)
