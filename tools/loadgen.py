"""`pdspec bench serve`: open-loop load against a running router, measured from the client side.

Requests arrive as a Poisson process at `rate` per second (rate 0: one at a time, each sent when
the previous one finished), so a slow server faces a growing queue instead of a politely waiting
client. Each request streams its answer; from the stream we take TTFT (send to first token),
inter-token latency (each chunk's gap spread evenly over its tokens: speculation delivers
several tokens per chunk), and from the last response usage (prompt tokens the server computed
versus served from a prefix cache) and acceptance.

Optional shared prefixes model the traffic KV-aware routing is for: `num_prefixes` long system
prompts (documents of about `prefix_tokens` tokens), each request carrying one drawn at random
(seeded) before its question. Random, not request i mod `num_prefixes`: a cycle would line up
with round-robin's and hand that policy perfect cache affinity for free.
"""

import concurrent.futures
import random
import statistics
import time
from dataclasses import dataclass, field

import grpc

from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class RequestRecord:
    sent: float
    first: float | None = None
    second: float | None = None  # when the second token arrived (with the first, if they came in one chunk)
    done: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds per token, one entry per token after the first chunk
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    error: str = ""


def shared_prefix(index: int, approx_tokens: int) -> str:
    """A deterministic policy document of roughly `approx_tokens` tokens (about 20 per sentence)."""
    sentences = [f"Rule {index}.{i}: requests about item {index * 100 + i} from office {i % 7} are answered "
                 f"within {i % 5 + 1} days." for i in range(max(1, approx_tokens // 20))]
    return f"You are support assistant number {index}. " + " ".join(sentences)


def make_workload(questions: list[str], num_requests: int, num_prefixes: int = 0,
                  prefix_tokens: int = 0, seed: int = 0) -> list[list[common_pb2.ChatMessage]]:
    """Chat messages for each request: question i mod len(questions), behind a random shared prefix."""
    if not questions:
        raise ValueError("the prompt file holds no prompts")
    prefixes = [shared_prefix(k, prefix_tokens) for k in range(num_prefixes)]
    rng, workload = random.Random(seed), []
    for i in range(num_requests):
        messages = [common_pb2.ChatMessage(role="system", content=rng.choice(prefixes))] if prefixes else []
        messages.append(common_pb2.ChatMessage(role="user", content=questions[i % len(questions)]))
        workload.append(messages)
    return workload


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate`/s."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def run_load(router_address: str, workload: list[list[common_pb2.ChatMessage]], rate: float, max_tokens: int,
             seed: int = 0, timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send the workload; returns a record per request and the wall time from first send to last token."""
    with grpc.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.perf_counter()
        if rate <= 0:
            records = [_one(stub, messages, max_tokens, timeout_s) for messages in workload]
        else:
            # A thread per request: an arrival never waits for an earlier request to finish.
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(workload)) as pool:
                futures = []
                for messages, at in zip(workload, arrival_times(len(workload), rate, seed)):
                    time.sleep(max(0.0, start + at - time.perf_counter()))
                    futures.append(pool.submit(_one, stub, messages, max_tokens, timeout_s))
                records = [f.result() for f in futures]
    return records, max((r.done or r.sent) for r in records) - start


def _one(stub, messages, max_tokens: int, timeout_s: float) -> RequestRecord:
    request = router_pb2.GenerateRequest(messages=router_pb2.MessageList(messages=messages),
                                         sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True))
    record = RequestRecord(sent=time.perf_counter())
    last_at, last = record.sent, None
    try:
        for last in stub.Generate(request, timeout=timeout_s):
            now, n = time.perf_counter(), len(last.token_ids)
            if n and record.first is None:
                record.first = now
                record.second = now if n > 1 else None
                record.prefill_worker, record.decode_worker = last.prefill_worker, last.decode_worker
            elif n:
                record.token_gaps.extend([(now - last_at) / n] * n)
                record.second = record.second or now
            if n:
                last_at = now
    except grpc.RpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    record.done = time.perf_counter()
    if last is not None:
        record.completion_tokens = last.usage.completion_tokens
        record.prompt_tokens, record.cached_prompt_tokens = last.usage.prompt_tokens, last.usage.cached_prompt_tokens
        a = last.acceptance
        record.drafted, record.accepted, record.steps = a.drafted, a.accepted, a.steps
    return record


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if not r.error and r.first is not None]
    ttft = [1000 * (r.first - r.sent) for r in ok]
    itl = [1000 * g for r in ok for g in r.token_gaps]
    steps = sum(r.steps for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "ttft_ms_mean": round(statistics.fmean(ttft), 2) if ttft else None,
        "second_token_ms_p50": _pct([1000 * (r.second - r.sent) for r in ok if r.second is not None], 50),
        "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / wall_s, 2) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "mean_prompt_tokens": round(statistics.fmean(r.prompt_tokens for r in ok), 1) if ok else 0.0,
        "prefill_tokens_computed": sum(r.prompt_tokens - r.cached_prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        # Tokens emitted per verification step (accepted drafts + the target's own token).
        "tau": round((sum(r.accepted for r in ok) + steps) / steps, 3) if steps else None,
        "prefill_workers": _counts(r.prefill_worker for r in ok),
        "first_error": next((r.error for r in records if r.error), ""),
    }


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 2)


def _counts(names) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        if name:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def print_table(rows: dict[str, dict], keys: list[str]) -> None:
    """One column per run (e.g. per policy), one line per summary key."""
    names = list(rows)
    width = max(14, *(len(n) + 2 for n in names))
    print(f"{'metric':<26}" + "".join(f"{n:>{width}}" for n in names))
    for key in keys:
        print(f"{key:<26}" + "".join(f"{str(rows[n].get(key)):>{width}}" for n in names))
