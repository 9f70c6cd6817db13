"""checkpoint_digest: a short hash of a checkpoint folder's content, for the model fingerprint.

Two fine-tunes of one architecture have the same folder layout, config shapes and often the
same folder name; their KV blocks must never be shared. The digest covers:

    config.json                       every byte
    each *.safetensors file, sorted   its JSON header (tensor names, dtypes, shapes, offsets)
                                      and three 4 KiB samples of its tensor data: at the start,
                                      the middle and the end of the data section

A header alone names the architecture, not the weights (two fine-tunes share it), so the data
samples are what tells fine-tunes apart; reading 12 KiB a file keeps it cheap for checkpoints
of any size (the weights themselves are not hashed: a change that leaves every sample alone,
which training never does, would go unnoticed).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLE_BYTES = 4096
DIGEST_HEX_CHARS = 16


def checkpoint_digest(folder: str | Path) -> str:
    """16 hex chars over config.json and every safetensors file's header and data samples."""
    folder = Path(folder)
    h = hashlib.sha256(b"pdrouter/checkpoint/v1")
    config_path = folder / "config.json"
    if config_path.is_file():
        h.update(b"config.json\0")
        h.update(config_path.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.name.encode() + b"\0")
        _update_with_safetensors(h, path)
    return h.hexdigest()[:DIGEST_HEX_CHARS]


def _update_with_safetensors(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            h.update(b"short\0" + raw_len)
            return
        (header_len,) = struct.unpack("<Q", raw_len)
        header_len = min(header_len, max(0, size - 8))
        h.update(raw_len + f.read(header_len))
        data_start = 8 + header_len
        data_len = size - data_start
        for offset in sorted(
            {0, max(0, data_len // 2 - SAMPLE_BYTES // 2), max(0, data_len - SAMPLE_BYTES)}
        ):
            f.seek(data_start + offset)
            h.update(struct.pack("<Q", offset) + f.read(SAMPLE_BYTES))
