"""What one benchmark case measured in one phase (shared by the runner and the report)."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.router.load import LoadResult

# Every case the router benchmark knows, in the order tables list them.
CASES = (
    "direct",
    "bare",
    "bare-raw",
    "pdrouter",
    "pdrouter-aiohttp",
    "pdrouter-traced",
    "pdrouter-baseline",
    "toy",
    "sglang",
)


@dataclass(frozen=True)
class Phase:
    concurrency: int
    num_tokens: int

    @property
    def name(self) -> str:
        return f"c={self.concurrency}, {self.num_tokens} tokens"


@dataclass
class CaseStats:
    """Everything one case measured in one phase, over all its windows."""

    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    # The router's process group (the decode mock's for `direct`); None where not measurable:
    # in the interleaved phase the decode mock serves every case at once.
    cpu_s: float | None = 0.0

    def add(self, load: LoadResult, cpu_s: float | None) -> None:
        self.latencies_s.extend(load.latencies_s)
        self.ttfts_s.extend(load.ttfts_s)
        self.elapsed_s += load.elapsed_s
        self.cpu_s = None if cpu_s is None or self.cpu_s is None else self.cpu_s + cpu_s

    @property
    def num_requests(self) -> int:
        return len(self.latencies_s)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s else 0.0

    def latency_ms(self, q: float) -> float:
        return 1000 * _quantile(self.latencies_s, q)

    def ttft_ms(self, q: float) -> float:
        return 1000 * _quantile(self.ttfts_s, q)

    @property
    def cpu_ms_per_request(self) -> float:
        if self.cpu_s is None or not self.num_requests:
            return float("nan")
        return 1000 * self.cpu_s / self.num_requests


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
