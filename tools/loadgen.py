"""`pdspec bench serve`: open-loop load against a running router, measured from the client side,
through the gRPC API or the OpenAI HTTP API.

Requests arrive as a Poisson process at `rate` per second (rate 0: one at a time, each sent when
the previous one finished), so a slow server faces a growing queue instead of a politely waiting
client. Each request streams its answer; from the stream we take TTFT (send to first token),
inter-token latency (each chunk's gap spread evenly over its tokens: speculation delivers
several tokens per chunk), and from the last response usage (prompt tokens the server computed
versus served from a prefix cache) and acceptance.

Over HTTP an SSE chunk carries text, not token ids, and a message whose tokens decoded to no text
yet sends no chunk: there each chunk's gap is spread over the answer's mean tokens per chunk
(1 without speculation, where both APIs measure the same thing).

Optional shared prefixes model the traffic KV-aware routing is for: `num_prefixes` long system
prompts (documents of about `prefix_tokens` tokens), each request carrying one drawn at random
(seeded) before its question. Random, not request i mod `num_prefixes`: a cycle would line up
with round-robin's and hand that policy perfect cache affinity for free.
"""

import contextlib
import functools
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import httpx

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


Sender = Callable[[list[common_pb2.ChatMessage]], RequestRecord]


def run_load(target: str, workload: list[list[common_pb2.ChatMessage]], rate: float, max_tokens: int,
             seed: int = 0, timeout_s: float = 600.0, api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send the workload to `target`: a router's gRPC HOST:PORT, or the base URL of its OpenAI API
    (http://HOST:PORT/v1), with `api_key` if the router asks for one. Returns a record per request
    and the wall time from first send to last token."""
    with _sender(target, max_tokens, timeout_s, len(workload), api_key) as send:
        start = time.perf_counter()
        records: list = [None] * len(workload)
        if rate <= 0:
            for i, messages in enumerate(workload):
                _record_into(records, i, send, messages)
        else:
            # A thread per request: an arrival never waits for an earlier request to finish. Daemon
            # threads: an interrupted run exits without waiting out the requests in flight.
            threads = []
            for i, (messages, at) in enumerate(zip(workload, arrival_times(len(workload), rate, seed))):
                time.sleep(max(0.0, start + at - time.perf_counter()))
                threads.append(threading.Thread(target=_record_into, args=(records, i, send, messages), daemon=True))
                threads[-1].start()
            for thread in threads:
                thread.join()
    return records, max((r.done or r.sent) for r in records) - start


def _record_into(records: list, i: int, send: Sender, messages: list[common_pb2.ChatMessage]) -> None:
    """records[i] = send(messages); a failure outside the request's own errors is its record's too."""
    sent = time.perf_counter()
    try:
        records[i] = send(messages)
    except Exception as e:  # a malformed answer, say: counted as an error, not a lost record
        records[i] = RequestRecord(sent=sent, done=time.perf_counter(), error=f"{type(e).__name__}: {e}")


@contextlib.contextmanager
def _sender(target: str, max_tokens: int, timeout_s: float, concurrency: int, api_key: str | None) -> Iterator[Sender]:
    authorization = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if target.startswith(("http://", "https://")):
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        with httpx.Client(base_url=target, limits=limits, timeout=timeout_s, headers=authorization) as client:
            yield functools.partial(_one_http, client, max_tokens=max_tokens)
    else:
        with grpc.insecure_channel(target) as channel:
            yield functools.partial(_one, router_pb2_grpc.RouterStub(channel), max_tokens=max_tokens,
                                    timeout_s=timeout_s, metadata=tuple(authorization.items()))


def _one(stub, messages, max_tokens: int, timeout_s: float, metadata: tuple) -> RequestRecord:
    request = router_pb2.GenerateRequest(messages=router_pb2.MessageList(messages=messages),
                                         sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True))
    record = RequestRecord(sent=time.perf_counter())
    last_at, last = record.sent, None
    try:
        for last in stub.Generate(request, timeout=timeout_s, metadata=metadata):
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


def _one_http(client: httpx.Client, messages, max_tokens: int) -> RequestRecord:
    # Greedy, as the gRPC requests are (the HTTP API's own default is OpenAI's temperature 1).
    body = {"messages": [{"role": m.role, "content": m.content} for m in messages], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record, chunks = RequestRecord(sent=time.perf_counter()), []
    try:
        with client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
            else:
                _read_events(response, record, chunks)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.done = time.perf_counter()
    if chunks:
        record.first, record.second = chunks[0], chunks[1] if len(chunks) > 1 else None
        per_chunk = max(1.0, (record.completion_tokens - 1) / max(1, len(chunks) - 1))
        record.token_gaps = [(b - a) / per_chunk for a, b in zip(chunks, chunks[1:])]
    return record


def _read_events(response: httpx.Response, record: RequestRecord, chunks: list[float]) -> None:
    """Note when each chunk with text arrived, and the final usage, acceptance or error."""
    for line in response.iter_lines():
        if not line.startswith("data: {"):  # blank separators and the closing [DONE]
            continue
        data = json.loads(line.removeprefix("data: "))
        if "error" in data:
            record.error = data["error"]["message"]
            return
        if data["choices"] and data["choices"][0].get("delta", {}).get("content"):
            chunks.append(time.perf_counter())
        if data.get("usage"):
            usage = data["usage"]
            record.completion_tokens, record.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
            record.cached_prompt_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        if "pdspec" in data:  # the last choice's extension: speculation's outcome
            a = data["pdspec"]["acceptance"]
            record.drafted, record.accepted, record.steps = a["drafted"], a["accepted"], a["steps"]


def summarize(records: list[RequestRecord], wall_s: float | None) -> dict:
    """`wall_s`: the time the records were sent over (None: they are a selection, not a run, and
    give no rates)."""
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
        "e2e_ms_p50": _pct([1000 * (r.done - r.sent) for r in ok], 50),
        "output_tokens_per_s": _rate(sum(r.completion_tokens for r in ok), wall_s, 2),
        "requests_per_s": _rate(len(ok), wall_s, 3),
        "mean_prompt_tokens": round(statistics.fmean(r.prompt_tokens for r in ok), 1) if ok else 0.0,
        "prefill_tokens_computed": sum(r.prompt_tokens - r.cached_prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        # Tokens emitted per verification step (accepted drafts + the target's own token).
        "tau": round((sum(r.accepted for r in ok) + steps) / steps, 3) if steps else None,
        "prefill_workers": _counts(r.prefill_worker for r in ok),
        "first_error": next((r.error for r in records if r.error), ""),
    }


def _rate(count: int, wall_s: float | None, digits: int) -> float | None:
    if wall_s is None:
        return None
    return round(count / wall_s, digits) if wall_s > 0 else 0.0


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
