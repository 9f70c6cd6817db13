"""Checkpoints that ship inside the package, selected by name: `--model demo`.

    demo    a 6-layer Llama trained on the Python standard library's documentation, with its
            own BPE tokenizer and chat template (workers/models/demo/README.md is its card)

Unlike the tiny presets (random weights, generated on first use), these are trained files
installed with the package: nothing is generated or downloaded.
"""

from __future__ import annotations

from pathlib import Path

PACKAGED_MODELS = ("demo",)


def is_packaged_name(model: str) -> bool:
    return model in PACKAGED_MODELS


def packaged_model_dir(name: str) -> Path:
    """The folder of packaged model `name` (a Hugging Face checkpoint folder)."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; choose one of {PACKAGED_MODELS}")
    folder = Path(__file__).resolve().parent / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"packaged model {name!r} is missing from {folder}: the installation lacks its "
            "package data (reinstall pdrouter)"
        )
    return folder
