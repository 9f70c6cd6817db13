"""UsageMeter: the tokens a request has used so far, counted as its answer is relayed, so
that a request that ends early (its client gone mid-stream, a failure after tokens went
out) is settled against its key's limits for what it got, not for nothing.

    Answers (orchestrator.answer)   each prompt P (or D) computed: prompt(index, n)
                                    each batch of tokens relayed:   output(n)
    Tenancy.end                     the answer's usage when it is complete, else the meter's

A request of several sequences shares one meter among its sub-requests (each sub-request's
context is a copy that keeps the same meter): a prompt computed for n sequences counts once,
under its index, and every sequence's tokens add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UsageMeter:
    """Tokens of one request so far: each prompt's by its index, the outputs together."""

    prompt_index_to_tokens: dict[int, int] = field(default_factory=dict)
    num_output_tokens: int = 0

    def prompt(self, index: int, num_tokens: int) -> None:
        self.prompt_index_to_tokens[index] = num_tokens

    def output(self, num_tokens: int) -> None:
        self.num_output_tokens += num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_index_to_tokens.values())
