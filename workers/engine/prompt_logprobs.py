"""Prompt logprobs: each prompt token's log probability given the tokens before it.

A request whose SamplingParams.prompt_logprobs is set marks its prompt chunks
(ScheduledChunk.prompt_logprobs); the runner then returns the logits after every token of
those chunks (RunnerOutput.prompt_logits), and this module turns row r of a chunk starting at
position s into the entry of prompt token s + r + 1 (the last prompt position's row gives the
first sampled token's distribution, which the sampler reports). Values are the sampled
tokens' (workers.engine.logprobs): log-softmax of the raw logits, in float64. Nothing is
computed for a request that did not ask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from workers.engine.batch import ScheduledBatch
from workers.engine.logprobs import sampled_logprobs
from workers.engine.request_state import RequestState


def record_prompt_logprobs(
    requests: Mapping[str, RequestState], batch: ScheduledBatch, prompt_logits: Sequence[np.ndarray]
) -> None:
    """Store the entries the batch's prompt chunks computed into their requests' states."""
    chunks = [c for c in batch.chunks if c.prompt_logprobs]
    assert len(chunks) == len(prompt_logits), "one logits block per prompt-logprobs chunk"
    for chunk, logits in zip(chunks, prompt_logits, strict=True):
        state = requests[chunk.request_id]
        entries = state.prompt_logprobs
        if entries is None:
            continue
        num_top = state.params.prompt_logprobs or 0
        prompt = state.prompt_token_ids
        for row in range(len(chunk.token_ids)):
            target = chunk.start_pos + row + 1  # the prompt token this row predicts
            if target < len(prompt):
                entries[target - 1] = sampled_logprobs(logits[row], prompt[target], num_top)
