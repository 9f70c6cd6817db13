"""Read a server's /metrics the way an operator's scraper would, for tests of every package."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metrics_of(base_url: str) -> dict[str, float]:
    """Every sample of base_url/metrics as {'name{label="v",...}': value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
