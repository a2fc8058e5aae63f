"""The Grafana dashboard's main plots (deploy/helm/pdspec/dashboards/pdspec.json), drawn from a
real run: a local cluster with the shipped local.yaml's engine (1 prefill + 1 decode over NIXL,
EAGLE3) under Poisson chat load through the OpenAI API, its router and workers scraped every
second, each plot computed as the dashboard's query computes it over a sliding window.

    python -m bench.dashboard [--rate 1.0] [--num-requests 60] [--out docs/images/dashboard.png]

Prints the load's summary as JSON and a table; writes the PNG.
"""

import argparse
import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt  # the bench extra; without a display it draws with Agg

from deploy.config import load_config, with_router
from deploy.local import LocalCluster
from tools.loadgen import make_workload, print_table, run_load, summarize
from tools.prompts import read_prompts
from tools.scrape import Sample, scrape, total

ROOT = Path(__file__).resolve().parents[1]
WINDOW_S = 10.0  # the plots' rate window, as the dashboard's $__rate_interval


def buckets(samples: list[Sample], name: str) -> dict[float, float]:
    """Cumulative counts per upper bound, summed over every other label."""
    out: dict[float, float] = defaultdict(float)
    for n, ls, v in samples:
        if n == f"{name}_bucket":
            out[float(dict(ls)["le"])] += v
    return dict(sorted(out.items()))


def quantile(q: float, now: dict[float, float], then: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over the window's increase (linear within a bucket)."""
    counts = [(le, c - then.get(le, 0.0)) for le, c in now.items()]
    if not counts or counts[-1][1] <= 0:
        return None
    rank, lower, below = q * counts[-1][1], 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = le, cumulative
    return None


def series(snapshots: list[tuple[float, dict[str, list[Sample]]]]) -> dict[str, list[tuple[float, float | None]]]:
    """Each plot's line: the value at every scrape, over the window ending there."""
    out: dict[str, list] = defaultdict(list)
    start = snapshots[0][0]
    for i, (t, now) in enumerate(snapshots):
        j = next(k for k, (u, _) in enumerate(snapshots) if u >= t - WINDOW_S)
        if j == i:
            continue
        dt, then, x = t - snapshots[j][0], snapshots[j][1], t - start
        r_now, r_then = now["router"], then["router"]
        for metric, label in (("pdspec_time_to_first_token_seconds", "ttft"), ("pdspec_inter_token_latency_seconds", "itl")):
            for q in (0.5, 0.99):
                value = quantile(q, buckets(r_now, metric), buckets(r_then, metric))
                out[f"{label} p{round(q * 100)}"].append((x, None if value is None else 1000 * value))
        delta = {name: total(r_now, name) - total(r_then, name) for name in
                 ("pdspec_generation_tokens_total", "pdspec_spec_accepted_tokens_total",
                  "pdspec_spec_verification_steps_total")}
        out["output tokens/s"].append((x, delta["pdspec_generation_tokens_total"] / dt))
        steps = delta["pdspec_spec_verification_steps_total"]
        out["acceptance length"].append((x, 1 + delta["pdspec_spec_accepted_tokens_total"] / steps if steps else None))
        for worker in sorted(w for w in now if w != "router"):
            out[f"KV blocks used {worker}"].append((x, total(now[worker], "pdspec_kv_blocks_used")))
        moved = sum(total(now[w], "pdspec_kv_transfer_bytes_total") - total(then[w], "pdspec_kv_transfer_bytes_total")
                    for w in now if w != "router")
        out["hand-off MB/s"].append((x, moved / dt / 1e6))
    return out


PANELS = [("time to first token (ms)", ["ttft p50", "ttft p99"]), ("inter-token latency (ms)", ["itl p50", "itl p99"]),
          ("output tokens/s", ["output tokens/s"]), ("KV blocks in use", "KV blocks used"),
          ("mean acceptance length", ["acceptance length"]), ("KV hand-off MB/s", ["hand-off MB/s"])]


def draw(lines: dict[str, list], out: Path, title: str) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (panel, names) in zip(axes.flat, PANELS):
        chosen = [n for n in lines if n.startswith(names)] if isinstance(names, str) else names
        for name in chosen:
            points = [(x, y) for x, y in lines[name] if y is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name.removeprefix("KV blocks used "))
        ax.set_title(panel)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)


def run(rate: float, num_requests: int, max_tokens: int) -> tuple[dict, list]:
    config = with_router(load_config(ROOT / "deploy" / "configs" / "local.yaml"), "bench.dashboard", port=0, http_port=0)
    cluster = LocalCluster(config, 0).start()
    try:
        urls = {"router": cluster.http_url.removesuffix("/v1") + "/metrics"}
        urls |= {name: f"http://{w.metrics_address}/metrics" for name, w in cluster.workers().items()}
        questions = read_prompts(ROOT / "bench" / "prompts" / "chat_eval.jsonl")
        run_load(cluster.http_url, make_workload(questions, 2), 0, 4)  # warm-up
        result: dict = {}

        def send() -> None:
            workload = make_workload(questions, num_requests)
            result["summary"] = summarize(*run_load(cluster.http_url, workload, rate, max_tokens))

        load = threading.Thread(target=send)
        snapshots = [(time.monotonic(), {name: scrape(url) for name, url in urls.items()})]
        load.start()
        while load.is_alive():
            time.sleep(1.0)
            snapshots.append((time.monotonic(), {name: scrape(url) for name, url in urls.items()}))
        return result["summary"], snapshots
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second, Poisson arrivals")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "dashboard.png")
    args = parser.parse_args()
    summary, snapshots = run(args.rate, args.num_requests, args.max_tokens)
    draw(series(snapshots), args.out, f"pdspec, local.yaml (1 prefill + 1 decode, NIXL, EAGLE3): "
         f"{args.num_requests} chat requests at {args.rate:g}/s over the OpenAI API")
    print(json.dumps({"rate": args.rate, "num_requests": args.num_requests, "png": str(args.out), "summary": summary}))
    print_table({"load": summary}, list(summary))


if __name__ == "__main__":
    main()
