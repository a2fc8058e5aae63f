"""Engine benchmark: decode throughput and multi-token forward cost, ours vs transformers.

Runs on the embedded default model (or --model), fp32 activations, same process; our weights as
--quantization says (default auto: the GGUF's blocks with int8 activations), transformers' the
dequantized fp32 ones:
- decode tokens/s at batch 1, 4, 16: 128 new tokens after a 256-token prompt (EOS ignored), and
  where a decode step spends its time (layer GEMMs, attention);
- the cost of one forward over n new tokens (default 1, 2, 4, 6, 8; logits at every row) after a
  256-token context, relative to the first n (1 by default: what a speculative verification step
  costs against a decode step);
- where our forward over n tokens spends its time: GEMMs (layers, lm_head), attention, the rest
  of the native layer loop, and outside it (embedding, final norm, Python);
- with --prefill N ..., the time of one forward over an N-token prompt (no cache; ours only).
Prints one JSON object (with the ISA level our kernels ran and torch's CPU capability), then a
table.

    python -m bench.engine [--threads 2] [--batches 1 4 16] [--spans 1 2 4 6 8] [--quantization auto] [--skip-hf]

To run an AVX-512 machine as an AVX2 one, hold both to AVX2:
    PDSPEC_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m bench.engine

(Run as a module: a script named engine.py would shadow the engine package.)
"""

import argparse
import json
import random
import time
from contextlib import contextmanager

import torch
from tqdm import tqdm

from bench.timing import alternated_median_ms
from engine import cpu_kernels
from engine.batch import SeqChunk
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams

PROMPT_LEN, NEW_TOKENS = 256, 128


def prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


class _Timed:
    """A callable whose calls' seconds add up while it runs where it is used: the lm_head inside
    real forwards reads its weights from DRAM (the layers' stream evicted them); timed in a loop
    alone it would find them in cache. Attributes pass through (the tied head embeds too)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextmanager
def _timed_layers(model):
    """While in it: the native layer loop's timings (seconds in GEMMs, attention, the whole loop)
    and the lm_head's time add up; yields the timed head."""
    model.native.timings, model.lm_head = torch.zeros(3, dtype=torch.float64), _Timed(model.lm_head)
    try:
        yield model.lm_head
    finally:
        model.native.timings, model.lm_head = None, model.lm_head.inner


def _layer_ms(model, head: _Timed, count: int) -> tuple[dict[str, float], float]:
    """Mean ms per call, over `count` calls, of the native layer loop's parts and the lm_head, and
    of the whole layer loop."""
    gemm, attention, layers = (model.native.timings * 1e3 / count).tolist()
    return {"layer_gemm": gemm, "attention": attention, "layers_other": layers - gemm - attention,
            "lm_head": head.seconds * 1e3 / count}, layers


def start_batch(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[str]:
    """Add the prompts as requests and step until every one has its first token (counted by
    request: a prompt found in the prefix cache may start decoding while others still prefill);
    returns their ids."""
    ids = [engine.add_request(p, params) for p in batch]
    waiting = set(ids)
    while waiting and engine.has_unfinished():
        waiting -= {out.request_id for out in engine.step() if out.token_ids}
    return ids


def warm_up(engine: Engine) -> None:
    """A short answer first: the first forwards fault the weights' and the cache's pages in and
    start the OpenMP threads, which the first timed batch would otherwise pay for."""
    start_batch(engine, prompts(1, 40000), SamplingParams(max_tokens=16, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def ours_decode(engine: Engine, batch: int) -> tuple[float, dict[str, float]]:
    """Decode tokens/s (time from every request's first token to the last token), and a decode
    step's mean ms: whole, and with the native decoder step, in the layers' GEMMs, their
    attention, the rest of the layer loop, the lm_head, and everything else (embedding, sampling,
    scheduling, Python)."""
    start_batch(engine, prompts(batch, 40000), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    model = engine.runner.model

    def decode() -> tuple[int, int, float]:
        start, decoded, steps = time.perf_counter(), 0, 0
        while engine.has_unfinished():
            decoded += sum(len(o.token_ids) for o in engine.step())
            steps += 1
        return decoded, steps, time.perf_counter() - start

    if model.native is None:
        decoded, steps, seconds = decode()
        return decoded / seconds, {"step": seconds * 1e3 / steps}
    with _timed_layers(model) as head:
        decoded, steps, seconds = decode()
        parts, layers = _layer_ms(model, head, steps)
    ms = seconds * 1e3 / steps
    return decoded / seconds, {"step": ms} | parts | {"rest": ms - layers - parts["lm_head"]}


@contextmanager
def after_context(engine: Engine, spans: list[int]):
    """{n: a chunk of n new tokens} after a 256-token cached context (rolled back after)."""
    prompt = prompts(1, 40000)[0]
    blocks = engine.blocks
    cached = blocks.allocate("span", prompt)
    engine.runner.forward([SeqChunk(prompt[cached:], cached, blocks.block_table("span"), 1)])
    blocks.commit("span", prompt[cached:])
    blocks.reserve("span", max(spans))
    table = blocks.block_table("span")
    yield {n: SeqChunk(list(range(1000, 1000 + n)), PROMPT_LEN, table, n) for n in spans}
    blocks.rollback("span")
    blocks.free("span")


def ours_span_costs(engine: Engine, spans: list[int], reps: int) -> dict[int, float]:
    """Median ms of a forward over n new tokens after a 256-token cached context."""
    with after_context(engine, spans) as chunks:
        return alternated_median_ms({n: (lambda c=c: engine.runner.forward([c])) for n, c in chunks.items()}, reps)


def ours_breakdown(engine: Engine, spans: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Where a forward over n new tokens (as in ours_span_costs) spends its time, mean ms: the
    layers' GEMMs and the lm_head's, attention, the rest of the native layer loop (norms, RoPE,
    KV writes, SiLU, residuals), and everything outside it (embedding, final norm, batch
    building, Python). Needs the native decoder step."""
    model = engine.runner.model
    if model.native is None:
        return {}
    out = {}
    with after_context(engine, spans) as chunks:
        for n, chunk in chunks.items():
            engine.runner.forward([chunk])  # warm
            with _timed_layers(model) as head:
                start = time.perf_counter()
                for _ in range(reps):
                    engine.runner.forward([chunk])
                total = (time.perf_counter() - start) * 1e3 / reps
                parts, layers = _layer_ms(model, head, reps)
            gemm = parts["layer_gemm"] + parts["lm_head"]
            out[n] = {"total": total, "gemm": gemm} | parts | {
                "outside_layers": total - layers - parts["lm_head"], "outside_gemm": total - gemm}
    return out


def ours_prefill_ms(engine: Engine, n: int) -> float:
    """One forward over a fresh n-token prompt (nothing cached), best of 2."""
    rng = random.Random(n)
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    times = []
    for _ in range(2):
        engine.blocks.clear_prefix_cache()
        engine.blocks.allocate("prefill", prompt)
        start = time.perf_counter()
        engine.runner.forward([SeqChunk(prompt, 0, engine.blocks.block_table("prefill"), 1)])
        times.append((time.perf_counter() - start) * 1e3)
        engine.blocks.free("prefill")
    return min(times)


def hf_decode(model, batch: int) -> float:
    ids = torch.tensor(prompts(batch, 40000))
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        # A short answer first, as ours gets (warm_up): a first call's one-time costs would land in
        # the prefill figure and be subtracted from the decode time.
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kwargs)
        total = time.perf_counter() - start
    return batch * (NEW_TOKENS - 1) / (total - prefill)


def hf_span_costs(model, spans: list[int], reps: int) -> dict[int, float]:
    from transformers import DynamicCache

    ids = torch.tensor(prompts(1, 40000))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)

    def step(n: int) -> None:
        with torch.no_grad():
            model(torch.arange(1000, 1000 + n)[None], past_key_values=cache, use_cache=True)
        cache.crop(-n)  # drop the n new tokens again

    return alternated_median_ms({n: (lambda n=n: step(n)) for n in spans}, reps)


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--spans", type=int, nargs="+", default=[1, 2, 4, 6, 8],
                    help="forward sizes (new tokens) to time; the first is the reference")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths to time one prefill forward of")
    ap.add_argument("--quantization", choices=["auto", "exact", "none"], default="auto",
                    help="engine.quantization: how the GGUF's quantized weights run")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "int8"], default="auto",
                    help="engine.kv_cache_dtype: our KV cache's element type")
    ap.add_argument("--skip-hf", action="store_true", help="ours only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, num_kv_blocks=1024, max_num_seqs=max(args.batches),
                                 max_num_batched_tokens=max(args.prefill + [2048]), quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype))
    result = {"threads": args.threads, "isa": cpu_kernels.selected_isa(), "quantization": args.quantization,
              "kv_cache_dtype": engine.runner.cache_dtype,
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "ours": {}, "transformers": {}}
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(engine.runner.model_dir, dtype=torch.float32).eval()
    warm_up(engine)
    for b in tqdm(args.batches, desc="decode"):
        tok_s, step = ours_decode(engine, b)
        result["ours"][f"decode_tok_s_b{b}"] = round(tok_s, 2)
        result["ours"].setdefault("decode_step_ms", {})[b] = {k: round(v, 2) for k, v in step.items()}
        if hf is not None:
            result["transformers"][f"decode_tok_s_b{b}"] = round(hf_decode(hf, b), 2)
    spans = {"ours": ours_span_costs(engine, args.spans, args.reps)}
    if hf is not None:
        spans["transformers"] = hf_span_costs(hf, args.spans, args.reps)
    for who, costs in spans.items():
        result[who]["span_ms"] = {n: round(ms, 2) for n, ms in costs.items()}
        result[who]["span_rel"] = {n: round(ms / costs[args.spans[0]], 3) for n, ms in costs.items()}
    result["ours"]["breakdown_ms"] = {n: {k: round(v, 2) for k, v in parts.items()}
                                      for n, parts in ours_breakdown(engine, args.spans, args.reps).items()}
    result["ours"]["prefill_ms"] = {n: round(ours_prefill_ms(engine, n), 1) for n in args.prefill}
    print(json.dumps(result))
    _table(result, args.batches, args.spans)


def _table(result: dict, batches: list[int], spans: list[int]) -> None:
    who = [w for w in ("ours", "transformers") if result[w]]
    print(f"\nkernels: {result['isa']}, torch: {result['torch_cpu_capability']}, quantization: {result['quantization']}")
    print(f"{'metric':<28}" + "".join(f"{w:>14}" for w in who))
    for b in batches:
        key = f"decode_tok_s_b{b}"
        print(f"{'decode tok/s batch ' + str(b):<28}" + "".join(f"{result[w].get(key, float('nan')):>14.2f}" for w in who))
    for b, step in result["ours"]["decode_step_ms"].items():
        print(f"{f'decode step batch {b} (ms)':<28}" + ", ".join(f"{k} {v:.2f}" for k, v in step.items()))
    for n in spans:
        print(f"{f'forward {n} tok ms (x1)':<28}" + "".join(
            f"{result[w]['span_ms'][n]:>8.2f} ({result[w]['span_rel'][n]:.2f})" for w in who))
    for n, parts in result["ours"]["breakdown_ms"].items():
        print(f"{f'forward {n} tok, where (ms)':<28}" + ", ".join(
            f"{k} {parts[k]:.2f}" for k in ("layer_gemm", "lm_head", "attention", "layers_other", "outside_layers")))
        print(f"{f'forward {n} tok outside GEMMs':<28}{parts['outside_gemm']:>11.2f} ms")
    for n, ms in result["ours"]["prefill_ms"].items():
        print(f"{f'prefill {n} tok ms':<28}{ms:>14.1f}")


if __name__ == "__main__":
    main()
