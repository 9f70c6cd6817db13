"""Build the demo model's training corpus from the running Python's standard library.

    python -m workers.models.training.corpus --out /tmp/demo-corpus.jsonl.gz

One JSON object a line, gzip'd with no name and a fixed timestamp (equal corpora, equal files):

    {"split": "train" | "val", "kind": "text" | "chat", "source": "json", "text": "<|bos|>..."}

`text` is final: special tokens spelled out, chats already rendered through the chat
template. A whole module (all its docstrings, comments and questions) lands in one split, by a
hash of its name: the validation split is text the model never trained on. The same Python
(version and build) gives the same file; its sha256 is printed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from workers.models.training.chat_format import ChatRenderer, contains_special, plain_document
from workers.models.training.chat_pairs import conversations, identity_pairs, qa_pairs
from workers.models.training.stdlib_text import (
    DocEntry,
    comment_entries,
    extension_entries,
    source_entries,
    stdlib_root,
    topic_entries,
)

VAL_ONE_IN = 25  # about 4% of the modules (and topics) are held out


def split_of(source: str) -> str:
    if source == "identity":
        return "train"
    digest = int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "big")
    return "val" if digest % VAL_ONE_IN == 0 else "train"


def collect_entries() -> list[DocEntry]:
    root = stdlib_root()
    entries = [
        *source_entries(root),
        *extension_entries(),
        *topic_entries(),
        *comment_entries(root),
    ]
    return [e for e in entries if not contains_special(e.text)]


def plain_text(entry: DocEntry) -> str:
    if entry.kind == "function":
        return f"{entry.name}{entry.signature}\n\n{entry.text}"
    if entry.kind in ("module", "class"):
        return f"{entry.kind.capitalize()} {entry.name}\n\n{entry.text}"
    return entry.text


def records(entries: list[DocEntry], seed: int) -> Iterator[dict[str, str]]:
    for entry in entries:
        yield {"source": entry.module, "kind": "text", "text": plain_document(plain_text(entry))}
    renderer = ChatRenderer()
    pairs = [*qa_pairs(entries, seed), *identity_pairs()]
    for source, messages in conversations(pairs, seed):
        yield {"source": source, "kind": "chat", "text": renderer.conversation(messages)}


def build(out: Path, seed: int) -> dict[str, object]:
    entries = collect_entries()
    rows = [dict(r, split=split_of(r["source"])) for r in records(entries, seed)]
    # Shuffled once here: the trainer reads windows of the concatenated documents, and
    # neighbours should not all be one module's.
    random.Random(seed).shuffle(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        for row in rows:
            line = {k: row[k] for k in ("split", "kind", "source", "text")}
            f.write((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
    counts = Counter((r["split"], r["kind"]) for r in rows)
    chars: Counter[str] = Counter()
    for r in rows:
        chars[r["split"]] += len(r["text"])
    return {
        "python": sys.version.split()[0],
        "entries": len(entries),
        "documents": {f"{s}/{k}": n for (s, k), n in sorted(counts.items())},
        "chars": dict(sorted(chars.items())),
        "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
    }


def read_corpus(path: str | Path) -> list[dict[str, str]]:
    """The rows of a corpus file, in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the .jsonl.gz to write")
    parser.add_argument("--seed", type=int, default=0, help="question phrasings and order")
    args = parser.parse_args(argv)
    stats = build(args.out, args.seed)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
