"""vLLM's /metrics, read: the Prometheus text exposition through prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} for every sample (a malformed line is a
    ValueError naming it). Pure."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
