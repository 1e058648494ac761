"""Chapter 08's learner-facing checks: the reference and correct alternatives pass; each classic bug gets a specific
message."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import checks
from course_lib.gpt import GPTConfig
from course_lib.quantize import Int8Linear, bytes_per_token, int8_linear, quantize_int8
from course_lib.quantize import quantize_model as reference_quantize_model


# ---- correct alternatives: other formulations pass too


def bytes_by_layers(config, batch_size, context, dtype=torch.float32, cache_dtype=None):
    """Layer by layer, from the shapes, as a tensor; the cache's dtype from a dict."""
    C, b = config.n_embd, int(config.bias)
    attention = C * 3 * C + b * 3 * C + C * C + b * C
    mlp = C * 4 * C + b * 4 * C + 4 * C * C + b * C
    norms = 2 * (C + b * C)
    weights = config.vocab_size * C + config.n_layer * (attention + mlp + norms) + C + b * C
    cache = config.n_layer * 2 * context * C
    cache_dtype = cache_dtype or {torch.int8: torch.float32}.get(dtype, dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    return torch.tensor(weights / batch_size * size + cache * torch.finfo(cache_dtype).bits // 8, dtype=torch.float64)


def quantize_by_rows(weight):
    """Row by row, multiplying by 127 / max |w| instead of dividing by the scale (where the scale is not 0)."""
    qs, scales = [], []
    for row in weight.float():
        top = row.abs().max()
        if top / 127 == 0:  # all zeros, or so small that the float32 scale underflows
            qs.append(torch.zeros_like(row, dtype=torch.int8))
            scales.append(torch.zeros(()))
            continue
        qs.append(torch.clamp(torch.round(row * (127 / top)), -127, 127).to(torch.int8))
        scales.append(top / 127)
    return torch.stack(qs), torch.stack(scales)


def quantize_in_float64(weight):
    """Divides in float64 by the float32 scale it returns (a float32 scale of 0 gives q 0)."""
    w = weight.double()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).float().double()
    q = torch.where(scale > 0, w / scale.clamp(min=1e-300), torch.zeros_like(w)).round().to(torch.int8)
    return q, scale.squeeze(1).float()


def dequantize_by_diagonal(q, scale):
    return torch.diag(scale) @ q.float()


def quantize_masking_the_division(weight):
    """Divides every row, then keeps 0 where the scale is 0: 0 / 0 is computed and thrown away (same numbers)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.where(scale[:, None] > 0, torch.round(w / scale[:, None]), 0.0)
    return q.clamp(-127, 127).to(torch.int8), scale


def quantize_then_zero_the_rows(weight):
    """Casts the unguarded division (NaN, inf: undefined), then overwrites the rows whose scale is 0."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    q[scale == 0] = 0
    return q, scale


def quantize_then_masked_fill(weight):
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale[:, None]).to(torch.int8)
    return q.masked_fill((scale == 0)[:, None], 0), scale


def dequantize_by_einsum(q, scale):
    return torch.einsum("oi,o->oi", q.to(torch.float32), scale)


def int8_linear_dequantized(x, q, scale, bias=None):
    """Builds the float weight first (slower, same numbers)."""
    return F.linear(x, (q.float() * scale[:, None]).to(x.dtype), None if bias is None else bias.to(x.dtype))


def int8_linear_einsum(x, q, scale, bias=None):
    y = torch.einsum("...i,oi->...o", x, q.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


@pytest.mark.parametrize("check,solution", [
    (checks.check_bytes_per_token, bytes_by_layers),
    (checks.check_quantize_int8, quantize_by_rows),
    (checks.check_quantize_int8, quantize_in_float64),
    (checks.check_quantize_int8, quantize_masking_the_division),
    (checks.check_quantize_int8, quantize_then_zero_the_rows),
    (checks.check_quantize_int8, quantize_then_masked_fill),
    (checks.check_dequantize_int8, dequantize_by_diagonal),
    (checks.check_dequantize_int8, dequantize_by_einsum),
    (checks.check_int8_linear, int8_linear_dequantized),
    (checks.check_int8_linear, int8_linear_einsum),
])
def test_correct_alternatives_pass(check, solution, capsys):
    check(solution)
    assert "all visible checks passed" in capsys.readouterr().out


# ---- exercise 1: bytes per token


def _bytes(config, batch_size, context, dtype=torch.float32, *, element=None, weights_extra=0, kv_factor=2,
           weights_per_token=False, kv_shared=False):
    C = config.n_embd
    element = torch.empty((), dtype=dtype).element_size() if element is None else element
    weights = bytes_per_token(config, 1, 0) / 4 + (weights_extra(config) if weights_extra else 0)  # numbers
    cache = kv_factor * config.n_layer * context * C
    weights_share = weights if weights_per_token else weights / batch_size
    cache_share = cache / batch_size if kv_shared else cache
    return (weights_share + cache_share) * element


def cache_in_weight_dtype(config, B, context, dtype=torch.float32, cache_dtype=None):
    return bytes_per_token(config, B, context, dtype, cache_dtype=dtype)


def no_kv_cache(config, B, context, dtype=torch.float32):
    return _bytes(config, B, context, dtype, kv_factor=0)


def keys_only(config, B, context, dtype=torch.float32):
    return _bytes(config, B, context, dtype, kv_factor=1)


def weights_per_step(config, B, context, dtype=torch.float32):
    return _bytes(config, B, context, dtype, weights_per_token=True)


def whole_step(config, B, context, dtype=torch.float32):
    return bytes_per_token(config, B, context, dtype) * B


def kv_shared(config, B, context, dtype=torch.float32):
    return _bytes(config, B, context, dtype, kv_shared=True)


def with_position_table(config, B, context, dtype=torch.float32):
    return _bytes(config, B, context, dtype, weights_extra=lambda c: c.block_size * c.n_embd)


def head_twice(config, B, context, dtype=torch.float32):
    return _bytes(config, B, context, dtype, weights_extra=lambda c: c.vocab_size * c.n_embd)


def floor_divided(config, B, context, dtype=torch.float32):
    return round(bytes_per_token(config, B, context, dtype) * B) // B


def always_four_bytes(config, B, context, dtype=torch.float32):
    return bytes_per_token(config, B, context)


def always_four_bytes_no_cache_dtype(config, B, context, dtype=torch.float32):
    """Right for every default cache dtype, but without the cache_dtype argument."""
    return bytes_per_token(config, B, context, dtype)


def as_a_string(config, B, context, dtype=torch.float32):
    return f"{bytes_per_token(config, B, context, dtype):,} bytes"


def off_by_one_layer(config, B, context, dtype=torch.float32):
    return bytes_per_token(GPTConfig(config.vocab_size, config.block_size, config.n_layer - 1, config.n_head,
                                     config.n_embd, bias=config.bias), B, context, dtype)


# ---- exercise 2: quantize


def _rowwise(weight, divisor=127.0):
    w = weight.float()
    scale = w.abs().amax(dim=1) / divisor
    return w, scale, torch.where(scale > 0, scale, torch.ones_like(scale))


def per_tensor(weight):
    w = weight.float()
    scale = w.abs().max() / 127
    return torch.round(w / scale).to(torch.int8), scale


def per_tensor_repeated(weight):
    q, scale = per_tensor(weight)
    return q, scale.repeat(weight.shape[0])


def per_input_channel(weight):
    w = weight.float()
    scale = w.abs().amax(dim=0) / 127
    return torch.round(w / torch.where(scale > 0, scale, 1)[None, :]).to(torch.int8), scale


def truncated(weight):
    w, scale, divisor = _rowwise(weight)
    return (w / divisor[:, None]).to(torch.int8), scale


def divided_by_128(weight):
    w, scale, divisor = _rowwise(weight, 128.0)
    return torch.round(w / divisor[:, None]).to(torch.int8), scale


def clamped_asymmetric(weight):
    w, scale, divisor = _rowwise(weight, 128.0)
    return torch.round(w / divisor[:, None]).clamp(-128, 127).to(torch.int8), scale


def scale_clamped(weight):
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def unguarded_division(weight):
    """Divides by the scale even where it is 0: 0 / 0 = NaN (cast to 0 here), 1.4e-44 / 0 = inf, clamped to 127."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def unguarded_unclamped(weight):
    """Divides by a zero scale and casts NaN and inf to int8 (undefined; 0 on this CPU, so q looks right)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def cast_then_clamped(weight):
    """Casts NaN and inf to int8, then clamps the (undefined) integers."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8).clamp(-127, 127), scale


def guarded_on_zero_rows(weight):
    """Guards the rows that are all zeros, not the scales that are 0."""
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scale = absmax / 127
    divisor = torch.where(absmax > 0, scale, torch.ones_like(scale))
    return torch.round(w / divisor[:, None]).clamp(-127, 127).to(torch.int8), scale


def scale_in_float64_divided(weight):
    """Divides by the float64 scale (1.1e-46 for a row of 1.4e-44), returns it in float32 (0)."""
    w = weight.double()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).to(torch.int8)
    return q, scale.float()


def scale_float64(weight):
    q, scale = quantize_int8(weight)
    return q, scale.double()


def scale_bfloat16(weight):
    q, scale = quantize_int8(weight)
    return q, scale.to(torch.bfloat16)


def bfloat16_kept(weight):
    """Quantizes a bfloat16 weight in bfloat16: its scale keeps 8 significant bits."""
    w = weight.detach() if weight.dtype == torch.bfloat16 else weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).clamp(-127, 127).to(torch.int8), scale


def scale_float16(weight):
    q, scale = quantize_int8(weight)
    return q, scale.half()


def scale_keeps_weight_dtype(weight):
    w = weight.detach()
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).to(torch.int8), scale


def q_left_float(weight):
    q, scale = quantize_int8(weight)
    return q.float(), scale


def q_uint8(weight):
    q, scale = quantize_int8(weight)
    return q.to(torch.uint8), scale


def scale_keepdim(weight):
    q, scale = quantize_int8(weight)
    return q, scale[:, None]


def scale_not_divided(weight):
    w, scale, divisor = _rowwise(weight)
    return torch.round(w / divisor[:, None]).to(torch.int8), scale * 127


def max_not_absmax(weight):
    w = weight.float()
    scale = w.amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def in_place(weight):
    q, scale = quantize_int8(weight)
    weight.mul_(0)
    return q, scale


def never_full_range(weight):
    w, scale, divisor = _rowwise(weight)
    return (torch.round(w / divisor[:, None]) * 0.99).round().to(torch.int8), scale


# ---- exercise 3: dequantize


def scale_on_columns(q, scale):
    return q.float() * scale.float()[None, :]


def dequantized_float64(q, scale):
    return q.double() * scale.double()[:, None]


def dequantized_int8(q, scale):
    return (q.float() * scale[:, None]).to(q.dtype)


# ---- exercise 4: int8 linear


def scale_on_input(x, q, scale, bias=None):
    y = (x * scale) @ q.to(x.dtype).T
    return y if bias is None else y + bias


def bias_scaled(x, q, scale, bias=None):
    y = x @ q.to(x.dtype).T
    return (y if bias is None else y + bias) * scale


def scale_forgotten(x, q, scale, bias=None):
    y = x @ q.to(x.dtype).T
    return y if bias is None else y + bias


def not_transposed(x, q, scale, bias=None):
    y = x @ (q.to(x.dtype) * scale[:, None])
    return y if bias is None else y + bias


def q_not_transposed(x, q, scale, bias=None):
    y = (x @ q.to(x.dtype)) * scale
    return y if bias is None else y + bias


def output_float64(x, q, scale, bias=None):
    return int8_linear(x.double(), q, scale.double(), None if bias is None else bias.double())


def bias_required(x, q, scale, bias=None):
    return F.linear(x, q.to(x.dtype)) * scale + bias


def matrix_only(x, q, scale, bias=None):
    y = torch.mm(x, q.to(x.dtype).T) * scale
    return y if bias is None else y + bias


def loose_precision(x, q, scale, bias=None):
    return int8_linear(x.to(torch.bfloat16), q, scale, None if bias is None else bias).to(x.dtype)


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_bytes_per_token, no_kv_cache, (r"batch_size=1, context=16, .*that is the weights alone "
                                                 r"\(.* bytes / batch 1\): each sequence also reads its own KV cache, "
                                                 r"2 x n_layer x context x n_embd = 2 x 2 x 16 x 8 = 512 numbers")),
    (checks.check_bytes_per_token, keys_only, r"you counted 256 cached numbers per sequence, the keys only"),
    (checks.check_bytes_per_token, weights_per_step, (r"batch_size=8, .*you counted the weights in full for every "
                                                      r"token .*per step is not per token")),
    (checks.check_bytes_per_token, whole_step, (r"that is what the whole step reads; .*B = 8 tokens: divide by the "
                                                r"batch size")),
    (checks.check_bytes_per_token, kv_shared, r"you divided the KV cache by the batch size too, as if it were shared"),
    (checks.check_bytes_per_token, floor_divided, r"batch_size=7, .*you divided with //, which rounds down"),
    (checks.check_bytes_per_token, with_position_table, (r"context=0, dtype=the default torch.float32: .*you counted "
                                                         r"the position table transformer.wpe \(block_size x n_embd = "
                                                         r"16 x 8 = 128 numbers\)")),
    (checks.check_bytes_per_token, head_twice, r"LM head and the token embedding separately: .* 50 x 8 = 400 numbers"),
    (checks.check_bytes_per_token, always_four_bytes, (r"dtype=torch.bfloat16: .*you counted 4 byte\(s\) per number, "
                                                       r"but a torch.bfloat16 weight takes 2")),
    (checks.check_bytes_per_token, cache_in_weight_dtype, (r"batch_size=8, context=10, dtype=torch.int8: .*you counted "
                                                           r"the cache in the weights' dtype \(1 byte\(s\) per number\), "
                                                           r"but it is stored in torch.float32")),
    (checks.check_bytes_per_token, always_four_bytes_no_cache_dtype, (r"cache_dtype=torch.float32\) raised TypeError: "
                                                                      r".*keep the signature's cache_dtype argument")),
    (checks.check_bytes_per_token, as_a_string, r"should be a number \(bytes\), got str"),
    (checks.check_bytes_per_token, off_by_one_layer, (r"you computed 5,152 bytes per token, expected 8,640 = \(weights "
                                                      r"8,640 bytes, read once for the batch, \+ 1 x one sequence's "
                                                      r"KV cache 0 bytes in torch.float32\) / 1")),
    (checks.check_quantize_int8, per_tensor, (r"scale has shape \(\) \(a \(6, 10\) float32 weight\): one scale for "
                                              r"the whole matrix \(per-tensor\).*row 1 .*would round to 0 everywhere")),
    (checks.check_quantize_int8, per_tensor_repeated, r"every row got the same scale, .* \(per-tensor\)"),
    (checks.check_quantize_int8, per_input_channel, r"scale has shape \(10,\) = \(in,\) .*one scale per input channel"),
    (checks.check_quantize_int8, truncated, (r"q looks truncated toward zero, not rounded .*became -?\d+, an error of "
                                             r"0\.\d\d of a step")),
    (checks.check_quantize_int8, divided_by_128, r"= -128 .*your scale is max \|w\| / 128, .*wraps around"),
    (checks.check_quantize_int8, clamped_asymmetric, r"= -128 .*symmetric int8 uses the levels -127..127 only"),
    (checks.check_quantize_int8, scale_clamped, (r"row 2 of this weight is all zeros .*its scale should be max \|w\| "
                                                 r"/ 127 = 0, got 1e-08 \(did you clamp")),
    (checks.check_quantize_int8, unguarded_division, (r"row 3's largest \|w\| is 1.4e-44 .*underflows to 0, and your q "
                                                      r"has 6 nonzero level\(s\) there, e.g. 127 \(your code computed "
                                                      r"an infinity in .*\): a division by a zero scale")),
    (checks.check_quantize_int8, unguarded_unclamped, (r"your code turned NaN into integers .*casting NaN or an infinity "
                                                       r"to int8 is undefined.*a division by a zero scale")),
    (checks.check_quantize_int8, cast_then_clamped, r"your code turned NaN into integers \(to\)"),
    (checks.check_quantize_int8, guarded_on_zero_rows, (r"row 3's .*underflows to 0.*an infinity in .*a division by a "
                                                        r"zero scale.*not by whether the row is all zeros")),
    (checks.check_quantize_int8, scale_in_float64_divided, (r"row 3's .*underflows to 0.*you divided by a scale kept "
                                                            r"in higher precision \(in float64 it is 1.1e-46, not 0\)")),
    (checks.check_quantize_int8, scale_float64, r"scale should be float32, got torch.float64 \(a \(6, 10\) float32"),
    (checks.check_quantize_int8, bfloat16_kept, r"scale should be float32, got torch.bfloat16 \(a \(4, 6\) bfloat16 weight\)"),
    (checks.check_quantize_int8, scale_bfloat16, (r"scale should be float32, got torch.bfloat16 .*8 significant bits, "
                                                  r"so the scale is off from max \|w\| / 127 by up to 0.39%")),
    (checks.check_quantize_int8, scale_float16, r"scale should be float32, got torch.float16 .*11 significant bits"),
    (checks.check_quantize_int8, scale_keeps_weight_dtype, (r"scale should be float32, got torch.float64 \(a \(5, 7\) "
                                                            r"float64 weight\)")),
    (checks.check_quantize_int8, q_left_float, (r"q should be int8 \(torch.int8\), got torch.float32 .*round, then "
                                                r"store the levels as 8-bit integers")),
    (checks.check_quantize_int8, q_uint8, r"got torch.uint8 .*no negative levels"),
    (checks.check_quantize_int8, scale_keepdim, r"scale has shape \(6, 1\) .*return it as \(out,\) = \(6,\)"),
    (checks.check_quantize_int8, scale_not_divided, (r"scale\[0\] should be max \|w\[0, :\]\| / 127 = .*: that is max "
                                                     r"\|w\| itself")),
    (checks.check_quantize_int8, max_not_absmax, r"that is max w\[2, :\] / 127; take the largest magnitude, max \|w\[2, :\]\|"),
    (checks.check_quantize_int8, in_place, r"quantize_int8 changed the weight it was given"),
    (checks.check_quantize_int8, never_full_range, (r"q\[0, 0\] = -92 stands for q x scale = .*off by 1\.01 steps, "
                                                    r"more than half a step")),
    (checks.check_quantize_int8, lambda weight: quantize_int8(weight)[0], r"should return a tuple \(q, scale\)"),
    (checks.check_dequantize_int8, scale_on_columns, r"for q \(5, 5\): you scaled the columns, q \* scale\[None, :\]"),
    (checks.check_dequantize_int8, dequantized_float64, r"returned torch.float64, expected torch.float32"),
    (checks.check_dequantize_int8, dequantized_int8, r"returned torch.int8: the dequantized weight is real numbers"),
    (checks.check_int8_linear, scale_on_input, (r"square \(8, 8\) weight: you multiplied x by the scale, along the "
                                                r"input axis")),
    (checks.check_int8_linear, bias_scaled, r"you multiplied the bias by the scale too"),
    (checks.check_int8_linear, scale_forgotten, r"your output is x @ q.T \+ bias, without the scale"),
    (checks.check_int8_linear, not_transposed, r"you computed x @ W, not x @ W.T"),
    (checks.check_int8_linear, q_not_transposed, r"you computed x @ q, not x @ q.T"),
    (checks.check_int8_linear, output_float64, (r"returned torch.float64 for x in torch.float32: the output should be "
                                                r"in x's dtype")),
    (checks.check_int8_linear, bias_required, (r"int8_linear\(x, q, scale, None\) for x \(5, 10\) and bias=None raised "
                                               r"TypeError: .*a layer may have no bias")),
    (checks.check_int8_linear, matrix_only, (r"for x \(2, 3, 10\) raised RuntimeError: .*any number of leading "
                                             r"dimensions")),
    (checks.check_int8_linear, loose_precision, r"differs from the expected values in \d+ of 32 entries"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_the_oracles_are_independent_of_the_reference():
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8)
    # by hand: 50 x 8 embedding + 2 layers x (12 x 64 + 13 x 8) + 2 x 8 final LayerNorm = 2,160 numbers
    assert checks.bytes_per_token_oracle(config, 1, 0) == 2_160 * 4
    # + per sequence 2 x 2 layers x 10 tokens x 8 = 320 cached numbers; batch 4, bfloat16
    assert checks.bytes_per_token_oracle(config, 4, 10, torch.bfloat16) == (2_160 / 4 + 320) * 2
    # int8 weights (1 byte each) keep a float32 cache (4 bytes per number); a cache dtype given explicitly wins
    assert checks.bytes_per_token_oracle(config, 4, 10, torch.int8) == 2_160 / 4 + 320 * 4
    assert checks.bytes_per_token_oracle(config, 4, 10, torch.float32, torch.float16) == 2_160 + 320 * 2
    weight = torch.tensor([[0.5, -1.27, 0.0], [0.0, 0.0, 0.0], [2.54, 1.0, -0.1]])
    q, scale = checks.int8_reference(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float64
    assert q.tolist() == [[50, -127, 0], [0, 0, 0], [127, 50, -5]]
    assert torch.allclose(scale, torch.tensor([0.01, 0.0, 0.02], dtype=torch.float64))
    # a row whose scale underflows to 0 in float32 (1.4e-44 / 127) counts as zero, whatever float64 says
    q, scale = checks.int8_reference(torch.tensor([[1.4e-44, -7e-45], [1.27, -0.5]]))
    assert q.tolist() == [[0, 0], [127, -50]] and scale[0] == 0
    ties = checks.int8_rounding_ties(torch.tensor([[2.54, 0.25, 1.27, 0.03]]))  # 127, 12.5, 63.5, 1.5
    assert ties.tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("weights,expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                              ("int8", torch.float32)])
def test_the_default_cache_dtype_is_the_one_the_course_models_cache_in(weights, expected):
    """checks.default_cache_dtype against the cache chapter 05's KVCache.for_model makes for a quantized copy."""
    from course_lib.gpt import GPT
    from course_lib.kv_cache import KVCache
    from course_lib.quantize import quantize_weights

    model = quantize_weights(GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16)), weights)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[weights]
    assert KVCache.for_model(model, 1, 4).storage.dtype == expected == checks.default_cache_dtype(dtype)


# ---- the int8 model: Int8Linear and quantize_model


def _int8_layer_class(quantize):
    """An Int8Linear whose from_linear quantizes with `quantize(weight) -> (q, scale)`, the bias kept."""
    class Layer(Int8Linear):
        @classmethod
        def from_linear(cls, linear):
            q, scale = quantize(linear.weight.detach().float())
            return cls(q, scale, linear.bias)
    return Layer


def _quantizer(layer=Int8Linear, walk=lambda model: model.modules(), copy_first=False):
    """A quantize_model that replaces the nn.Linear children of `walk(model)` by `layer.from_linear`."""
    def quantize_model(model):
        model = copy.deepcopy(model) if copy_first else model
        for module in list(walk(model)):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, layer.from_linear(child))
        return model
    return quantize_model


def _levels(w, scale, rounding=torch.round):
    return rounding(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class _BiasQuantized(Int8Linear):
    @classmethod
    def from_linear(cls, linear):
        q, scale = quantize_int8(linear.weight)
        bias = None if linear.bias is None else torch.round(linear.bias.detach() / scale).clamp(-127, 127) * scale
        return cls(q, scale, bias)


class _Float32Out(Int8Linear):
    def forward(self, x):  # BUG: every input computed and returned in float32
        return super().forward(x.float())


def quantize_by_name(model):
    """Correct: the nn.Linear layers found by name first, then each replaced through get_submodule."""
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int8Linear.from_linear(model.get_submodule(name)))
    return model


def test_the_int8_model_reference_and_an_alternative_pass():
    checks.check_quantize_model(reference_quantize_model)
    checks.check_quantize_model(quantize_by_name)


@pytest.mark.parametrize("buggy,message", [
    (_quantizer(walk=lambda model: model.transformer.h.modules()), "left 1 of the 9 nn.Linear layers unquantized: lm_head"),
    (_quantizer(copy_first=True), "not the model it was given"),
    (_quantizer(_int8_layer_class(lambda w: _levels(w, (w.abs().max() / 127).expand(w.shape[0]).clone()))),
     "one scale for the whole matrix"),
    (_quantizer(_int8_layer_class(lambda w: _levels(w, w.abs().mean(dim=1) / 127))), r"mean \|row\| / 127"),
    (_quantizer(_int8_layer_class(lambda w: _levels(w, w.abs().amax(dim=1) / 127, torch.floor))), r"rounded down, q = floor\(w / scale\)"),
    (_quantizer(_int8_layer_class(lambda w: _levels(w, w.abs().amax(dim=1) / 127, torch.trunc))), "rounded towards zero"),
    (_quantizer(_BiasQuantized), "the bias is not quantized"),
    (_quantizer(_Float32Out), r"returned torch.float32 for a float64 x: the output should be in x's dtype"),
], ids=["lm head left", "a copy returned", "per tensor", "mean", "floor", "truncation", "bias quantized", "float64 in, float32 out"])
def test_int8_model_bugs_get_specific_messages(buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_quantize_model(buggy)


def test_the_int8_model_oracle_is_the_formula():
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.1]]))
    oracle = checks.dequantized_copy(nn.Sequential(layer))
    # by hand: scales 0.01 and 0.02, levels [50, -127, 0] and [127, 50, -5]
    expected = torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.1]], dtype=torch.float64)
    assert oracle[0].weight.dtype == torch.float64 and torch.allclose(oracle[0].weight, expected, rtol=0, atol=1e-6)
    assert torch.equal(oracle[0].bias, layer.bias.double()) and layer.weight.dtype == torch.float32  # the model as it was


# ---- exercise 5: int4 with a scale and a minimum per group


def _int4(weight, group_size, *, groups=None, low=None, steps=15, rounding=torch.round, levels=(0, 15), out=torch.uint8,
          guard=True, check=True):
    """quantize_int4 written out with one knob per classic mistake (the defaults are correct)."""
    if check and group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    if check and weight.shape[1] % group_size:
        raise ValueError(f"weight: in must be a multiple of group_size {group_size}")
    rows, inp = weight.shape
    w = weight.float()
    g = groups(w, group_size) if groups else w.reshape(rows, inp // group_size, group_size)
    minimum = low(g) if low else g.amin(dim=2)
    scale = (g.amax(dim=2) - minimum) / steps
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)) if guard else scale
    q = rounding((g - minimum[..., None]) / divisor[..., None]).clamp(*levels).to(out)
    if groups:  # back to (out, in) the way it was grouped
        q = q.transpose(1, 2) if g.shape[1] == group_size else q
    return q.reshape(rows, inp), scale, minimum


def int4_by_loops(weight, group_size):
    """Group by group in float64, with a float32 scale (a correct alternative)."""
    if group_size not in (32, 64, 128) or weight.shape[1] % group_size:
        raise ValueError(f"group_size {group_size} does not fit weight {tuple(weight.shape)}")
    rows, inp = weight.shape
    q = torch.zeros(rows, inp, dtype=torch.uint8)
    scale, minimum = torch.zeros(rows, inp // group_size), torch.zeros(rows, inp // group_size)
    for r in range(rows):
        for c in range(inp // group_size):
            group = weight[r, c * group_size:(c + 1) * group_size].double()
            low, step = group.min(), ((group.max() - group.min()) / 15).float()
            scale[r, c], minimum[r, c] = step, low
            if step > 0:
                q[r, c * group_size:(c + 1) * group_size] = torch.round((group - low) / step.double()).to(torch.uint8)
    return q, scale, minimum


def int4_per_row(weight, group_size):
    q, scale, minimum = _int4(weight, weight.shape[1], check=False)
    n = weight.shape[1] // group_size
    return q, scale.expand(-1, n).contiguous(), minimum.expand(-1, n).contiguous()


def int4_one_scale_per_row(weight, group_size):
    q, scale, minimum = _int4(weight, weight.shape[1], check=False)
    return q, scale[:, 0], minimum[:, 0]


def int4_symmetric(weight, group_size):
    """llama.cpp's Q4_0: levels -8..7, scale max |w| / 8, no minimum (another scheme than this exercise's)."""
    g = weight.float().reshape(weight.shape[0], -1, group_size)
    scale = g.abs().amax(dim=2) / 8
    q = torch.round(g / torch.where(scale > 0, scale, 1.0)[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(weight.shape), scale, torch.zeros_like(scale)


def int4_in_weight_dtype(weight, group_size):
    """The formula computed in the weight's own dtype (bfloat16: a scale off by its rounding), cast at the end."""
    g = weight.reshape(weight.shape[0], -1, group_size)
    minimum = g.amin(dim=2)
    scale = (g.amax(dim=2) - minimum) / 15
    q = torch.round((g - minimum[..., None]) / torch.where(scale > 0, scale, 1)[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(weight.shape), scale.float(), minimum.float()


def int4_zero_point(weight, group_size):
    """GPTQ's and AWQ's integer zero point, round(-minimum / scale), returned where this contract has the minimum."""
    q, scale, minimum = _int4(weight, group_size)
    return q, scale, torch.round(-minimum / torch.where(scale > 0, scale, 1))


INT4_BUGS = [
    (int4_in_weight_dtype, r"bfloat16 weight, groups of 32\): that is \(max - min\) / 15 computed in torch.bfloat16"),
    (int4_zero_point, r"that is a zero point in levels, round\(-minimum / scale\), as GPTQ and AWQ store it"),
    (int4_one_scale_per_row, r"scale has shape \(6,\) .*: one scale per row\. Each group of 32 consecutive inputs"),
    (int4_per_row, r"every group of a row got the same scale and minimum .*one per row, not per group"),
    (lambda w, gs: _int4(w, gs, rounding=torch.trunc), r"q looks truncated, not rounded .*round first"),
    (int4_symmetric, r"negative levels, as in the symmetric scheme \(llama.cpp's Q4_0: levels -8..7"),
    (lambda w, gs: _int4(w, gs, out=torch.int8), r"q should be uint8 \(torch.uint8\), got torch.int8"),
    (lambda w, gs: _int4(w, gs, low=lambda g: g.abs().amin(dim=2)), r"you took the smallest magnitude, min \|w\|"),
    (lambda w, gs: _int4(w, gs, levels=(0, 16), steps=16.5), r"q\[\d+, \d+\] = 16 .*4 bits hold the levels 0\.\.15 only"),
    (lambda w, gs: _int4(w, gs, steps=16), r"that is \(max - min\) / 16; 16 levels have 15 steps"),
    (lambda w, gs: _int4(w, gs, low=lambda g: -g.abs().amax(dim=2)), r"that is minus the largest \|w\|, a symmetric range"),
    (lambda w, gs: _int4(w, gs, groups=lambda w, n: w.reshape(w.shape[0], n, -1).transpose(1, 2)),
     r"minimum of every 4-th input of the row .*CONSECUTIVE"),
    (lambda w, gs: _int4(w, gs, guard=False), r"group 0 of row 4 spans only 7e-45: its scale \(max - min\) / 15 underflows to 0 in float32"),
    (lambda w, gs: _int4(w, gs, check=False), r"quantize_int4\(weight, 16\) returned without an error"),
    (lambda w, gs: _int4(w, gs, check=False) if gs in (32, 64, 128) else _int4(w, gs),
     r"quantize_int4\(weight \(4, 80\), 32\) raised RuntimeError: .*expected a ValueError"),
    (lambda w, gs: tuple(t.T for t in _int4(w, gs)), r"q \(a \(6, 128\) float32 weight, groups of 32\)"),
    (lambda w, gs: _int4(w, gs)[:2], r"should return a tuple \(q, scale, minimum\)"),
]


def test_the_int4_reference_and_an_alternative_pass(capsys):
    from course_lib.quantize import quantize_int4
    half_away = lambda w, gs: _int4(w, gs, rounding=lambda x: torch.floor(x + 0.5))  # noqa: E731 - ties up, not to even
    non_contiguous = lambda w, gs: tuple(t.T.contiguous().T for t in _int4(w, gs))  # noqa: E731 - column-major results
    for solution in (quantize_int4, int4_by_loops, _int4, half_away, non_contiguous):
        checks.check_quantize_int4(solution)
        assert "quantize_int4: all visible checks passed" in capsys.readouterr().out


@pytest.mark.parametrize("buggy,message", INT4_BUGS, ids=[m[:40] for _, m in INT4_BUGS])
def test_int4_mistakes_get_specific_messages(buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_quantize_int4(buggy)


def test_the_int4_oracle_is_the_formula():
    # a group of 32: 0, 1, ..., 30 and 45: minimum 0, scale 45 / 15 = 3, levels round(i / 3) (ties 1.5, 4.5, ... away)
    weight = torch.cat([torch.arange(31.0), torch.tensor([45.0])])[None, :]
    q, scale, minimum = checks.int4_reference(weight, 32)
    assert scale.tolist() == [[3.0]] and minimum.tolist() == [[0.0]]
    assert q[0, :7].tolist() == [0, 0, 1, 1, 1, 2, 2] and q[0, -1] == 15 and q.dtype == torch.int64
    # a constant group: scale 0, minimum its value, q 0; a negative shift moves the minimum, not the levels
    q, scale, minimum = checks.int4_reference(torch.full((1, 32), -0.5), 32)
    assert (q == 0).all() and scale.item() == 0 and minimum.item() == -0.5
    q2, scale2, minimum2 = checks.int4_reference(weight - 100, 32)
    assert torch.equal(q2, checks.int4_reference(weight, 32)[0]) and minimum2.item() == -100 and scale2.item() == 3
