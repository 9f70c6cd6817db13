"""The tiny Paddle model, loaded once per test module that asks for it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from workers.engine.loader import load_model

    return load_model("tiny", seed=0, cache_dir=str(tmp_path_factory.mktemp("tiny-cache")))
