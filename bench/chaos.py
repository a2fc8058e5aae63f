"""A chaos run: a local cluster of 2 prefill + 2 decode workers (the shipped local.yaml's engine,
NIXL hand-off) under steady Poisson load over gRPC, while a random worker is killed (SIGKILL)
every `--kill-every` seconds; the local launcher's supervisor brings each back. Loopback only,
bounded by `--num-requests`.

    python -m bench.chaos [--rate 2] [--num-requests 240] [--kill-every 20] [--max-tokens 32]

Every request must end with an answer or a status: it is completed, refused before its first
token (retried by the router first, then RESOURCE_EXHAUSTED or UNAVAILABLE), or failed
mid-stream (allowed only on a decode worker killed while it streamed); anything else is lost.
After the load, every worker must hold no KV blocks. TTFT is compared between requests sent
while a killed worker was down (kill to re-registration) and the rest. Prints JSON and a table.
"""

import argparse
import json
import random
import threading
import time
from pathlib import Path

from deploy.config import load_config, with_router
from deploy.local import LocalCluster
from tools.loadgen import RequestRecord, make_workload, print_table, run_load
from tools.prompts import read_prompts
from tools.scrape import metric

ROOT = Path(__file__).resolve().parents[1]
VICTIMS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


class Killer(threading.Thread):
    """Every `every_s` seconds: SIGKILL a random worker, then time its way back (re-registered at a
    new address). `faults`: (name, killed at, back at) on the loadgen's clock."""

    def __init__(self, cluster: LocalCluster, every_s: float, seed: int) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.cluster, self.every_s, self.rng = cluster, every_s, random.Random(seed)
        self.faults: list[tuple[str, float, float | None]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            name = self.rng.choice(VICTIMS)
            before = self.cluster.workers().get(name)
            killed = time.perf_counter()
            self.cluster.kill(name)
            back = None
            while back is None and time.perf_counter() - killed < 120:
                worker = self.cluster.workers().get(name)
                if worker is not None and (before is None or worker.address != before.address):
                    back = time.perf_counter()
                time.sleep(0.1)
            self.faults.append((name, killed, back))


def classify(records: list[RequestRecord], max_tokens: int, faults: list) -> dict:
    def down(t: float) -> bool:
        return any(killed <= t <= (back or float("inf")) for _, killed, back in faults)

    killed_decode = [(name, killed) for name, killed, _ in faults if name.startswith("decode")]
    out = {"sent": len(records), "completed": 0, "refused_early": 0, "failed_mid_stream": 0,
           "failed_mid_stream_not_on_a_killed_decode_worker": 0, "lost": 0}
    ttft = {"during_faults": [], "outside_faults": []}
    for r in records:
        if r.error and r.first is None:
            out["refused_early"] += 1
        elif r.error:
            out["failed_mid_stream"] += 1
            if not any(name == r.decode_worker and r.first <= at <= r.done for name, at in killed_decode):
                out["failed_mid_stream_not_on_a_killed_decode_worker"] += 1
        elif r.completion_tokens == max_tokens:
            out["completed"] += 1
        else:
            out["lost"] += 1
        if r.first is not None:
            ttft["during_faults" if down(r.sent) else "outside_faults"].append(1000 * (r.first - r.sent))
    for window, values in ttft.items():
        values.sort()
        out[f"ttft_ms_p99_{window}"] = round(values[min(len(values) - 1, int(0.99 * len(values)))], 1) if values else None
        out[f"requests_{window}"] = len(values)
    return out


def run(args: argparse.Namespace) -> dict:
    config = with_router(load_config(ROOT / "deploy" / "configs" / "local.yaml"), "bench.chaos", port=0,
                         http_port=None)
    config = config.model_copy(update={"prefill": config.prefill.model_copy(update={"replicas": 2}),
                                       "decode": config.decode.model_copy(update={"replicas": 2})})
    cluster = LocalCluster(config, 0).start()
    try:
        questions = read_prompts(ROOT / "bench" / "prompts" / "chat_eval.jsonl")
        run_load(cluster.router_address, make_workload(questions, 4), 0, 4)  # warm-up
        killer = Killer(cluster, args.kill_every, args.seed)
        killer.start()
        records, wall = run_load(cluster.router_address, make_workload(questions, args.num_requests), args.rate,
                                 args.max_tokens, args.seed, timeout_s=300)
        killer.done.set()
        killer.join()
        time.sleep(2 * config.router.heartbeat_interval_s)
        leaked = {}
        for name, worker in cluster.workers().items():
            deadline = time.monotonic() + 30
            while (used := metric(f"http://{worker.metrics_address}/metrics", "pdspec_kv_blocks_used")) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            leaked[name] = used
        result = classify(records, args.max_tokens, killer.faults)
        result |= {"wall_s": round(wall, 1), "kills": [name for name, _, _ in killer.faults],
                   "seconds_to_come_back": [None if back is None else round(back - killed, 1)
                                            for _, killed, back in killer.faults],
                   "blocks_left": leaked, "workers_listed_after": sorted(cluster.workers())}
        return result
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second, Poisson arrivals")
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    result = run(parser.parse_args())
    print(json.dumps(result))
    print_table({"chaos": result}, list(result))


if __name__ == "__main__":
    main()
