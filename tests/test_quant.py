"""GGUF block-quantized weights: dequantization against gguf's own, the quantized GEMM against
the fp32 GEMM on the dequantized weights (bit for bit, on every ISA level this CPU runs), and
the engine on the embedded model's quantized weights against the dequantized ones."""

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
from engine.quant import QUANT_TYPES, QuantizedTensor, cat_rows, panel_rows

ISAS = cpu_kernels.supported_isas()


def _quantized(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    return QuantizedTensor(qtype, torch.from_numpy(quantize(w, GGMLQuantizationType[qtype])), cols)


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
    x, bias = torch.randn(m, 96), torch.randn(n)
    panels = kernels.pack_quantized(w)
    reference = kernels.pack_weight(w.dequantize())
    for b in (bias, None):
        assert torch.equal(kernels.quant_gemm(x, panels, qtype, n, b), kernels.packed_gemm(x, reference, n, b))
    assert torch.allclose(kernels.quant_gemm(x, panels, qtype, n, bias), x @ w.dequantize().T + bias, atol=1e-4)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_rows_read_back_from_panels(qtype):
    kernels = cpu_kernels.kernels()
    w = _quantized(qtype, 70, 64)
    ids = torch.tensor([0, 69, 5, 16, 5])
    rows = panel_rows(kernels.pack_quantized(w), qtype, 64, kernels.pack_width, ids)
    assert torch.equal(rows, w.dequantize()[ids])


def test_slicing_and_stacking_keep_blocks():
    """Tensor-parallel shards (row slices, whole-block column slices) and fused projections
    (stacked rows of one type) stay quantized and exact; what cannot is refused or dequantized."""
    a, b = _quantized("Q4_1", 8, 128), _quantized("Q8_0", 4, 128)
    full = a.dequantize()
    assert torch.equal(a[2:5].dequantize(), full[2:5])
    assert torch.equal(a[:, 32:96].dequantize(), full[:, 32:96])
    with pytest.raises(ValueError, match="multiples of 32"):
        a[:, 16:64]
    stacked = cat_rows([a, a[:2]])
    assert isinstance(stacked, QuantizedTensor) and torch.equal(stacked.dequantize(), torch.cat([full, full[:2]]))
    mixed = cat_rows([a, b])
    assert not isinstance(mixed, QuantizedTensor) and torch.equal(mixed, torch.cat([full, b.dequantize()]))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="not one of Q8_0, Q4_0, Q4_1"):
        QuantizedTensor("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="does not hold 64 columns"):
        QuantizedTensor("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 64)
    kernels = cpu_kernels.kernels()
    panels = kernels.pack_quantized(_quantized("Q8_0", 4, 64))
    with pytest.raises(ValueError, match="x has 96 features"):
        kernels.quant_gemm(torch.randn(1, 96), panels, "Q8_0", 4)


@pytest.mark.parametrize("first", [0, 5, 32, 70])
def test_quantized_linear_first_output_computes_a_tail(first):
    w = _quantized("Q4_0", 100, 64)
    linear, x = Linear(w), torch.randn(3, 64)
    assert torch.equal(linear(x, first_output=first), linear(x)[:, first:])
    assert torch.equal(linear.rows(torch.tensor([3, 99])), w.dequantize()[[3, 99]])


def test_quantized_engine_is_token_identical_to_the_dequantized_one(engine, chat_prompts):
    """The default engine runs the GGUF's Q4_1/Q8_0 blocks; quantization 'none' runs the same
    weights dequantized to fp32. The GEMMs are bit-identical, so greedy answers are identical."""
    assert engine.runner.model.layers[0].qkv.qtype == "Q4_1" and engine.runner.model.lm_head.qtype == "Q8_0"
    plain = Engine(EngineConfig(quantization="none", num_kv_blocks=128))
    assert plain.runner.model.layers[0].qkv.qtype is None
    assert plain.runner.layout.model != engine.runner.layout.model  # their KV is not interchangeable
    params = SamplingParams(max_tokens=40)
    for prompt in chat_prompts:
        answers = [[t for out in e.generate(prompt, params) for t in out.token_ids] for e in (engine, plain)]
        assert answers[0] == answers[1]
    plain.close()
