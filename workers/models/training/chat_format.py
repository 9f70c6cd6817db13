"""The demo model's special tokens and chat template, shared by the corpus and the checkpoint.

A conversation is rendered as

    <|bos|><|system|>\\n{system}<|end|>\\n            (optional)
    <|user|>\\n{question}<|end|>\\n
    <|assistant|>\\n{answer}<|end|>\\n                 (the model writes this part)

and a plain text document as `<|bos|>{text}<|eos|>`. The engine stops at `<|end|>` (listed as
an eos id in generation_config.json). Training chats are rendered by the engine's own renderer
(`workers.engine.tokenizer.Tokenizer`, jinja2 in a sandbox) from the very template string
written into tokenizer_config.json, so a served prompt is byte for byte what the model saw.
"""

from __future__ import annotations

from typing import Any

BOS_TOKEN, EOS_TOKEN, END_TOKEN = "<|bos|>", "<|eos|>", "<|end|>"
# Ids 0..5 of the vocabulary, in this order (the tokenizer trainer puts them first).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>", END_TOKEN)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant")


class ChatRenderer:
    """Renders messages with CHAT_TEMPLATE through the engine's template renderer."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models

        from workers.engine.tokenizer import Tokenizer

        # The renderer needs no vocabulary: an empty backend stands in for the one trained later.
        self._tokenizer = Tokenizer(
            HFTokenizer(models.BPE()),
            chat_template=CHAT_TEMPLATE,
            special_tokens={"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN},
        )

    def conversation(self, messages: list[dict[str, Any]]) -> str:
        """A whole conversation (ending with the assistant's turn), as trained on."""
        for message in messages:
            if message["role"] not in ROLES:
                raise ValueError(f"role {message['role']!r} is not one of {ROLES}")
        return self._tokenizer.apply_chat_template(messages, add_generation_prompt=False)

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """What a server sends the model for these messages: ends with the assistant's tag."""
        return self._tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def plain_document(text: str) -> str:
    return f"{BOS_TOKEN}{text}{EOS_TOKEN}"


def contains_special(text: str) -> bool:
    """True if text spells a special token (such text would corrupt the document bounds)."""
    return any(token in text for token in SPECIAL_TOKENS)
