"""The base of every OpenAI request model: strict types, unknown fields ignored, null omitted.

Shared by the request models of `pdrouter.wire.openai` and `pdrouter.wire.structured`, so
that a response format or a tool definition is parsed by the same rules as the body around it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        """A null optional field takes its default; a null required one is reported missing."""
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None}
        return data
