"""Tokenizer: `tokenizers` for ids, jinja2 for the chat template, and a streaming detokenizer.

A checkpoint folder holds `tokenizer.json` (loaded by the `tokenizers` library) and usually
`tokenizer_config.json` (special token names and the chat template, a jinja2 string rendered in
a sandbox the way Hugging Face renders it). Without a template a plain one is used.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

# Used when tokenizer_config.json has no chat template: one "role: content" line per message.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# What a decode of an incomplete UTF-8 sequence ends with (the byte-level decoder and most
# others substitute U+FFFD for bytes that do not yet form a character).
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Text <-> token ids for one checkpoint."""

    def __init__(
        self,
        backend: Any,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """backend: a `tokenizers.Tokenizer`; special_tokens: e.g. {"bos_token": "<s>"}."""
        self._backend = backend
        self._special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template or PLAIN_CHAT_TEMPLATE
        ids = list(eos_token_ids)
        eos_name = self._special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos_name) if eos_name else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self._template = _compile_template(self.chat_template)

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load `tokenizer.json` and, if present, `tokenizer_config.json` from a folder."""
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"{tok_path} not found: the checkpoint needs a tokenizer.json")
        backend = HFTokenizer.from_file(str(tok_path))
        chat_template: str | None = None
        special: dict[str, str] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            chat_template = _pick_template(cfg.get("chat_template"))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = cfg.get(name)
                # Special tokens are either a plain string or an AddedToken dict.
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    special[name] = value
        return cls(backend, chat_template, special, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str:
        return self._special_tokens.get("bos_token", "")

    @property
    def eos_token(self) -> str:
        return self._special_tokens.get("eos_token", "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch_fast releases the GIL while Rust encodes (encode() holds it), so a long
        # prompt tokenized on a worker's CPU thread (workers.server.cpu_work) leaves the event
        # loop free; "fast": no offsets, which nothing here reads.
        (encoding,) = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def backend_json(self) -> str:
        """The `tokenizers` definition as JSON (what a grammar library builds its view from)."""
        return self._backend.to_str()

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the `tools` variable (else they go in as text)."""
        return "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render OpenAI-style messages to prompt text (special tokens spelled out as text).

        A message's content may be a string or a list of OpenAI content parts; the text parts
        are joined. Encode the result with add_special_tokens=False: the template already
        places bos where the model expects it.
        """
        for i, message in enumerate(messages):
            if "role" not in message:
                raise ValueError(f"message {i} has no 'role'")
        flat = [dict(m, content=_content_text(m.get("content"))) for m in messages]
        return self._template.render(
            messages=flat,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
        )

    def new_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character.

    Decoding token by token breaks multi-byte characters (a byte-level token may hold half of
    one) and loses the spacing some decoders add between tokens. So each push decodes a short
    window of recent tokens twice, with and without the new ones, and emits the difference:

        ids:   ... [prefix_offset ........ read_offset) [read_offset .... end)
                    already emitted context             not yet emitted
    A window ending in U+FFFD is an incomplete character: nothing is emitted until more tokens
    complete it (or flush() gives up and emits the replacement character).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often '', never a partial character)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back, incomplete characters included (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if len(full_text) <= len(prefix_text) or (
            full_text.endswith(_REPLACEMENT_CHAR) and not final
        ):
            return ""
        delta = full_text[len(prefix_text) :]
        # The emitted tokens become the next window's left context: enough for the decoder's
        # spacing rules, and the windows stay short (cost does not grow with the sequence).
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


def _compile_template(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        # Unlike jinja2's own filter: no HTML escaping, non-ASCII kept (tool schemas in prompts).
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    # Same environment, extension and helpers as Hugging Face's renderer, so real templates
    # (Llama 3's strftime_now, {% break %}, tojson on tool definitions) render alike.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _pick_template(raw: Any) -> str | None:
    # tokenizer_config.json holds either one template string or a list of named ones.
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text"
        )
    raise ValueError(f"message content must be a string or a list of parts, got {content!r}")
