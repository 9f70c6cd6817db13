"""The sampling controls of completions and chat requests beyond temperature and top_p.

OpenAI's `presence_penalty`, `frequency_penalty` (-2..2) and `logit_bias` (token id -> -100..100),
and the extensions vLLM and SGLang take: `repetition_penalty` (> 0, 1 is off), `min_p` (0..1),
`min_tokens` (>= 0, at most max_tokens). top_k and stop_token_ids are declared with the other
fields in `pdrouter.wire.openai`. The engine applies them (workers.engine.penalties) on the
prefill worker's first token and the decode worker's rest alike.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# OpenAI's bounds
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)

TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,18}$")]
LogitBias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]


class SamplingControls(BaseModel):
    """Mixed into `pdrouter.wire.openai._SamplingRequest` (strict types, null is omitted)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float | None = Field(None, gt=0.0)
    # Keys are token ids written as JSON strings, as OpenAI's API takes them.
    logit_bias: dict[TokenIdKey, LogitBias] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) sorted by token id; a token id spelled twice ("7", "07") keeps the
        last value given."""
        by_id = {int(key): value for key, value in (self.logit_bias or {}).items()}
        return tuple(sorted(by_id.items()))

    def check_min_tokens(self, max_tokens: int | None) -> str | None:
        """Why min_tokens cannot be honoured with max_tokens (the one given), else None."""
        if self.min_tokens is not None and max_tokens is not None and self.min_tokens > max_tokens:
            return f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})"
        return None
