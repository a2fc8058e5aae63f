"""pdspec against llama.cpp on the same GGUF: decode ms/token, same threads, same prompts.

For each chat prompt, taking turns (the order rotates per prompt): llama.cpp (llama-cpp-python,
in its own process so the two OpenMP runtimes never share a core), pdspec plain and pdspec with
EAGLE3 at the shipped config's settings, each decoding NEW_TOKENS greedy tokens (end-of-turn
ignored, so every run decodes the same count). A run's ms/token is (last token's time - first
token's time) / (tokens - 1): decode only, prefill excluded. llama.cpp runs with flash attention
on, as its own tools run it on CPU (llama-cpp-python's default is off: llama.cpp then took ~1.12x
the time here, and the ratios below flattered pdspec as much). Beside the medians, each run's
speed against llama.cpp paired prompt by prompt (the geometric mean of the per-prompt ratios, with
a 95 % bootstrap interval over the prompts): the host's swings hit a prompt's turns alike. Past the end of its turn the model goes
on with text unlike chat (and EAGLE3's acceptance with it), so each run is also timed up to the
position where pdspec plain's greedy answer ends (`ms_per_token_answer`, over the prompts whose
answer holds at least MIN_ANSWER tokens), and the JSON gives the share of tokens past it. Then pdspec at batch 4 and 16
(aggregate, on the file's first 4 and 16 prompts: a prompt twice in a batch would share its cached
blocks), each `--batch-reps` times in turn (a single pass swung 30-50 % on a shared host): the
median, and the range in the JSON. Prints one JSON object, then a table; `x llama.cpp` is
llama.cpp's batch-1 ms/token over the row's, `x batch 1` pdspec plain's.

    python -m bench.peer [--threads 2] [--prompts 8] [--new-tokens 128] [--batch-reps 3]
                         [--gguf FILE [--draft DIR]] [--kv-cache-dtype auto]

--gguf: another llama-architecture GGUF (default: the embedded model's); EAGLE3 runs with the
shipped head on the embedded model, with --draft's head on another, and is skipped otherwise.

Needs llama-cpp-python (the `bench` extra) built for this CPU:
    CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python==0.3.36   (8-15 min to build)
On a CPU with AMX, llama.cpp takes each prompt one token at a time (see llama_ubatch).
"""

import argparse
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import yaml
from tqdm import tqdm

from bench.engine import start_batch
from engine import cpu_kernels
from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.gguf_convert import embedded_gguf_path
from engine.params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "bench" / "prompts" / "chat_eval.jsonl"
CONFIG = ROOT / "deploy" / "configs" / "local.yaml"
MIN_ANSWER = 16  # shorter answers give an answer-only ms/token from too few steps to mean much
LLAMA_CTX = 2048


def llama_ubatch() -> int | None:
    """llama.cpp's micro-batch for the prompt: one token on a CPU with AMX, else its default (None).
    With AMX, llama-cpp-python 0.3.36 repacks the weights for its AMX kernels, whose multi-row
    path faults at `ldtilecfg` (a tile config on the stack the compiler leaves half-written:
    llama.cpp issue 20824, pull 26954) on the first prompt of two or more tokens; its one-row path
    (VNNI over the same repacked weights) is its fastest decode there (2.1-2.4x its default buffers
    on BENCHMARKS' Machine F), so the prompt goes in one token at a time: decode, the part timed, is
    one row a step either way."""
    return 1 if "amx_int8" in cpu_kernels.cpu_flags() else None


def paired_speedup(base_ms: list[float], run_ms: list[float], resamples: int = 2000) -> dict[str, object]:
    """The run's speed over the base's, prompt by prompt: the geometric mean of base_ms / run_ms and
    the 2.5th and 97.5th percentiles of it over the prompts resampled with replacement."""
    logs = [math.log(b / r) for b, r in zip(base_ms, run_ms)]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return {"geomean": round(math.exp(statistics.fmean(logs)), 3),
            "ci95": [round(math.exp(means[int(0.025 * resamples)]), 3), round(math.exp(means[int(0.975 * resamples) - 1]), 3)]}


def _llama_worker(conn, gguf: str, threads: int, ubatch: int | None) -> None:
    """llama.cpp in its own process: token ids in, per-token timestamps out."""
    from llama_cpp import Llama

    batching = {"n_batch": ubatch, "n_ubatch": ubatch} if ubatch else {}
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=LLAMA_CTX, flash_attn=True,
                verbose=False, **batching)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        tokens, n = job
        llm.reset()
        stamps = []
        for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == n:
                break
        conn.send(stamps)


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, ubatch: int | None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_llama_worker, args=(child, str(gguf), threads, ubatch), daemon=True)
        self.proc.start()
        child.close()  # the child's end lives in the child alone: its death reads as EOF here
        if self._receive() != "ready":
            raise RuntimeError("llama.cpp did not start")

    def stamps(self, tokens: list[int], n: int) -> list[float]:
        try:
            self.conn.send((tokens, n))
        except BrokenPipeError:
            self._died()
        return self._receive()

    def _receive(self):
        try:
            return self.conn.recv()
        except EOFError:  # its process died (llama.cpp aborts or faults rather than raising)
            self._died()

    def _died(self) -> NoReturn:
        self.proc.join(timeout=10)
        raise SystemExit(f"llama.cpp's process died (exit code {self.proc.exitcode}: a negative one is the signal "
                         "that killed it); run it alone to see why") from None

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=10)


def _engine_stamps(engine: Engine, tokens: list[int], n: int) -> list[float]:
    """One timestamp per generated token (a speculative step's tokens share its time)."""
    stamps = []
    for out in engine.generate(tokens, SamplingParams(max_tokens=n, ignore_eos=True)):
        stamps += [time.perf_counter()] * len(out.token_ids)
    return stamps


def _answer_length(engine: Engine, tokens: list[int], n: int) -> int:
    """Tokens in the greedy answer up to and including its end of turn (n if it runs on)."""
    answer = [t for out in engine.generate(tokens, SamplingParams(max_tokens=n)) for t in out.token_ids]
    return len(answer)


def _ms_per_token(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


def _batch_ms_per_token(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Aggregate: wall time per generated token with all prompts in one running batch, from the
    step where every request has its first token."""
    start_batch(engine, prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    start, decoded = time.perf_counter(), 0
    while engine.has_unfinished():
        decoded += sum(len(o.token_ids) for o in engine.step())
    return (time.perf_counter() - start) / decoded * 1000


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--batch-reps", type=int, default=3, help="passes over the batch sizes (median reported)")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF both run (default: the embedded model's)")
    ap.add_argument("--draft", default=None, help="EAGLE3 head directory for --gguf's model")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "int8"], default="auto",
                    help="pdspec's KV cache (llama.cpp keeps its default f16 cache)")
    args = ap.parse_args()
    if args.batch_reps < 1:
        ap.error(f"--batch-reps: at least 1 pass over the batch sizes (got {args.batch_reps})")
    # Batch rows take as many distinct prompts as they run (a prompt twice in one batch would share
    # its cached prompt blocks, and attention would read them from cache); the turns the first --prompts.
    questions = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    if len(questions) < max(args.batches + [args.prompts]):
        ap.error(f"{PROMPTS} holds {len(questions)} prompts; --prompts and --batches need at most that many")
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("bench.peer needs llama-cpp-python: CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python==0.3.36")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    gguf = args.gguf or embedded_gguf_path()
    model = str(args.gguf) if args.gguf else None
    spec = SpeculativeConfig(**yaml.safe_load(CONFIG.read_text())["engine"]["speculative"] | {"model": args.draft})
    common = {"model": model, "num_threads": args.threads, "kv_cache_dtype": args.kv_cache_dtype}
    plain = Engine(EngineConfig(**common, max_num_seqs=max(args.batches + [1])))
    with_eagle = model is None or args.draft is not None
    eagle = Engine(EngineConfig(**common, speculative=spec)) if with_eagle else None
    chats = [plain.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    prompts = chats[: args.prompts]
    ubatch = llama_ubatch()
    peer = LlamaCpp(gguf, args.threads, ubatch)
    runs = {
        "llama.cpp": lambda t: peer.stamps(t, args.new_tokens),
        "pdspec": lambda t: _engine_stamps(plain, t, args.new_tokens),
        **({"pdspec_eagle3": lambda t: _engine_stamps(eagle, t, args.new_tokens)} if eagle else {}),
    }
    for run in runs.values():  # warm-up: kernels built, caches and thread pools up
        run(prompts[0][:32])
    answers = [_answer_length(plain, tokens, args.new_tokens) for tokens in prompts]
    ms: dict[str, list[float]] = {name: [] for name in runs}
    ms_answer: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i, tokens in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        for name in names[i % len(names):] + names[: i % len(names)]:
            stamps = runs[name](tokens)
            ms[name].append(_ms_per_token(stamps))
            if answers[i] >= MIN_ANSWER:
                ms_answer[name].append(_ms_per_token(stamps[: answers[i]]))
    peer.close()
    median = {name: statistics.median(v) for name, v in ms.items()}
    median_answer = {name: statistics.median(v) for name, v in ms_answer.items() if v}
    # Batch 1 again in the same passes: "x batch 1" compares runs taken in turn, not minutes apart.
    passes = {b: [] for b in dict.fromkeys([1, *args.batches])}
    for _ in tqdm(range(args.batch_reps), desc="batches", unit="pass"):
        for b in passes:
            passes[b].append(_batch_ms_per_token(plain, chats[:b], args.new_tokens))
    batched = {b: statistics.median(v) for b, v in passes.items()}
    result = {
        "machine": {"isa": cpu_kernels.selected_isa(), "threads": args.threads, "cpu": _cpu_name()},
        "gguf": gguf.name, "prompts": len(prompts), "new_tokens": args.new_tokens,
        # what the EAGLE3 engine runs: the config's fields plus the device's defaults for the rest
        "speculative": (eagle.config.speculative if eagle else spec).model_dump(exclude_none=True)
        | ({"draft_confidence_threshold": round(eagle.draft_confidence_threshold, 3)} if eagle else {}),  # as priced
        "kv_cache_dtype": plain.runner.cache_dtype,
        "ms_per_token": {name: round(v, 2) for name, v in median.items()},
        "per_prompt_ms": {name: [round(x, 2) for x in v] for name, v in ms.items()},
        "llama_cpp": {"flash_attn": True, "n_ctx": LLAMA_CTX, "n_ubatch": ubatch,  # None: llama.cpp's default
                      "version": importlib.metadata.version("llama_cpp_python")},
        "speedup_vs_llama_cpp": {name: round(median["llama.cpp"] / v, 2) for name, v in median.items()},
        "speedup_vs_llama_cpp_paired": {name: paired_speedup(ms["llama.cpp"], v) for name, v in ms.items()
                                        if name != "llama.cpp"},
        "answer_tokens": answers,
        "share_past_end_of_turn": round(1 - sum(answers) / (len(answers) * args.new_tokens), 3),
        "ms_per_token_answer": {name: round(v, 2) for name, v in median_answer.items()},
        "speedup_vs_llama_cpp_answer": {name: round(median_answer["llama.cpp"] / v, 2)
                                        for name, v in median_answer.items()},
        "batch_ms_per_token": {str(b): round(v, 3) for b, v in batched.items()},
        "batch_ms_per_token_range": {str(b): [round(min(v), 3), round(max(v), 3)] for b, v in passes.items()},
        "batch_speedup_vs_llama_cpp_batch1": {str(b): round(median["llama.cpp"] / v, 2) for b, v in batched.items()},
        "batch_speedup_vs_pdspec_batch1": {str(b): round(batched[1] / v, 2) for b, v in batched.items()},
    }
    print(json.dumps(result))
    print(f"\n{'run':<22}{'ms/token':>10}{'x llama.cpp':>13}{'x batch 1':>11}{'answer only':>13}{'x llama.cpp':>13}")
    for name, v in median.items():
        answer = median_answer.get(name)
        tail = f"{answer:>13.2f}{median_answer['llama.cpp'] / answer:>13.2f}" if answer else ""
        print(f"{name:<22}{v:>10.2f}{median['llama.cpp'] / v:>13.2f}{'':>11}{tail}")
    for b, v in batched.items():
        print(f"{'pdspec batch ' + str(b):<22}{v:>10.3f}{median['llama.cpp'] / v:>13.2f}{batched[1] / v:>11.2f}")
    print(f"answer only: up to the end of pdspec plain's greedy answer ({result['share_past_end_of_turn']:.0%} of "
          f"the tokens are past it), prompts with >= {MIN_ANSWER} answer tokens")
    print("batch rows: aggregate ms/token (the batch's tokens together) against llama.cpp's batch 1, and against "
          "pdspec's batch 1 in the same passes")
    for name, paired in result["speedup_vs_llama_cpp_paired"].items():
        low, high = paired["ci95"]
        print(f"{name} against llama.cpp, prompt by prompt: {paired['geomean']:.2f}x (95 % interval over this run's "
              f"prompts {low:.2f}-{high:.2f}x; runs on this host drift more than that)")


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
