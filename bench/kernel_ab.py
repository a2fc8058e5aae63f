"""Two builds of the CPU kernels against each other in one process, their calls alternated so the
machine's drift (other tenants, clock, memory) hits both alike: on a shared 2-vCPU host two runs a
minute apart can differ by 10 %, more than most kernel changes are worth.

Build A is `engine/csrc` at a git revision (`--base`), build B the working tree's; both for the ISA
level this process selects (`PDSPEC_CPU_ISA`). Timed, per build, as the median of alternated reps:
- the embedded model's layer GEMMs (its 120 quantized matrices, weights from DRAM as in a step) at
  each `--rows`, and with the lm_head after them (`+head`); `--layers N`: the first N layers' only
  (a few layers' weights stay in L3 from rep to rep: the tiles' own time, without DRAM's);
- paged attention over 30 layers, cold (every layer's cache its own), 9 heads over 3 KV heads of 64,
  `--context` cached positions, for each batch x span in `--attention` (span: query tokens per
  sequence, as a verification span), per `--kv-dtypes` cache type; `--hot`: one cache for all layers,
  staying in L2 (the kernel's own work, without DRAM's);
- whole forwards through the engine (the native layer loop, lm_head and embedding on either build's
  kernels, the Python around them the same; the base must declare the layer loop's structures as
  this checkout does): a decode step of each batch size in `--steps` (256-token prompts, the builds
  taking turns step by step on the same running batch), and a forward over each `--spans` count of
  new tokens after a 256-token context (bench.engine's verification-span cost);
and checked: both builds' outputs on the same inputs (max abs difference). Prints one JSON object,
then a table.

    python -m bench.kernel_ab --base REV [--rows 1 6 16] [--layers N] [--attention 1x1 1x6 4x1 16x1] [--hot]
                              [--context 262] [--kv-dtypes float32 bfloat16] [--steps 4 16] [--spans 1 6]
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from bench.attention import attention_step
from bench.engine import after_context, prompts, start_batch
from bench.timing import alternated_median_ms
from engine import cpu_kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams


# Kernel files split off from another: a revision before the split has their code in that one.
SPLIT_OFF = {"attention_tile.c", "attention_tile.h", "quant_dot_portable.h"}


def revision_kernels(rev: str, isa: str) -> cpu_kernels.CpuKernels:
    """The kernels of `engine/csrc` as committed at `rev`, built for `isa` (cached like any build)."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        for name in cpu_kernels.KERNEL_FILES:
            shown = subprocess.run(["git", "-C", str(root), "show", f"{rev}:engine/csrc/{name}"], capture_output=True)
            if shown.returncode and name not in SPLIT_OFF:
                raise SystemExit(f"--base {rev}: no engine/csrc/{name} there ({shown.stderr.decode().strip()}); "
                                 "compare revisions with the same kernel files")
            (Path(tmp) / name).write_bytes(shown.stdout)  # a file split off later: empty, its code in another
        try:
            return cpu_kernels.CpuKernels(isa, cpu_kernels.build_kernels(isa, Path(tmp)))
        except AttributeError as missing:  # an entry point this checkout binds came later
            raise SystemExit(f"--base {rev}: its kernels lack an entry point this checkout binds ({missing}); "
                             "compare revisions with the same entry points (or run kernel_ab from a checkout "
                             "of the older one)") from None


def gemm_cases(engine: Engine, rows: list[int], num_layers: int | None = None) -> dict[str, tuple]:
    """case name -> (the matrices in call order, rows): the (first num_layers) layers' then, with
    +head, the lm_head."""
    model = engine.runner.model
    layers = [lin for layer in model.layers[:num_layers] for lin in layer.linears]
    return {f"gemm {m} rows{head}": (layers + ([model.lm_head] if head else []), m)
            for m in rows for head in ("", " +head")}


def gemm_call(kernels: cpu_kernels.CpuKernels, linears: list, inputs: dict, outputs: list):
    def run() -> None:
        outputs.clear()
        for lin in linears:
            outputs.append(kernels.quant_gemm(inputs[lin.in_features], lin.weight, lin.qtype, lin.out_features,
                                              lin.bias, lin.int8_dot))
    return run


def with_kernels(engine: Engine, kernels: cpu_kernels.CpuKernels, run):
    """run, the model's native layer loop, lm_head and embedding on `kernels` (both builds pack
    weights alike); the rest of a step (Python, sampling's argmax) is the same code for both."""
    model = engine.runner.model

    def call() -> None:
        model.native.kernels = model.lm_head.kernels = kernels
        run()
    return call


def same_layer_loop_structures(base: str) -> bool:
    """Whether `base`'s decoder_step.c declares the structures this checkout's native decoder fills
    (engine/native_decoder.py): --steps and --spans hand them to the base's layer loop."""
    root = Path(__file__).resolve().parent.parent
    def structures(text: str) -> str:
        return text[text.index("typedef struct"):text.index("enum { TIME_GEMM")]
    shown = subprocess.run(["git", "-C", str(root), "show", f"{base}:engine/csrc/decoder_step.c"], capture_output=True,
                           text=True)
    tree = (root / "engine" / "csrc" / "decoder_step.c").read_text()
    return shown.returncode == 0 and structures(shown.stdout) == structures(tree)


def running_batch(engine: Engine, batch: int, steps: int) -> list[str]:
    """`batch` requests of 256-token prompts, prefilled, each with room for `steps` more tokens."""
    return start_batch(engine, prompts(batch, 40000), SamplingParams(max_tokens=steps + 8, ignore_eos=True))


def engine_rows(engine: Engine, builds: dict, batches: list[int], spans: list[int], reps: int) -> dict[str, dict]:
    """Whole decode steps and span forwards, the builds taking turns (a step case's builds decode
    one running batch together, step by step)."""
    timed = {}
    for batch in tqdm(batches, desc="kernel_ab steps", unit="batch"):
        ids = running_batch(engine, batch, 2 * (reps + 2))
        timed[f"step batch {batch}"] = alternated_median_ms(
            {b: with_kernels(engine, k, engine.step) for b, k in builds.items()}, reps, warmup=2)
        for i in ids:
            engine.abort(i)
    if spans:
        with after_context(engine, spans) as chunks:
            for n in spans:
                timed[f"forward {n} tokens"] = alternated_median_ms(
                    {b: with_kernels(engine, k, lambda c=chunks[n]: engine.runner.forward([c])) for b, k in builds.items()},
                    reps, warmup=2)
    return {name: result_row(ms, None) for name, ms in timed.items()}


def result_row(ms: dict[str, float], max_abs_diff: float | None) -> dict:
    return {"a_ms": round(ms["A"], 3), "b_ms": round(ms["B"], 3), "b_over_a": round(ms["B"] / ms["A"], 3),
            "max_abs_diff": max_abs_diff}


def batch_by_span(text: str) -> tuple[int, int]:
    """'4x1' -> (4, 1): sequences, query tokens each."""
    try:
        batch, span = map(int, text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxSPAN, e.g. 4x1 or 1x6") from None
    if batch < 1 or span < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and span must be at least 1")
    return batch, span


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of build A")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 6, 16])
    ap.add_argument("--layers", type=int, default=None, help="the first N layers' GEMMs only (default: all)")
    ap.add_argument("--attention", nargs="*", type=batch_by_span, default=[(1, 1), (1, 6), (4, 1), (16, 1)],
                    help="BATCHxSPAN cases: sequences, query tokens each")
    ap.add_argument("--context", type=int, default=262)
    ap.add_argument("--kv-dtypes", nargs="+", choices=["float32", "bfloat16", "int8"], default=["float32", "bfloat16"],
                    help="attention's cache types (int8: a base from e7ae72d on)")
    ap.add_argument("--hot", action="store_true", help="attention over one cache for all layers, kept in cache")
    ap.add_argument("--steps", type=int, nargs="*", default=[], help="decode steps at these batch sizes")
    ap.add_argument("--spans", type=int, nargs="*", default=[], help="forwards over this many new tokens")
    ap.add_argument("--reps", type=int, default=22, help="timed rounds (after two to warm up)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.layers is not None and args.layers < 1:
        ap.error("--layers: at least 1 (the first N layers' GEMMs), or leave it out for all")
    torch.set_num_threads(args.threads)
    isa = cpu_kernels.selected_isa()
    builds = {"A": revision_kernels(args.base, isa), "B": cpu_kernels.kernels(isa)}
    if len({k.pack_width for k in builds.values()}) != 1:
        raise SystemExit("the two builds pack weights differently; their GEMMs cannot share one model's panels")
    engine = Engine(EngineConfig())
    if (args.steps or args.spans) and engine.runner.model.native is None:
        ap.error("--steps/--spans time the native layer loop, which this engine does not run")
    if (args.steps or args.spans) and not same_layer_loop_structures(args.base):
        ap.error(f"--steps/--spans: {args.base}'s decoder_step.c declares other structures than this checkout "
                 "fills; compare whole steps against a revision with the same layer-loop structures")
    if any(b > engine.config.max_num_seqs for b in args.steps):
        ap.error(f"--steps: at most max_num_seqs ({engine.config.max_num_seqs}) sequences run in a step")
    if args.layers is not None and args.layers > len(engine.runner.model.layers):
        ap.error(f"--layers: the model has {len(engine.runner.model.layers)} layers, not {args.layers}")
    cases = {}
    for name, (linears, m) in gemm_cases(engine, args.rows, args.layers).items():
        inputs = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}
        outputs = {b: [] for b in builds}
        cases[name] = ({b: gemm_call(k, linears, inputs, outputs[b]) for b, k in builds.items()},
                       lambda o=outputs: max((x - y).abs().max().item() for x, y in zip(o["A"], o["B"])))
    for batch, span in args.attention:
        for dtype in (getattr(torch, name) for name in args.kv_dtypes):
            steps = {b: attention_step(k, batch, args.context, span, dtype, args.hot) for b, k in builds.items()}
            cases[f"attention b{batch} span{span} {str(dtype).removeprefix('torch.')}"] = (
                {b: step for b, (step, _) in steps.items()},
                lambda s=steps: (s["A"][1] - s["B"][1]).abs().max().item())
    rows = {}
    for name, (calls, difference) in tqdm(cases.items(), desc="kernel_ab", unit="case"):
        rows[name] = result_row(alternated_median_ms(calls, args.reps, warmup=2), difference())
    rows |= engine_rows(engine, builds, args.steps, args.spans, args.reps)
    print(json.dumps({"isa": isa, "threads": args.threads, "base": args.base, "context": args.context, "hot": args.hot,
                      "layers": args.layers or len(engine.runner.model.layers), "rows": rows}))
    print(f"{'':34}{'A ms':>9}{'B ms':>9}{'B/A':>7}{'max |A-B|':>11}")
    for name, r in rows.items():
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.2e}"
        print(f"{name:34}{r['a_ms']:>9}{r['b_ms']:>9}{r['b_over_a']:>7}{diff:>11}")


if __name__ == "__main__":
    main()
