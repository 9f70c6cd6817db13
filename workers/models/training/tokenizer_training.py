"""Train the demo model's byte-level BPE tokenizer on the corpus's training split.

    python -m workers.models.training.tokenizer_training \\
        --corpus /tmp/demo-corpus.jsonl.gz --out workers/models/demo

writes tokenizer.json and tokenizer_config.json (special tokens, chat template). Byte-level
(GPT-2's alphabet and pre-tokenizer regex), so any UTF-8 text encodes without an unknown token;
the special tokens take ids 0..5 and are never split or merged into. `tokenizers` trains
deterministically: the same corpus gives the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from workers.models.training.chat_format import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    SPECIAL_TOKENS,
)
from workers.models.training.corpus import read_corpus

VOCAB_SIZE = 4096
MAX_LENGTH = 512  # the model's context (config.json's max_position_embeddings)


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """A `tokenizers.Tokenizer` with vocab_size entries, special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def without_specials() -> Any:
        # Special tokens mark document bounds; their spelling is no text to learn merges from.
        for text in texts:
            for token in SPECIAL_TOKENS:
                text = text.replace(token, "\n")
            yield text

    tok.train_from_iterator(without_specials(), trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS_TOKEN)
    # add_special_tokens=True prepends bos, as Llama's tokenizers do; prompts rendered by the
    # chat template already start with it and are encoded without.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, f"special token {token} got id {tok.token_to_id(token)}"
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer(tok: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="the model folder")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    texts = [r["text"] for r in read_corpus(args.corpus) if r["split"] == "train"]
    tok = train_tokenizer(texts, args.vocab_size)
    write_tokenizer(tok, args.out)
    num_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    chars = sum(len(t) for t in texts)
    print(
        f"vocab {tok.get_vocab_size()}; training split: {num_tokens} tokens, "
        f"{chars / num_tokens:.2f} chars per token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
