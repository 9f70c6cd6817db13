"""GET /v1/models/{model_id} on the router and the workers: one card, or 404."""

from __future__ import annotations

from collections.abc import Sequence

from pdrouter.wire.errors import APIError, clip
from pdrouter.wire.openai import ModelCard


def model_card(model_id: str, served: Sequence[str], max_model_len: int | None) -> ModelCard:
    """The card of a model served (OpenAI's `client.models.retrieve`), else 404
    model_not_found."""
    if model_id not in served:
        raise APIError(
            404,
            f"The model {clip(model_id)!r} does not exist",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )
    return ModelCard(id=model_id, max_model_len=max_model_len)
