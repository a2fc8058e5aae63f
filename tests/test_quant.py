"""GGUF block-quantized weights: dequantization against gguf's own; the exact quantized GEMM
against the fp32 GEMM on the dequantized weights (bit for bit), the int8-activation GEMM against
a float64 reference that quantizes the activations the same way, on every ISA level this CPU
runs; and the engine on the embedded model's quantized weights."""

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.layers import Linear
from engine.params import SamplingParams
from engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, QUANT_TYPES, QuantizedTensor, cat_rows, quantize_q8_0

ISAS = cpu_kernels.supported_isas()


def _quantized(qtype: str, rows: int, cols: int, seed: int = 0, int8_dot: bool = False) -> QuantizedTensor:
    """Random weights in `qtype` with `cols` columns, or the next multiple of 256 for the K-quants
    (random blocks: gguf cannot quantize to them; any bytes are valid but the fp16 scales, which
    are set to small finite values)."""
    rng = np.random.default_rng(seed)
    if BLOCK_WEIGHTS[qtype] == 32:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        return QuantizedTensor(qtype, torch.from_numpy(quantize(w, GGMLQuantizationType[qtype])), cols, int8_dot)
    cols = -(-cols // 256) * 256
    raw = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in (0, 2) if qtype == "Q4_K" else (208,):  # d, dmin / d
        scale = (rng.random((rows, cols // 256)) * 2e-3 + 1e-4).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    return QuantizedTensor(qtype, torch.from_numpy(raw.reshape(rows, -1)), cols, int8_dot)


def _int8_reference(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor) -> torch.Tensor:
    """llama.cpp's arithmetic: x per 32-block to round-half-even(x * (127 / max|x|)) in fp32 as the
    kernel rounds it (in float64 a product can fall on the other side of a tie), scaled back,
    times the dequantized weights in float64. The quotient is a tensor's: torch computes
    `127 / amax` as `amax.reciprocal() * 127`, an ulp off now and then, which moved a product
    across a tie (one input in a few hundred)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)).double()
    return (q * amax.double() / 127).view_as(x) @ w.dequantize().double().T + bias.double()


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_matches_gguf(qtype):
    w = _quantized(qtype, 7, 96)
    expected = dequantize(w.data.numpy(), GGMLQuantizationType[qtype])
    assert torch.equal(w.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 8, 9, 17])
@pytest.mark.parametrize("n", [75, 64])
def test_quant_gemm_is_bit_identical_to_fp32_gemm_on_dequantized_weights(isa, qtype, m, n):
    """Row counts cover one row (weights widened in registers), register tiles (through an L1
    block buffer) and batches taller than a tile (a whole-panel buffer); 75 rows pads a panel."""
    kernels = cpu_kernels.kernels(isa)
    w = _quantized(qtype, n, 96, seed=m)
    x, bias = torch.randn(m, w.cols), torch.randn(n)
    panels = kernels.pack_quantized(w)
    reference = kernels.pack_weight(w.dequantize())
    for b in (bias, None):
        assert torch.equal(kernels.quant_gemm(x, panels, qtype, n, b), kernels.packed_gemm(x, reference, n, b))
    assert torch.allclose(kernels.quant_gemm(x, panels, qtype, n, bias), x @ w.dequantize().T + bias, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("m", [1, 3, 6, 8, 9, 17])
def test_int8_gemm_matches_its_reference_and_each_row_is_batch_invariant(isa, qtype, m):
    """Integer dots are exact, so only the per-block float scaling rounds (~1e-6); and a row's
    result is the same bits alone or in any batch (verification stays lossless)."""
    kernels = cpu_kernels.kernels(isa)
    w = _quantized(qtype, 75, 128, seed=m, int8_dot=True)
    torch.manual_seed(m)  # not the suite's running state: a rare input sits ~1 activation unit off the reference
    x, bias = torch.randn(m, w.cols) * torch.rand(m, 1) * 10, torch.randn(75)
    x[0, 32:64] = 0  # an all-zero block: scale 0
    panels = kernels.pack_quantized(w)
    y = kernels.quant_gemm(x, panels, qtype, 75, bias, int8_dot=True)
    assert torch.allclose(y.double(), _int8_reference(x, w, bias), rtol=1e-5, atol=1e-4)
    for row in {0, m - 1}:
        alone = kernels.quant_gemm(x[row : row + 1], panels, qtype, 75, bias, int8_dot=True)
        assert torch.equal(alone[0], y[row])


@pytest.mark.parametrize("isa", ISAS)
def test_int8_gemm_keeps_nan_and_infinity_and_zeroes_subnormal_blocks(isa):
    """A NaN or infinite activation makes its row's outputs NaN, as the exact kernel's (they were
    large finite numbers); a block so small that 127 / max|x| overflows counts as zeros."""
    kernels = cpu_kernels.kernels(isa)
    w = _quantized("Q4_1", 8, 64, int8_dot=True)
    panels = kernels.pack_quantized(w)
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    x[0, 5], x[1, 40] = float("nan"), float("-inf")
    x[2, :32] = 1e-39
    y = kernels.quant_gemm(x, panels, "Q4_1", 8, None, int8_dot=True)
    exact = kernels.quant_gemm(x, kernels.pack_quantized(_quantized("Q4_1", 8, 64)), "Q4_1", 8)
    assert y[:2].isnan().all() and exact[:2].isfinite().logical_not().all()
    zeroed = x[2:3].clone()
    zeroed[0, :32] = 0
    assert torch.equal(y[2], kernels.quant_gemm(zeroed, panels, "Q4_1", 8, None, int8_dot=True)[0])
    assert torch.equal(y[3], kernels.quant_gemm(x[3:], panels, "Q4_1", 8, None, int8_dot=True)[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("int8_dot", [False, True])
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_rows_read_back_from_panels(isa, qtype, int8_dot):
    kernels = cpu_kernels.kernels(isa)
    w = _quantized(qtype, 70, 64, int8_dot=int8_dot)
    panels = kernels.pack_quantized(w)
    ids = torch.tensor([0, 69, 5, 16, 5])
    assert torch.equal(kernels.panel_rows(panels, qtype, w.cols, ids, int8_dot), w.dequantize()[ids])
    with pytest.raises(IndexError, match="outside"):
        kernels.panel_rows(panels, qtype, w.cols, torch.tensor([3, panels.shape[0] * kernels.pack_width]), int8_dot)


def test_slicing_and_stacking_keep_blocks():
    """Tensor-parallel shards (row slices, whole-block column slices) and fused projections
    (stacked rows of one type) stay quantized and exact; what cannot is refused or dequantized."""
    a, b = _quantized("Q4_1", 8, 128), _quantized("Q8_0", 4, 128)
    full = a.dequantize()
    assert torch.equal(a[2:5].dequantize(), full[2:5])
    assert torch.equal(a[:, 32:96].dequantize(), full[:, 32:96])
    with pytest.raises(ValueError, match="multiples of 32"):
        a[:, 16:64]
    k = _quantized("Q6_K", 3, 512)  # K-quants: super-blocks of 256
    assert torch.equal(k[:, 256:].dequantize(), k.dequantize()[:, 256:])
    with pytest.raises(ValueError, match="Q6_K columns can only be sliced at multiples of 256"):
        k[:, 32:256]
    stacked = cat_rows([a, a[:2]])
    assert isinstance(stacked, QuantizedTensor) and torch.equal(stacked.dequantize(), torch.cat([full, full[:2]]))
    mixed = cat_rows([a, b])
    assert not isinstance(mixed, QuantizedTensor) and torch.equal(mixed, torch.cat([full, b.dequantize()]))
    # Float parts keep their dtype (a bf16 model's fused q/k/v was widened to fp32).
    halves = [full.bfloat16(), full[:2].bfloat16()]
    assert cat_rows(halves).dtype == torch.bfloat16 and torch.equal(cat_rows(halves), torch.cat(halves))
    # With int8 activations, mixed types (Q4_K beside Q6_K) stay quantized: one Q8_0 of their values.
    q4k, q6k = _quantized("Q4_K", 4, 256, int8_dot=True), _quantized("Q6_K", 2, 256, int8_dot=True)
    fused = cat_rows([q4k, q6k])
    values = torch.cat([q4k.dequantize(), q6k.dequantize()])
    assert isinstance(fused, QuantizedTensor) and fused.qtype == "Q8_0" and fused.int8_dot
    assert torch.allclose(fused.dequantize(), values, atol=values.abs().max().item() / 127)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="not one of Q8_0, Q4_0, Q4_1, Q4_K, Q6_K"):
        QuantizedTensor("Q5_K", torch.zeros(2, 176, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="does not hold 288 columns"):
        QuantizedTensor("Q4_K", torch.zeros(2, 162, dtype=torch.uint8), 288)
    with pytest.raises(ValueError, match="does not hold 64 columns"):
        QuantizedTensor("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 64)
    kernels = cpu_kernels.kernels()
    panels = kernels.pack_quantized(_quantized("Q8_0", 4, 64))
    with pytest.raises(ValueError, match="x has 96 features"):
        kernels.quant_gemm(torch.randn(1, 96), panels, "Q8_0", 4)


def test_q4_0_beyond_the_kernels_fp16_min_runs_dequantized(tmp_path, caplog):
    """The kernels hold Q4_0 as Q4_1 with m = -8d in fp16: a scale past 65504 / 8 would make m
    infinite, so such a tensor is refused by the packing and loads as floats (and is named)."""
    from safetensors.torch import save_file

    from engine.loader import load_weights
    from engine.quant import BLOCKS_FILE, pack_panels

    ok, big = _quantized("Q4_0", 4, 64), _quantized("Q4_0", 4, 64, seed=1)
    blocks = big.data.clone().view(4, 2, 18)
    blocks[1, 0, 0:2] = torch.tensor([9000.0], dtype=torch.float16).view(torch.uint8)
    big = QuantizedTensor("Q4_0", blocks.view(4, 36), 64)
    with pytest.raises(ValueError, match="Q4_0 scales beyond 8188 overflow"):
        pack_panels(big, 8)
    (tmp_path / BLOCKS_FILE).parent.mkdir()
    save_file({"ok.weight": ok.data, "big.weight": big.data}, tmp_path / BLOCKS_FILE,
              metadata={"qtypes": '{"ok.weight": "Q4_0", "big.weight": "Q4_0"}'})
    save_file({"ok.weight": ok.dequantize(), "big.weight": big.dequantize()}, tmp_path / "model.safetensors")
    with caplog.at_level("INFO", logger="engine.loader"):
        weights = load_weights(tmp_path, torch.float32, torch.device("cpu"), blocks="exact")
    assert isinstance(weights["ok.weight"], QuantizedTensor)
    assert torch.equal(weights["big.weight"], big.dequantize()) and weights["big.weight"][1, 0].abs() > 8188
    assert "1 Q4_0 tensors dequantized" in caplog.text and "big.weight" in caplog.text


@pytest.mark.parametrize("first", [0, 5, 32, 70])
def test_quantized_linear_first_output_computes_a_tail(first):
    w = _quantized("Q4_0", 100, 64)
    linear, x = Linear(w), torch.randn(3, 64)
    assert torch.equal(linear(x, first_output=first), linear(x)[:, first:])
    assert torch.equal(linear.rows(torch.tensor([3, 99])), w.dequantize()[[3, 99]])


def test_exact_engine_is_token_identical_to_the_dequantized_one(exact_engine, chat_prompts):
    """quantization 'exact' runs the GGUF's Q4_1/Q8_0 blocks widened exactly; 'none' runs the
    same weights dequantized to fp32. The GEMMs are bit-identical, so greedy answers are too."""
    assert exact_engine.runner.model.layers[0].qkv.qtype == "Q4_1" and not exact_engine.runner.model.layers[0].qkv.int8_dot
    plain = Engine(EngineConfig(quantization="none", num_kv_blocks=128))
    assert plain.runner.model.layers[0].qkv.qtype is None
    assert plain.runner.layout.model != exact_engine.runner.layout.model  # their KV is not interchangeable
    params = SamplingParams(max_tokens=40)
    for prompt in chat_prompts:
        answers = [[t for out in e.generate(prompt, params) for t in out.token_ids] for e in (exact_engine, plain)]
        assert answers[0] == answers[1]
    plain.close()


# Measured on AVX2: the default engine's next-token choice agrees with the exact engine's on
# 148 of 152 positions of the exact engine's own greedy answers. (llama.cpp quantizes activations
# the same way: over 64 greedy tokens of the four prompts, its answers left the exact engine's in
# two and the default engine's in two.)
INT8_TOP1_AGREEMENT = 0.9


def top1_agreement(engine, reference, prompts, max_tokens: int) -> tuple[int, int]:
    """On `reference`'s own greedy answers, teacher-forced: at how many positions `engine`'s
    next-token choice is `reference`'s, of how many."""
    from tests.test_engine import _solo, _teacher_forced_top1

    agree = total = 0
    for prompt in prompts:
        answer = _solo(reference, prompt, SamplingParams(max_tokens=max_tokens))
        ours, ref = (_teacher_forced_top1(e, prompt, answer) for e in (engine, reference))
        agree += sum(a == b for a, b in zip(ours, ref))
        total += len(ref)
    return agree, total


def test_default_engine_quantizes_activations_and_agrees_with_the_exact_one(engine, exact_engine, chat_prompts):
    model = engine.runner.model
    assert model.layers[0].qkv.int8_dot and model.lm_head.qtype == "Q8_0" and model.lm_head.int8_dot
    assert engine.runner.layout.model.endswith("+auto") and exact_engine.runner.layout.model.endswith("+exact")
    agree, total = top1_agreement(engine, exact_engine, chat_prompts, 48)
    assert agree / total >= INT8_TOP1_AGREEMENT, f"int8 top-1 agrees with exact on {agree}/{total} positions"


def test_an_hf_model_runs_int8_and_agrees_with_its_float_weights(model_dir, exact_engine, chat_prompts, tmp_path):
    """quantization int8: an HF safetensors model's float matrices become Q8_0 blocks at load
    (int8 activations, the GGUF path's kernels); next-token choices stay those of the same
    weights in fp32 (here: the embedded model's dequantized weights without their GGUF blocks)."""
    for f in model_dir.iterdir():  # the directory as an HF model: no gguf/ blocks beside the fp32 weights
        if f.name != "gguf":
            (tmp_path / f.name).symlink_to(f)
    int8 = Engine(EngineConfig(model=str(tmp_path), quantization="int8", num_kv_blocks=128))
    model = int8.runner.model
    assert all(lin.qtype == "Q8_0" and lin.int8_dot for lin in (model.layers[0].qkv, model.layers[29].down, model.lm_head))
    agree, total = top1_agreement(int8, exact_engine, chat_prompts[:2], 32)
    assert agree / total >= INT8_TOP1_AGREEMENT, f"Q8_0 at load agrees with fp32 on {agree}/{total} positions"
    with pytest.raises(ValueError, match="quantization: int8 runs on device cpu with dtype float32"):
        EngineConfig(model=str(tmp_path), quantization="int8", dtype="bfloat16", num_kv_blocks=16)


def test_q8_0_quantization_at_load_is_ggufs():
    """Float weights quantized at load (the EAGLE3 draft of an int8 engine) get the very blocks
    gguf's quantizer writes, zero blocks and ties included."""
    torch.manual_seed(0)
    w = torch.randn(70, 128) * 3
    w[3, :32] = 0
    w[5, :32] = torch.arange(32) - 15.5  # ties at q = k + 0.5 after scaling
    assert np.array_equal(quantize_q8_0(w).data.numpy(), quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_q8_0(torch.zeros(4, 40))


def test_the_draft_of_an_int8_engine_runs_q8_0():
    draft = Engine(EngineConfig(num_kv_blocks=64, speculative={"method": "eagle3"})).runner.draft
    for linear in (draft.fc, draft.midlayer.qkv, draft.midlayer.down, draft.lm_head):
        assert linear.qtype == "Q8_0" and linear.int8_dot


def test_q5_0_is_kept_as_the_q8_0_blocks_of_the_same_values():
    """llama.cpp's Q4_K_M falls back to Q5_0 for rows not in 256-blocks; the converter keeps them
    as Q8_0 blocks (int8 q - 16, the same fp16 scale), whose dequantization is gguf's own of Q5_0."""
    from engine.quant import q5_0_as_q8_0

    w = np.random.default_rng(3).standard_normal((5, 128), dtype=np.float32)
    q5 = quantize(w, GGMLQuantizationType.Q5_0)
    q8 = QuantizedTensor("Q8_0", torch.from_numpy(q5_0_as_q8_0(q5)), 128)
    assert torch.equal(q8.dequantize(), torch.from_numpy(dequantize(q5, GGMLQuantizationType.Q5_0)))
