"""A character tokenizer for control-plane tests: token id i is the text chr(i).

Stands in for the model's tokenizer where only the detokenizer protocol matters (scheduler,
stop handling, the engine loop over the numpy runner); the real Tokenizer is what the
end-to-end tests use.
"""

from __future__ import annotations


class CharDetokenizer:
    def push(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


class CharTokenizer:
    def __init__(self, vocab_size: int = 128, eos_token_ids: tuple[int, ...] = (0,)) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def new_detokenizer(self) -> CharDetokenizer:
        return CharDetokenizer()
