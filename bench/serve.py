"""Cluster benchmarks through the public gRPC API, each a pair of local clusters on loopback
driven by the same load (`tools/loadgen.py`, what `pdspec bench serve` runs):

- routing:  KV-aware vs round-robin prefill choice, 2 prefill + 1 decode workers, 8 long shared
            system prompts (~600 tokens, each sent once first to warm the caches) with varied
            questions, Poisson arrivals. Compares prefill tokens computed and TTFT.
- ttft:     unique 512-token prompts (on average), one at a time: disaggregated over NIXL
            (1 prefill + 1 decode) vs one aggregated worker, with and without EAGLE3, the four
            clusters taking turns on each prompt. The difference is the KV transfer's cost (RPCs,
            the KV pull, admission on the decode side, and with EAGLE3 the draft's prefill).
- load:     aggregated vs disaggregated (1 + 1, NIXL) under Poisson chat traffic with EAGLE3:
            TTFT, inter-token latency, throughput, acceptance.
- http:     the OpenAI HTTP front's cost: one disaggregated cluster without speculation (so an
            SSE chunk is one token, as a gRPC message is), the same prompts through gRPC and HTTP
            taking turns one at a time (each prompt warmed first: both find it cached), with the
            median per-prompt TTFT difference, then each API under the same Poisson load.
- fairness: a short chat request sent 0.5 s and 8 s into a ~6000-token prompt's prefill (early,
            at a short context, and late, at a long one; disaggregated, no speculation; 1 then 2
            prefill workers), against short requests alone: what chunked prefill, and then
            routing, leave a newcomer.

    python -m bench.serve [--scenarios routing ttft load] [--rate R] [--num-requests N]

Prints one JSON object, then a table per scenario. Every worker gets one thread (OMP), as a local
cluster's default gives it on two cores, so the replicas of a scenario share this machine's cores
instead of spinning against each other (the ttft scenario's get both: they never compute at once).
"""

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from deploy.config import parse_config
from tools.loadgen import make_workload, print_table, run_load, shared_prefix, summarize
from deploy.local import LocalCluster
from tools.prompts import read_prompts
from proto.pdspec.v1.common_pb2 import ChatMessage

ROUTING_PREFIXES, ROUTING_PREFIX_TOKENS, ROUTING_KV_BLOCKS = 8, 600, 240
TTFT_DOCUMENT_TOKENS = 360
FAIRNESS_LONG_TOKENS, FAIRNESS_DELAYS_S, FAIRNESS_ROUNDS = 4000, (0.5, 8.0), 3  # ~6000 tokens (~30 a sentence)
CHAT_PROMPTS = Path(__file__).parent / "prompts" / "chat_eval.jsonl"
# EAGLE3 at the engine's own defaults for the device, what `--speculative eagle3` gives (until
# 2026-11-29 the load scenario held K at 2, the ttft one took the defaults).
ENGINE = {"num_kv_blocks": 1024, "max_num_seqs": 16, "speculative": {"method": "eagle3"}}
NIXL = {"kv_transfer": "nixl", "num_threads": 1}
DISAGGREGATED = {"prefill": {"replicas": 1, **NIXL}, "decode": {"replicas": 1, **NIXL}}
# One thread a worker, as a local cluster's default gives them on two cores (the cores but one,
# split between replicas), on any machine; the ttft scenario gives its workers both cores.
AGGREGATED = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1, "num_threads": 1}}
KEYS = ["requests", "errors", "mean_prompt_tokens", "prefill_tokens_computed", "cached_prompt_tokens",
        "ttft_ms_p50", "ttft_ms_p99", "ttft_ms_mean", "second_token_ms_p50", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50",
        "output_tokens_per_s", "tau", "prefill_workers"]


@contextlib.contextmanager
def _cluster(roles: dict, router: dict, warmup, engine=ENGINE) -> Iterator[LocalCluster]:
    """A fresh local cluster, warmed up one request at a time (kernels, first allocations,
    caches)."""
    cluster = LocalCluster(parse_config({"engine": engine, "router": {"port": 0, **router}, **roles}), 0).start()
    try:
        run_load(cluster.router_address, warmup, 0, 4)
        yield cluster
    finally:
        cluster.stop()


def _measure(roles: dict, router: dict, warmup, workload, rate: float, max_tokens: int, engine=ENGINE) -> dict:
    with _cluster(roles, router, warmup, engine) as cluster:
        return summarize(*run_load(cluster.router_address, workload, rate, max_tokens))


def _take_turns(targets: dict[str, str], workload, max_tokens: int, warm: bool = False
                ) -> tuple[dict[str, dict], dict[str, list]]:
    """Each prompt once per target, one request at a time, alternating who goes first: pairs the
    samples against this VM's drifting speed. warm: each prompt once more before its pair, so both
    find it in the prefix cache alike (the front, not the prefill, is what differs). Returns the
    summaries and the records, in prompt order."""
    records: dict[str, list] = {name: [] for name in targets}
    walls = dict.fromkeys(targets, 0.0)
    for i, messages in enumerate(workload):
        if warm:
            run_load(next(iter(targets.values())), [messages], 0, 1)
        for name in sorted(targets, reverse=i % 2 == 1):
            got, wall = run_load(targets[name], [messages], 0, max_tokens)
            records[name] += got
            walls[name] += wall
    return {name: summarize(records[name], walls[name]) for name in targets}, records


def routing(args, questions: list[str]) -> dict[str, dict]:
    # Warm-up: each shared prefix once, so the run measures the steady state of a long-running
    # deployment (every prefix cached somewhere) rather than the first sight of each prefix,
    # which costs both policies the same. A worker's pool holds about 4.5 of the 8 prefixes (the
    # working set outgrows one worker's cache, as on real traffic): with unbounded caches every
    # worker ends up holding every prefix and any policy hits.
    warmup = [[ChatMessage(role="system", content=shared_prefix(k, ROUTING_PREFIX_TOKENS)),
               ChatMessage(role="user", content=questions[k])] for k in range(ROUTING_PREFIXES)]
    workload = make_workload(questions, args.num_requests, ROUTING_PREFIXES, ROUTING_PREFIX_TOKENS)
    roles = {"prefill": {"replicas": 2, **NIXL}, "decode": {"replicas": 1, **NIXL}}
    engine = {**ENGINE, "num_kv_blocks": ROUTING_KV_BLOCKS}
    return {policy: _measure(roles, {"policy": policy}, warmup, workload, args.rate, 16, engine)
            for policy in ("kv", "round_robin")}


def ttft(args, questions: list[str]) -> dict[str, dict]:
    n = args.num_requests + 2
    # Unique documents (no cache hits) sized so the chat prompts average 512 tokens.
    unique = [f"{shared_prefix(k, TTFT_DOCUMENT_TOKENS)}\n{questions[k % len(questions)]}" for k in range(n)]
    workload = make_workload(unique, n)
    # One request at a time: the prefill and decode workers never compute at once, so each gets
    # both cores, as the aggregated worker does. The clusters run side by side (idle workers cost
    # no CPU) and take turns on each prompt, which pairs the samples against this VM's drifting
    # speed. With EAGLE3 the prefill worker also runs the draft over the prompt before handing
    # off, work the aggregated worker defers until after the first token (into the second
    # token's latency); without speculation the TTFT gap is the KV transfer alone.
    both_cores = {**NIXL, "replicas": 1, "num_threads": 2}
    aggregated = {**AGGREGATED, "aggregated": {"replicas": 1, "num_threads": 2}}
    setups = {f"{mode}/{method}": (roles, {**ENGINE, "speculative": {"method": method}})
              for method in ("eagle3", "none")
              for mode, roles in (("aggregated", aggregated), ("disaggregated", {"prefill": both_cores,
                                                                                 "decode": both_cores}))}
    with contextlib.ExitStack() as stack:
        addresses = {name: stack.enter_context(_cluster(roles, {}, workload[:2], engine)).router_address
                     for name, (roles, engine) in setups.items()}
        return _take_turns(addresses, workload[2:], 4)[0]


def load(args, questions: list[str]) -> dict[str, dict]:
    workload = make_workload(questions, args.num_requests + 2)
    return {name: _measure(roles, {}, workload[:2], workload[2:], args.rate, 64)
            for name, roles in (("aggregated", AGGREGATED), ("disaggregated", DISAGGREGATED))}


def http(args, questions: list[str]) -> dict[str, dict]:
    workload = make_workload(questions, args.num_requests + 2)
    engine = {**ENGINE, "speculative": {"method": "none"}}
    with _cluster(DISAGGREGATED, {"http_port": 0}, workload[:2], engine) as cluster:
        targets = {"grpc": cluster.router_address, "http": cluster.http_url}
        rows, records = _take_turns(targets, workload[2:], 32, warm=True)
        gaps = [1000 * ((h.first - h.sent) - (g.first - g.sent)) for g, h in zip(records["grpc"], records["http"])
                if g.first is not None and h.first is not None]
        rows["http - grpc, same prompt"] = {"ttft_ms_p50": round(statistics.median(gaps), 2) if gaps else None}
        for name, target in targets.items():
            rows[f"{name}@{args.rate:g}/s"] = summarize(*run_load(target, workload[2:], args.rate, 64))
    return rows


def fairness(args, questions: list[str]) -> dict[str, dict]:
    engine = {**ENGINE, "speculative": {"method": "none"}}
    if args.long_prefill_token_threshold is not None:
        engine["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    short = make_workload(questions, 2 + (1 + len(FAIRNESS_DELAYS_S)) * FAIRNESS_ROUNDS)
    rows = {}
    for prefill_workers in (1, 2):
        roles = {**DISAGGREGATED, "prefill": {**DISAGGREGATED["prefill"], "replicas": prefill_workers}}
        alone, long = [], []
        beside: dict[float, list] = {delay: [] for delay in FAIRNESS_DELAYS_S}
        fresh = iter(short[2:])
        with _cluster(roles, {}, short[:2], engine) as cluster, concurrent.futures.ThreadPoolExecutor(1) as pool:
            for k in range(FAIRNESS_ROUNDS):
                alone += run_load(cluster.router_address, [next(fresh)], 0, 8)[0]
                for d, delay in enumerate(FAIRNESS_DELAYS_S):
                    # A document no cache holds (its first sentence names the round), then the short
                    # request once the long prompt's prefill is under way.
                    topic = 100 + k * len(FAIRNESS_DELAYS_S) + d
                    document = [ChatMessage(role="user", content=f"{shared_prefix(topic, FAIRNESS_LONG_TOKENS)}\nSummarize.")]
                    pending = pool.submit(run_load, cluster.router_address, [document], 0, 8)
                    time.sleep(delay)
                    beside[delay] += run_load(cluster.router_address, [next(fresh)], 0, 8)[0]
                    long += pending.result()[0]
        # Requests picked from rounds: latencies, no rates.
        rows[f"{prefill_workers}P: short alone"] = summarize(alone, None)
        for delay, results in beside.items():
            rows[f"{prefill_workers}P: short {delay:g} s into a long prompt"] = summarize(results, None)
        rows[f"{prefill_workers}P: the long prompt"] = summarize(long, None)
    return rows


SCENARIOS = {"routing": routing, "ttft": ttft, "load": load, "http": http, "fairness": fairness}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (routing, load)")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None,
                        help="fairness: the workers' engine.long_prefill_token_threshold (default: the schema's)")
    args = parser.parse_args()
    questions = read_prompts(CHAT_PROMPTS)
    results = {name: SCENARIOS[name](args, questions) for name in args.scenarios}
    print(json.dumps({"rate": args.rate, "num_requests": args.num_requests, "results": results}))
    for name, rows in results.items():
        print(f"\n{name}")
        print_table(rows, KEYS)


if __name__ == "__main__":
    main()
