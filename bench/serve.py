"""Cluster benchmarks through the public gRPC API, each a pair of local clusters on loopback
driven by the same load (`deploy/loadgen.py`, what `pdspec bench serve` runs):

- routing:  KV-aware vs round-robin prefill choice, 2 prefill + 1 decode workers, 8 long shared
            system prompts (~600 tokens) with varied questions, Poisson arrivals. Compares prefill
            tokens computed and TTFT.
- ttft:     a unique ~512-token prompt at a time: disaggregated over NIXL (1 prefill + 1 decode)
            vs one aggregated worker. The difference is the hand-off's cost (hand-off RPCs, the
            KV pull, admission on the decode side).
- load:     aggregated vs disaggregated (1 + 1, NIXL) under Poisson chat traffic with EAGLE3:
            TTFT, inter-token latency, throughput, acceptance.

    python -m bench.serve [--scenarios routing ttft load] [--rate R] [--num-requests N]

Prints one JSON object, then a table per scenario. Every worker gets one thread (OMP), so the
replicas of a scenario share this machine's cores instead of spinning against each other.
"""

import argparse
import json
from pathlib import Path

from deploy.config import parse_config
from deploy.loadgen import make_workload, print_table, run_load, shared_prefix, summarize
from deploy.local import LocalCluster
from engine.spec.prompts import read_prompts

CHAT_PROMPTS = Path(__file__).parent / "prompts" / "chat_eval.jsonl"
ENGINE = {"num_kv_blocks": 1024, "max_num_seqs": 16,
          "speculative": {"method": "eagle3", "num_speculative_tokens": 2}}
NIXL = {"kv_transfer": "nixl", "num_threads": 1}
DISAGGREGATED = {"prefill": {"replicas": 1, **NIXL}, "decode": {"replicas": 1, **NIXL}}
AGGREGATED = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1, "num_threads": 2}}
KEYS = ["requests", "errors", "mean_prompt_tokens", "prefill_tokens_computed", "cached_prompt_tokens",
        "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s", "tau", "prefill_workers"]


def _measure(roles: dict, router: dict, workload, rate: float, max_tokens: int) -> dict:
    config = parse_config({"engine": ENGINE, "router": {"port": 0, **router}, **roles})
    cluster = LocalCluster(config, 0).start()
    try:
        run_load(cluster.router_address, workload[:2], 0, 4)  # warm-up: kernels, first allocations
        return summarize(*run_load(cluster.router_address, workload[2:], rate, max_tokens))
    finally:
        cluster.stop()


def routing(args, questions: list[str]) -> dict[str, dict]:
    # Warm-up requests draw from the same prefixes: the measured run starts from the cache state
    # either router would have built by then.
    workload = make_workload(questions, args.num_requests + 2, num_prefixes=8, prefix_tokens=600)
    roles = {"prefill": {"replicas": 2, **NIXL}, "decode": {"replicas": 1, **NIXL}}
    return {policy: _measure(roles, {"policy": policy}, workload, args.rate, 16) for policy in ("kv", "round_robin")}


def ttft(args, questions: list[str]) -> dict[str, dict]:
    n = min(args.num_requests, 12) + 2
    unique = [f"{shared_prefix(k, 512)}\n{questions[k % len(questions)]}" for k in range(n)]  # no cache hits
    workload = make_workload(unique, n)
    return {name: _measure(roles, {}, workload, 0, 4)
            for name, roles in (("aggregated", AGGREGATED), ("disaggregated", DISAGGREGATED))}


def load(args, questions: list[str]) -> dict[str, dict]:
    workload = make_workload(questions, args.num_requests + 2)
    return {name: _measure(roles, {}, workload, args.rate, 64)
            for name, roles in (("aggregated", AGGREGATED), ("disaggregated", DISAGGREGATED))}


SCENARIOS = {"routing": routing, "ttft": ttft, "load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (routing, load)")
    parser.add_argument("--num-requests", type=int, default=24)
    args = parser.parse_args()
    questions = read_prompts(CHAT_PROMPTS)
    results = {name: SCENARIOS[name](args, questions) for name in args.scenarios}
    print(json.dumps({"rate": args.rate, "num_requests": args.num_requests, "results": results}))
    for name, rows in results.items():
        print(f"\n{name}")
        print_table(rows, KEYS)


if __name__ == "__main__":
    main()
