"""Fixtures every test folder shares."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every worker of the session materializes the tiny checkpoint (once)."""
    return tmp_path_factory.mktemp("tiny-cache")
