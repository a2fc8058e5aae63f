"""KV transfer benchmark: pull N prefilled blocks from a source process, NIXL vs gRPC, beside a
same-process torch copy of the same blocks.

Layout: SmolLM2-135M (30 layers, 3 KV heads, head dim 64), block size 16, fp32: 737,280 bytes per
target block, plus a 1-layer EAGLE3 draft cache (24,576 bytes per block). The source process pins
the blocks and serves KVTransfer on 127.0.0.1; this process pulls them, scattered, into scattered
local blocks, timing the whole `pull` (transfer, checks, Release, and the blocks checked against
the handle's checksums, as a prefill worker's handle carries them; --no-checksums leaves them out).
Prints one JSON object, then a table.

    python -m bench.kvtransfer [--blocks 64] [--reps 5] [--no-checksums]

UCX takes its settings from the environment, which the source process inherits: try a tuning
with e.g. `UCX_CMA_SEG_SIZE=4m python -m bench.kvtransfer`. On the 2-core CPU dev machine UCX's
defaults (TCP for control messages, CMA for the READs) were the best we found; UCX_TLS=tcp or
UCX_RNDV_THRESH=8k cut NIXL to about 1 GB/s, and shared-memory-only UCX_TLS cannot connect.
"""

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time

import torch

from engine.kv_layout import CacheShape, KVLayout
from kvtransfer.backends import make_connector
from kvtransfer.layout import block_checksums, layout_to_proto
from kvtransfer.source import SERVICE_NAME, KVSource
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc
from proto.rpc import serve

LAYOUT = KVLayout("SmolLM2-135M", "float32", 16, CacheShape(30, 3, 64), CacheShape(1, 3, 64))
TOKEN = "bench-token"
BACKENDS = ("nixl", "grpc")


def _quiet_nixl() -> None:
    # NIXL logs INFO to stdout, ahead of our JSON; the source process inherits this environment.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _caches(num_blocks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.rand((num_blocks, *LAYOUT.block_shape(shape)), generator=g)
            for name, shape in LAYOUT.caches().items()}


def _serve_source(conn, num_blocks: int, threads: int) -> None:
    torch.set_num_threads(threads)
    source = KVSource(LAYOUT, _caches(num_blocks), pin_timeout_s=600, nixl=True, token=TOKEN)
    server, port = serve([(kv_pb2_grpc.add_KVTransferServicer_to_server, source.servicer, SERVICE_NAME)],
                         "127.0.0.1:0", TOKEN, internal=[SERVICE_NAME])
    conn.send(port)
    try:
        while True:
            request_id, block_ids = conn.recv()
            source.pin(request_id, block_ids, on_release=lambda: None)
            conn.send(block_checksums(source.caches, list(LAYOUT.caches()), block_ids))
    except (EOFError, OSError):  # the benchmark is done
        server.stop(None).wait()
        source.close()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _result(times: list[float], nbytes: int) -> dict:
    median = statistics.median(times)
    return {"median_ms": round(median * 1e3, 2), "best_ms": round(min(times) * 1e3, 2),
            "gb_per_s": round(nbytes / median / 1e9, 3)}


def _pull_times(backend: str, conn, address: str, local: dict[str, torch.Tensor], pinned: list[int],
                local_ids: list[int], reps: int, checksums: bool) -> list[float]:
    connector = make_connector(backend, LAYOUT, local, TOKEN)
    times = []
    for rep in range(reps + 1):
        request_id = f"{backend}-{rep}"
        conn.send((request_id, pinned))
        sums = conn.recv()
        handle = kv_pb2.KVHandle(request_id=request_id, source_address=address, layout=layout_to_proto(LAYOUT),
                                 block_ids=pinned, block_checksums=sums if checksums else [])
        times.append(_seconds(lambda: connector.pull(handle, pinned, local_ids, timeout_s=120)))
    connector.close()
    return times[1:]  # the first pull also sets up the connection and fetches NIXL metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per pull (default 64, about 49 MB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    ap.add_argument("--no-checksums", action="store_true", help="handles without the pinned blocks' checksums")
    args = ap.parse_args()
    _quiet_nixl()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    num_source = 2 * args.blocks  # room to scatter the prompt's blocks, as a real block table is
    pinned = rng.sample(range(num_source), args.blocks)
    local_ids = rng.sample(range(args.blocks), args.blocks)
    nbytes = args.blocks * LAYOUT.bytes_per_block()
    source_caches, local = _caches(num_source), _caches(args.blocks)

    def memcpy() -> None:
        for name, cache in local.items():
            for r, l in zip(pinned, local_ids):
                cache[l].copy_(source_caches[name][r])

    results = {"memcpy": _result([_seconds(memcpy) for _ in range(args.reps)], nbytes)}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_serve_source, args=(child, num_source, args.threads), daemon=True)
    process.start()
    child.close()  # so a dead source shows as EOFError here, not a hang
    address = f"127.0.0.1:{conn.recv()}"
    for backend in BACKENDS:
        for cache in local.values():
            cache.zero_()
        times = _pull_times(backend, conn, address, local, pinned, local_ids, args.reps, not args.no_checksums)
        results[backend] = _result(times, nbytes)
        assert all(torch.equal(local[n][l], source_caches[n][r]) for n in local for r, l in zip(pinned, local_ids))
    conn.close()
    process.join()
    _report(args, nbytes, results)


def _report(args: argparse.Namespace, nbytes: int, results: dict[str, dict]) -> None:
    report = {"blocks": args.blocks, "bytes": nbytes, "checksums": not args.no_checksums,
              "block_bytes": {n: LAYOUT.block_bytes(s) for n, s in LAYOUT.caches().items()},
              "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}, "results": results,
              "nixl_vs_memcpy": round(results["nixl"]["gb_per_s"] / results["memcpy"]["gb_per_s"], 3)}
    print(json.dumps(report))
    print(f"\n{args.blocks} blocks, {nbytes / 1e6:.1f} MB per pull, median of {args.reps}")
    print(f"{'path':<8}{'median ms':>11}{'best ms':>10}{'GB/s':>8}")
    for path, r in results.items():
        print(f"{path:<8}{r['median_ms']:>11}{r['best_ms']:>10}{r['gb_per_s']:>8}")


if __name__ == "__main__":
    main()
