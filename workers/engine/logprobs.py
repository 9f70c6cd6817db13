"""Log probabilities of sampled tokens, from the runner's float32 logits, in numpy.

What OpenAI and vLLM (its default `raw_logprobs`) report: the log-softmax of the model's raw
logits, before temperature, top-k or top-p shape the sampling distribution, for the sampled
token and for the k most likely tokens (ties: lowest token id first, as the sampler orders
them). Computed in float64 so that a token's value does not depend on which process (mixed,
P or D) computed the row.
"""

from __future__ import annotations

import numpy as np

from workers.engine.api import SampledLogprobs
from workers.engine.sampler import best_ids


def sampled_logprobs(logits_row: np.ndarray, token_id: int, num_top: int) -> SampledLogprobs:
    """token_id's log probability in logits_row ([vocab_size]) and the num_top most likely."""
    row = logits_row.astype(np.float64)
    peak = np.max(row)
    log_z = peak + np.log(np.sum(np.exp(row - peak)))
    top_ids = best_ids(row, num_top) if num_top > 0 else np.empty(0, dtype=np.int64)
    return SampledLogprobs(
        token_id=int(token_id),
        logprob=float(row[token_id] - log_z),
        top=tuple((int(i), float(row[i] - log_z)) for i in top_ids),
    )
