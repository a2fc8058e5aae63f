"""Read a pdspec process's Prometheus /metrics (router or worker): its samples, and sums of one
metric over the label sets that match. Used by the benchmarks that watch a running cluster and
by the tests that check what it exports."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, tuple[tuple[str, str], ...], float]  # name, labels, value


def scrape(url: str) -> list[Sample]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of sample `name` over the label sets that include `labels` (0 if none)."""
    return sum(v for n, ls, v in samples if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def metric(url: str, name: str, **labels: str) -> float:
    """`total` of one sample at `url` now."""
    return total(scrape(url), name, **labels)
