"""course_lib.quantize, against independent oracles.

Oracles: float64 F.linear with the dequantized weight, a float64 rounding of the activations with exact integer
products (int8's kernel), Hugging Face's count of GPT-2 small's parameters, the model's own tensors, and PyTorch's
F.linear.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import quantize
from course_lib.gpt import GPT, GPTConfig
from course_lib.kv_cache import generate_cached
from course_lib.quantize import (INT4_KERNELS, INT8_PRODUCTS, WEIGHT_FORMATS, Int4Linear, Int8KernelLinear, Int8Linear, bytes_per_token,
                                 decode_weight_bytes, dequantize_int4, dequantize_int8, int8_linear, quantize_int4,
                                 quantize_int8, quantize_model, quantize_weights)

SMALL = GPTConfig(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=32)


def small_gpt(seed: int = 0, config: GPTConfig = SMALL) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).eval()


def test_bytes_per_token_of_gpt2_small_matches_hugging_faces_parameter_count():
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert bytes_per_token(gpt2, 1, 0) == (124_439_808 - 1024 * 768) * 4  # 494.6 MB
    assert bytes_per_token(gpt2, 64, 1024, torch.bfloat16) == ((124_439_808 - 1024 * 768) / 64 + 2 * 12 * 1024 * 768) * 2


@pytest.mark.parametrize("kwargs,message", [
    ({"batch_size": 0, "context": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"batch_size": 1.5, "context": 0}, "batch_size must be an integer >= 1, got 1.5"),
    ({"batch_size": 1, "context": 33}, r"context must be an integer in \[0, block_size = 32\], got 33"),
    ({"batch_size": 1, "context": -1}, r"context must be an integer in \[0, block_size = 32\], got -1"),
])
def test_bytes_per_token_names_the_bad_argument_and_its_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bytes_per_token(SMALL, **kwargs)


def test_quantize_int8_is_symmetric_per_channel_absmax_and_rejects_non_matrices():
    w = torch.randn(5, 16) * torch.tensor([1e-3, 1.0, 0.0, 30.0, 2.0])[:, None]
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.allclose(scale.double(), w.double().abs().amax(1) / 127, rtol=1e-6, atol=0)
    assert int(q.min()) >= -127 and scale[2] == 0 and (q[2] == 0).all()
    assert ((dequantize_int8(q, scale) - w).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match=r"weight must be 2-D \(out, in\), got shape \(3,\)"):
        quantize_int8(torch.ones(3))


@pytest.mark.parametrize("in_features", [16, 64, 768, 5, 24])
def test_int8_linear_layers_match_float64_dequantized_linear(in_features):
    torch.manual_seed(in_features)
    layer = nn.Linear(in_features, 48)
    x = torch.randn(3, 4, in_features)
    q, scale = quantize_int8(layer.weight)
    expected = F.linear(x.double(), q.double() * scale.double()[:, None], layer.bias.detach().double())
    plain = Int8Linear.from_linear(layer)
    assert plain(x).shape == (3, 4, 48) and plain(x).dtype == torch.float32
    assert torch.allclose(plain(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(int8_linear(x, q, scale, layer.bias).double(), expected, rtol=1e-5, atol=1e-5)


def w8a8_float64(x, q, scale, bias=None):
    """The oracle of Int8KernelLinear: each row of x (..., in) rounded in float64 to the levels round(x / s), s = max
    |row| / 127 (a zero row: levels 0), the integer products summed in int64 (exact), times s and the channel's
    scale, plus the bias; float64 (..., out)."""
    rows = x.double().reshape(-1, x.shape[-1])
    s = rows.abs().amax(dim=1, keepdim=True) / 127
    levels = torch.round(rows / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127).long()
    y = (levels @ q.long().t()).double() * s * scale.double()
    y = y if bias is None else y + bias.double()
    return y.reshape(*x.shape[:-1], q.shape[0])


def rows_between_levels(shape, seed: int):
    """Float32 rows (..., in) whose entries lie 0.1 or more from the middle between two int8 levels of their row, one
    entry of each row at +-127 levels: their rounding is the same in float32 and float64 (the scales are powers of two,
    different for every row, from 2^-20 to 2^10)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-126, 127, shape, generator=g).double() + (torch.rand(shape, generator=g).double() - 0.5) * 0.8
    levels[..., 0] = 127 * torch.where(torch.rand(shape[:-1], generator=g) < 0.5, -1.0, 1.0)
    powers = torch.randint(-20, 11, (*shape[:-1], 1), generator=g).double()
    return (levels * 2.0**powers).float()


@pytest.mark.parametrize("product", INT8_PRODUCTS)
@pytest.mark.parametrize("in_features,out_features", [(768, 2304), (64, 48), (5, 7), (24, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_kernel_layer_rounds_activations_as_the_float64_w8a8_oracle(monkeypatch, in_features, out_features, bias,
                                                                          product):
    """Int8KernelLinear (W8A8) against the float64 oracle: rows whose rounding no float format decides (a Gaussian row
    can sit closer to a rounding midpoint than float32's quotient can tell), 1, 3 and 8 rows, inputs (M, in) and
    (2, 3, in). The bfloat16 kernel it replaced (weight-only int8, bfloat16 activations) fails the tolerance here. Both
    sums (int8_product's choice) alike."""
    if product == INT8_PRODUCTS[0] and quantize.int8_product() != product:
        pytest.skip("torch._int_mm does not sum exactly on this CPU")
    monkeypatch.setattr(quantize, "int8_product", lambda: product)
    torch.manual_seed(in_features)
    layer = nn.Linear(in_features, out_features, bias=bias)
    kernel = Int8KernelLinear.from_linear(layer)
    q, scale = quantize_int8(layer.weight)
    assert type(kernel) is Int8KernelLinear and torch.equal(kernel.q, q) and torch.equal(kernel.scale, scale)
    inputs = [rows_between_levels((rows, in_features), rows) for rows in (1, 3, 8)]
    inputs += [rows_between_levels((2, 3, in_features), 9)]
    for x in inputs:
        expected = w8a8_float64(x, q, scale, layer.bias.detach() if bias else None)
        y = kernel(x)
        assert y.shape == expected.shape and y.dtype == torch.float32
        # exact integer sums; then float32 products of the two scales and the sum, and the bias added
        tolerance = 1e-6 * expected.abs().amax(dim=-1, keepdim=True) + (1e-6 * layer.bias.detach().abs() if bias else 0)
        assert ((y.double() - expected).abs() <= tolerance).all()


def test_int8_kernel_layer_gives_the_same_outputs_whichever_product_sums():
    """The float64 product (int8_product's fallback) and torch._int_mm give bitwise the same outputs, sums above 2^24
    included (where float32 cannot hold every integer): the tokens of a model do not depend on the CPU's int8 kernel.
    Rows of +-127 that agree in sign with a weight row make its sum 127 * 127 * 3072 = 49.5 M."""
    if quantize.int8_product() != INT8_PRODUCTS[0]:
        pytest.skip("torch._int_mm does not sum exactly on this CPU")
    torch.manual_seed(11)
    layer = nn.Linear(3072, 64)
    kernel = Int8KernelLinear.from_linear(layer)
    signs = torch.where(kernel.q[:4] >= 0, 1.0, -1.0)  # (4, 3072): each row agrees with one weight row's signs
    x = torch.cat([signs * 2.5, torch.randn(4, 3072)])
    assert (quantize.int8_sums((x[:4] / x[:4].abs().amax(1, keepdim=True) * 127).round().to(torch.int8), kernel.q).diagonal().abs()
            > 2**24).all()
    outputs = {}
    for product in INT8_PRODUCTS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quantize, "int8_product", lambda product=product: product)
            outputs[product] = kernel(x)
    assert torch.equal(outputs[INT8_PRODUCTS[0]], outputs[INT8_PRODUCTS[1]])


@pytest.mark.parametrize("bias", [True, False])
def test_int8_kernel_layer_made_float64_keeps_the_inputs_dtype_and_its_outputs_whichever_product_sums(bias):
    """A layer whose buffers ``.double()`` made float64 (as a model is compared in float64) still answers in x's dtype
    (it once gave float32 inputs float64 outputs), and its two products still agree bitwise (int32 sums once went whole
    into the float64 product and float64 sums rounded to float32: the outputs depended on the CPU's int8 kernel); the
    outputs stay within float32 rounding of the float64 oracle. Positive rows times positive weights: every sum is
    above 2^24, half of them odd (float32 cannot hold them)."""
    torch.manual_seed(13)
    layer = nn.Linear(4096, 32, bias=bias)
    with torch.no_grad():
        layer.weight.uniform_(0.01, 1.0)
    kernel = Int8KernelLinear.from_linear(layer)
    x = torch.rand(3, 4096) + 0.5
    q, scale = quantize_int8(layer.weight)
    oracle = w8a8_float64(x, q, scale, layer.bias.detach() if bias else None)
    assert (oracle.abs() / (x.abs().amax(1, keepdim=True).double() / 127 * scale.double()) > 2**24).all()
    kernel.double()
    outputs = {}
    for product in INT8_PRODUCTS:
        if product == INT8_PRODUCTS[0] and quantize.int8_product() != product:
            continue  # torch._int_mm does not sum exactly on this CPU
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quantize, "int8_product", lambda product=product: product)
            for dtype in (torch.float32, torch.bfloat16):
                outputs[product, dtype] = kernel(x.to(dtype))
                assert outputs[product, dtype].dtype == dtype
    assert torch.allclose(outputs[INT8_PRODUCTS[1], torch.float32].double(), oracle, rtol=1e-6, atol=0)
    if quantize.int8_product() == INT8_PRODUCTS[0]:
        assert torch.equal(outputs[INT8_PRODUCTS[0], torch.float32], outputs[INT8_PRODUCTS[1], torch.float32])


@pytest.mark.parametrize("product", INT8_PRODUCTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_int8_kernel_layer_rounds_in_float32_as_its_contract_says(monkeypatch, product, bias, dtype):
    """Bitwise, the float32 steps the docstring names, written out one operation at a time: each row's scale
    max |row| / 127, its levels round(row / scale) in [-127, 127] (0 where the scale is 0 or the row not finite), the
    exact sums rounded to float32, times (row scale x channel scale), plus the bias (as torch.addcmul adds it: one
    rounding, not two), then x's dtype. Rows of every
    kind: Gaussian, sums above 2^24, a zero row, rows holding NaN or an infinity, a subnormal row, on 1 and 7 rows
    and a (2, 3, in) batch. A fused or skipped step that changed one output bit fails here."""
    if product == INT8_PRODUCTS[0] and quantize.int8_product() != product:
        pytest.skip("torch._int_mm does not sum exactly on this CPU")
    monkeypatch.setattr(quantize, "int8_product", lambda: product)
    torch.manual_seed(12)
    layer = nn.Linear(3072, 40, bias=bias)
    kernel = Int8KernelLinear.from_linear(layer)
    x = torch.randn(7, 3072)
    x[0] = torch.where(kernel.q[0] >= 0, 2.5, -2.5)  # agrees with weight row 0's signs: a sum above 2^24
    x[1] = 0
    x[2, 9], x[3, 1], x[4, 2] = float("nan"), float("inf"), -float("inf")
    x[5] = x[5] * 2.0**-140  # subnormal entries
    for rows in (x[:1], x, torch.randn(2, 3, 3072)):
        rows = rows.to(dtype)
        flat = rows.reshape(-1, 3072).float()
        row_scale = flat.abs().amax(dim=1, keepdim=True) / 127
        levels = torch.where(row_scale > 0, flat / row_scale, torch.zeros_like(flat)).round().clamp(-127, 127)
        levels = torch.where(levels.isnan(), 0.0, levels).to(torch.int8)
        sums = (levels.double() @ kernel.q.double().t()).float()
        scales = row_scale * kernel.scale  # (M, out), float32
        expected = torch.addcmul(kernel.bias, sums, scales) if bias else sums * scales  # addcmul: bias + sums x scales
        expected = expected.reshape(*rows.shape[:-1], 40).to(dtype)
        got = kernel(rows)
        assert got.dtype == dtype and torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected))


def test_int8_kernel_layer_takes_hostile_inputs():
    """A zero row gives the bias (no 0 / 0); a row holding NaN or an infinity gives NaN throughout, the other rows
    unchanged; no rows give no rows; float64 and bfloat16 inputs come back in their dtype; an input too wide for exact
    int32 sums is a ValueError naming q."""
    from course_lib.quantize import INT8_KERNEL_MAX_IN

    torch.manual_seed(3)
    layer = nn.Linear(32, 16)
    kernel = Int8KernelLinear.from_linear(layer)
    q, scale = quantize_int8(layer.weight)
    x = torch.randn(4, 32)
    x[1] = 0
    x[2, 5] = float("nan")
    x[3, 7] = float("-inf")
    y = kernel(x)
    assert torch.equal(y[1], layer.bias.detach())
    assert y[2].isnan().all() and y[3].isnan().all()
    expected = w8a8_float64(x[:1], q, scale, layer.bias.detach())
    assert torch.allclose(y[:1].double(), expected, rtol=1e-5, atol=1e-6)
    assert kernel(torch.randn(0, 32)).shape == (0, 16) and kernel(torch.randn(2, 0, 32)).shape == (2, 0, 16)
    for dtype in (torch.float64, torch.bfloat16):
        assert kernel(torch.randn(2, 32, dtype=dtype)).dtype == dtype
    assert INT8_KERNEL_MAX_IN * 127 * 128 < 2**31 <= (INT8_KERNEL_MAX_IN + 1) * 127 * 128  # int8 weights hold -128
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., in\) with in = in_features = 32, got shape \(2, 24\)"):
        kernel(torch.randn(2, 24))
    with pytest.raises(ValueError, match=f"q's in = {INT8_KERNEL_MAX_IN + 1} must be at most {INT8_KERNEL_MAX_IN}"):
        Int8KernelLinear(torch.zeros(1, INT8_KERNEL_MAX_IN + 1, dtype=torch.int8), torch.ones(1))


def test_int8_product_falls_back_where_int_mm_saturates(monkeypatch):
    """A kernel that adds pairs of products in 16 bits, saturating (oneDNN's int8 product without VNNI), fails
    the probe: the float64 product runs instead. The exact one passes it."""

    def saturating(x, w):  # x + 128 as uint8 times w, pairs summed in int16 (saturated), then 128 * sum(w) taken off
        products = (x.long() + 128)[:, :, None] * w.long()[None, :, :]  # (M, in, out)
        pairs = products.reshape(x.shape[0], -1, 2, w.shape[1]).sum(dim=2).clamp(-2**15, 2**15 - 1)
        return (pairs.sum(dim=1) - 128 * w.long().sum(dim=0)).int()

    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert quantize.int8_product.__wrapped__() == INT8_PRODUCTS[1]
    monkeypatch.setattr(torch, "_int_mm", lambda x, w: (x.long() @ w.long()).int())
    assert quantize.int8_product.__wrapped__() == INT8_PRODUCTS[0]


def test_int8_kernel_layer_is_exact_with_onednn_held_to_avx2():
    """With oneDNN held to AVX2 (no VNNI: torch._int_mm's sums saturate there, measured), the layer falls back to the
    float64 product and still matches the oracle's integer sums: run in a fresh process, as on such a CPU (an x86 one:
    elsewhere ONEDNN_MAX_CPU_ISA=AVX2 means nothing)."""
    if "avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    code = ("import torch; from course_lib import quantize; from torch import nn\n"
            "torch.manual_seed(0); layer = nn.Linear(256, 64, bias=False)\n"
            "k = quantize.Int8KernelLinear.from_linear(layer); x = torch.ones(1, 256)\n"
            "s = (k.q.long().sum(1) * 127).double() * (1 / 127) * k.scale.double()\n"
            "print(quantize.int8_product(), float((k(x).double() - s).abs().max() / s.abs().max()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}).stdout.split()
    assert out[0:2] == ["float64", "matmul"] and float(out[2]) < 1e-6



def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


@pytest.mark.parametrize("isa,flag,product", [("AVX2_VNNI", "avx_vnni", INT8_PRODUCTS[0]),
                                              ("AVX512_CORE_VNNI", "avx512_vnni", INT8_PRODUCTS[0]),
                                              ("AVX512_CORE", "avx512f", INT8_PRODUCTS[1]),
                                              ("AVX2", "avx2", INT8_PRODUCTS[1])])
def test_int8_product_probe_agrees_with_wider_products_per_isa(isa, flag, product):
    """The probe's choice under each oneDNN ISA is the truth on products wider and taller than its own (100 rows of
    1,024 random levels, and rows of +127 against +-127, times 512 outputs): torch._int_mm where it sums them exactly,
    which VNNI does on AVX2 (AVX-VNNI) as on AVX-512, else the float64 product. Run where the CPU has the ISA."""
    if flag not in _cpu_flags():
        pytest.skip(f"this CPU has no {flag}")
    code = ("import torch; from course_lib import quantize\n"
            "g = torch.Generator().manual_seed(1); exact = True\n"
            "x = torch.randint(-127, 128, (100, 1024), generator=g, dtype=torch.int8)\n"
            "w = torch.randint(-127, 128, (512, 1024), generator=g, dtype=torch.int8)\n"
            "for a in (x, torch.full_like(x, 127)):\n"
            "    b = torch.where(torch.arange(512)[:, None] % 2 == 0, 127, -127).to(torch.int8).expand(512, 1024)\n"
            "    for b in (w, b.contiguous()):\n"
            "        exact &= torch.equal(torch._int_mm(a, b.t()).long(), a.long() @ b.long().t())\n"
            "print(quantize.int8_product().replace(' ', '_'), exact)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa}).stdout.split()
    assert out == [product.replace(" ", "_"), str(product == INT8_PRODUCTS[0])]

def test_quantize_model_replaces_every_linear_in_place():
    model = small_gpt()
    assert quantize_model(model) is model
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * SMALL.n_layer + 1
    assert model.transformer.wte.weight.dtype == torch.float32  # the embedding stays float32 for its look-ups
    for bad, match in ((lambda: quantize_model("gpt"), "model must be an nn.Module, got str"),
                       (lambda: Int8Linear.from_linear(nn.Embedding(3, 4)), "linear must be an nn.Linear, got Embedding"),
                       (lambda: Int8Linear(torch.zeros(2, 3), torch.ones(2)), "q must be a 2-D int8 tensor"),
                       (lambda: Int8Linear(torch.zeros(2, 3, dtype=torch.int8), torch.ones(3)), r"scale must have shape \(out,\)"),
                       (lambda: Int8Linear(torch.zeros(2, 3, dtype=torch.int8), torch.ones(2), torch.ones(3)), "bias must be None")):
        with pytest.raises(ValueError, match=match):
            bad()


def test_int8_linear_keeps_the_inputs_dtype_with_a_float32_bias():
    q, scale = quantize_int8(torch.randn(6, 8))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert int8_linear(torch.randn(2, 8, dtype=dtype), q, scale, torch.randn(6)).dtype == dtype


def test_quantize_weights_copies_and_leaves_the_model_alone():
    model = small_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    int8, bf16, fp32 = (quantize_weights(model, w) for w in ("int8", "bfloat16", "float32"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    linears = [m for m in int8.modules() if isinstance(m, (nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8KernelLinear) for m in linears)  # 4 per block and the LM head
    assert len(linears) == 4 * SMALL.n_layer + 1
    assert int8.transformer.wte.weight.dtype == torch.float32  # the embedding stays float32 for its look-ups
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert fp32.lm_head.weight is fp32.transformer.wte.weight  # the copy keeps the tie
    with pytest.raises(ValueError, match=r"weights must be one of \('float32', 'bfloat16', 'int8', 'int4'\), got 'int2'"):
        quantize_weights(model, "int2")
    assert WEIGHT_FORMATS == ("float32", "bfloat16", "int8", "int4")


def test_decode_weight_bytes_counts_what_a_step_reads():
    model = small_gpt()
    assert decode_weight_bytes(model) == bytes_per_token(SMALL, 1, 0)  # float32: the formula, to the byte
    assert decode_weight_bytes(quantize_weights(model, "bfloat16")) == bytes_per_token(SMALL, 1, 0, torch.bfloat16)
    int8 = quantize_weights(model, "int8")
    C, V, L = SMALL.n_embd, SMALL.vocab_size, SMALL.n_layer
    matrices = L * 12 * C * C + V * C  # int8, one byte each
    scales = L * (3 * C + C + 4 * C + C) + V  # one float32 per output channel
    vectors = L * (2 * 2 * C + 3 * C + C + 4 * C + C) + 2 * C  # LayerNorms and biases, float32
    assert decode_weight_bytes(int8) == matrices + 4 * (scales + vectors)


def test_quantized_models_decode_and_stay_close_to_float32():
    model = small_gpt(1)
    idx = torch.randint(0, SMALL.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = model(idx)
        for weights in ("int8", "bfloat16"):
            quantized = quantize_weights(model, weights)
            q_logits, _ = quantized(idx)
            assert (q_logits.float() - logits).abs().max() < 0.05 * logits.abs().max()
            out = generate_cached(quantized, idx[:, :4], 6)
            assert out.shape == (2, 10) and torch.equal(out[:, :4], idx[:, :4])


# ---- int4 with a scale and a minimum per group


def test_quantize_int4_is_the_formula_per_group_of_consecutive_inputs():
    # one row, two groups of 32: 0..31 (minimum 0, scale 31 / 15) and -1, 0, ..., 29 and 59 (minimum -1, scale 4)
    weight = torch.cat([torch.arange(32.0), torch.arange(-1.0, 30.0), torch.tensor([59.0])])[None, :]
    q, scale, minimum = quantize_int4(weight, 32)
    assert q.dtype == torch.uint8 and scale.dtype == minimum.dtype == torch.float32
    assert minimum.tolist() == [[0.0, -1.0]] and torch.allclose(scale, torch.tensor([[31 / 15, 4.0]]))
    expected = torch.cat([torch.round(torch.arange(32.0) / (31 / 15)), torch.round(torch.arange(32.0) / 4).clamp(max=15)])
    expected[-1] = 15  # 59 - (-1) = 60 = 15 steps of 4
    assert torch.equal(q[0].float(), expected)
    back = dequantize_int4(q, scale, minimum)
    assert back.dtype == torch.float32 and ((back - weight).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(weight=torch.zeros(3, 64), group_size=16), r"group_size must be one of \(32, 64, 128\), got 16"),
    (dict(weight=torch.zeros(3, 64), group_size=256), r"group_size must be one of \(32, 64, 128\), got 256"),
    (dict(weight=torch.zeros(3, 80), group_size=32), r"weight's in = 80 inputs must be a multiple of group_size = 32"),
    (dict(weight=torch.zeros(64), group_size=32), r"weight must be 2-D \(out, in\), got shape \(64,\)"),
    (dict(weight=torch.zeros(3, 64), group_size=32.0), r"group_size must be one of \(32, 64, 128\), got 32.0"),
    (dict(weight=torch.zeros(3, 64).index_fill(1, torch.tensor([5]), float("nan")), group_size=32),
     "weight must be finite: it holds NaN or an infinity"),
    (dict(weight=torch.zeros(3, 64).index_fill(1, torch.tensor([40]), float("-inf")), group_size=64),
     "weight must be finite: it holds NaN or an infinity"),
])
def test_quantize_int4_names_the_bad_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_int4(**kwargs)


@pytest.mark.parametrize("kernel", INT4_KERNELS)
@pytest.mark.parametrize("out_features,group_size,bias", [(24, 32, True), (48, 64, False), (7, 128, True)])
def test_int4_linear_is_f_linear_with_the_dequantized_weight(monkeypatch, kernel, out_features, group_size, bias):
    """Both kernels, forced, against float64 F.linear on the dequantized weight: the dequantizing one within float32
    rounding, PyTorch's int4 kernel within its bfloat16 rounding (activations, scales and offsets); output channels
    that are not a multiple of 16 (7, 24) padded and cut back."""
    if kernel == "int4 kernel" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this PyTorch build has no CPU int4 kernel")
    monkeypatch.setenv("COURSE_INT4_KERNEL", "auto")  # the argument forces it
    torch.manual_seed(3)
    linear = nn.Linear(256, out_features, bias=bias)
    layer = Int4Linear.from_linear(linear, group_size, kernel=kernel)
    assert layer.kernel == kernel
    x = torch.randn(2, 3, 256)
    expected = F.linear(x.double(), dequantize_int4(*quantize_int4(linear.weight, group_size)).double(),
                        None if linear.bias is None else linear.bias.double())
    y = layer(x)
    assert y.shape == (2, 3, out_features) and y.dtype == torch.float32
    tolerance = 1e-5 if kernel == "dequantize + F.linear" else 2e-2  # bfloat16: 8 significant bits
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_int4_models_store_half_a_byte_per_weight_and_decode_their_reference_tokens(monkeypatch):
    from course_lib.bench.decode import NEAR_TIE, first_difference, int4_reference_model, parting

    monkeypatch.setenv("COURSE_INT4_KERNEL", "int4 kernel")
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
    model = small_gpt(4, config)
    int4 = quantize_weights(model, "int4", 32)
    layers = [m for m in int4.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * config.n_layer + 1 and not any(type(m) is nn.Linear for m in int4.modules())
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    weights = L * 12 * C * C + V * C
    groups = weights // 32
    vectors = L * (2 * 2 * C + 3 * C + C + 4 * C + C) + 2 * C  # LayerNorms and biases, float32
    assert decode_weight_bytes(int4) == weights // 2 + 2 * 2 * groups + 4 * vectors  # a bfloat16 pair per group
    idx = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(5))
    reference = int4_reference_model(model)
    part = parting(generate_cached(int4, idx, 8), reference, 4)  # the kernel's bfloat16 can flip a near-tie only
    assert part is None or part["margin"] < NEAR_TIE, part
    assert first_difference(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])) == 2


def test_parting_measures_the_reference_logit_margin_and_the_bench_names_a_parting_rounding_cannot_explain():
    """Where int4's tokens part from the float64 reference, the bench reports the reference's own logit margin at that
    step: a second-best token chosen at a real gap is NOT a near-tie (the bench once called every parting bfloat16
    rounding). The margin's oracle: the reference's logits of the two tokens, from a plain forward pass."""
    from course_lib.bench.decode import NEAR_TIE, format_decode, int4_reference_model, parting

    config = GPTConfig(vocab_size=48, block_size=32, n_layer=1, n_head=2, n_embd=64)
    reference = int4_reference_model(small_gpt(6, config))
    prompt = torch.randint(0, config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(7))
    expected = generate_cached(reference, prompt, 5)
    assert parting(expected, reference, 4) is None
    with torch.no_grad():
        logits = reference(expected[1:2, :6])[0][0, -1]  # row 1, the step that writes new token 2
    second = logits.argsort(descending=True)[1]
    planted = expected.clone()
    planted[1, 6] = second  # row 1 takes its second-best token at new token 2, the later tokens left as they were
    parted = parting(planted, reference, 4)
    margin = ((logits.max() - logits[second]) / logits.abs().max()).item()
    assert parted["token"] == 2 and parted["margin"] == pytest.approx(margin, rel=1e-9) and margin > NEAR_TIE
    row = {"shape": "tiny", "batch_size": 3, "impl": "ours int4, cached", "new_tokens": 5, "seconds": 1.0,
           "tokens_per_s": 15.0, "ratio_to_hf": 1.0, "same_tokens_as_hf": True,
           "partings": {"int8": None, "int4": parted}}
    table = format_decode({"prompt_len": 4, "threads": 1, "repeats": 1, "warmup": 0, "rows": [row], "bound": None})
    assert f"tiny B=3: from token 2 on, where the reference's two logits differ by {margin:.1e}" in table
    assert "NOT a near-tie: more than rounding explains" in table
    assert "ours int8 == a float64 model with the same int8 rounding of weights and activations, same tokens: tiny B=3: yes" \
        in table


def test_int8_models_decode_the_tokens_of_their_float64_w8a8_reference():
    """quantize_weights' int8 model (int8 weights and activations, int32 sums) and the bench's float64 reference
    (``int8_reference_model``: the same rounding in float64) write the same greedy tokens but at a near-tie (the
    bench's rule: float32 and float64 can round an activation to neighbouring levels); the reference's layer is
    the test's float64 oracle of the rounding, and differs from a weight-only int8 model's logits by more than float
    rounding (it rounds the activations)."""
    from course_lib.bench.decode import NEAR_TIE, W8A8Reference, int8_reference_model, parting

    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
    model = small_gpt(4, config)
    int8, reference = quantize_weights(model, "int8"), int8_reference_model(model)
    layers = [m for m in reference.modules() if isinstance(m, W8A8Reference)]
    assert len(layers) == 4 * config.n_layer + 1 and not any(type(m) is nn.Linear for m in reference.modules())
    x = torch.randn(2, 3, 64, dtype=torch.float64)
    linear = model.transformer.h[0].mlp.c_fc
    q, scale = quantize_int8(linear.weight)
    with torch.no_grad():
        assert torch.allclose(layers[2](x), w8a8_float64(x, q, scale, linear.bias.detach()), rtol=1e-12, atol=1e-12)
    idx = torch.randint(0, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(5))
    part = parting(generate_cached(int8, idx, 8), reference, 4)  # float32 and float64 can round a level apart
    assert part is None or part["margin"] < NEAR_TIE, part
    with torch.no_grad():
        w8a8, weight_only = reference(idx)[0], quantize_model(copy.deepcopy(model)).double()(idx)[0]
    assert (w8a8 - weight_only).abs().max() > 1e-4 * weight_only.abs().max()


def test_quantize_weights_refuses_an_int4_group_size_that_would_quantize_nothing():
    """A group size outside 32, 64, 128 is a ValueError naming group_size, never a float32 copy returned as "int4"
    (no layer's width divides by 100, so each would be skipped)."""
    from course_lib.quantize import quantize_weights

    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="group_size"):
        quantize_weights(model, "int4", group_size=100)
