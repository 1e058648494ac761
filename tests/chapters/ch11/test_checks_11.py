"""Chapter 11's learner-facing checks: the reference and correct alternatives pass; each classic bug gets a specific message."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.layers import swiglu
from course_lib.positional import rope_to_half


def torch_rms_norm(x, weight, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def divided_by_sqrt(x, weight, eps=1e-5):
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps) * weight


def swiglu_with_modules(x, w_gate, w_up, w_down):
    return F.linear(F.silu(x @ w_gate.T) * (x @ w_up.T), w_down)


def rope_by_index(weight, n_heads):
    d = weight.shape[0] // n_heads
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    return torch.cat([weight[h * d:(h + 1) * d][order] for h in range(n_heads)])


def expand_like_hugging_face(kv, n_rep):  # transformers' repeat_kv
    B, H_kv, T, Dh = kv.shape
    return kv[:, :, None].expand(B, H_kv, n_rep, T, Dh).reshape(B, H_kv * n_rep, T, Dh)


@pytest.mark.parametrize("check,correct", [(checks.check_rms_norm, torch_rms_norm), (checks.check_rms_norm, divided_by_sqrt),
                                           (checks.check_swiglu, swiglu_with_modules), (checks.check_rope_to_half, rope_by_index),
                                           (checks.check_expand_kv_heads, expand_like_hugging_face)])
def test_correct_alternatives_pass(check, correct):
    check(correct)


def tiled(kv, n_rep):
    return kv.repeat(1, n_rep, 1, 1)


def time_axis(kv, n_rep):
    return kv.repeat_interleave(n_rep, dim=2)


def mean_subtracted(x, weight, eps=1e-5):
    x = x - x.mean(-1, keepdim=True)
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps) * weight


def eps_outside(x, weight, eps=1e-5):
    return x / (torch.sqrt((x ** 2).mean(-1, keepdim=True)) + eps) * weight


def no_weight(x, weight, eps=1e-5):
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps)


def no_eps(x, weight, eps=1e-5):
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True)) * weight


def gate_up_swapped(x, w_gate, w_up, w_down):
    return swiglu(x, w_up, w_gate, w_down)


def geglu(x, w_gate, w_up, w_down):
    return F.linear(F.gelu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def glu(x, w_gate, w_up, w_down):
    return F.linear(torch.sigmoid(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def no_up(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)), w_down)


def down_transposed(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down.T)


def silu_on_the_product(x, w_gate, w_up, w_down):
    return F.linear(F.silu(F.linear(x, w_gate) * F.linear(x, w_up)), w_down)


def whole_matrix(weight, n_heads):
    return rope_by_index(weight, 1)


def inverse(weight, n_heads):
    rows, columns = weight.shape
    d = rows // n_heads
    return weight.reshape(n_heads, 2, d // 2, columns).transpose(1, 2).reshape(rows, columns)


def in_place(weight, n_heads):
    weight.copy_(rope_to_half(weight, n_heads))
    return weight


def unchanged(weight, n_heads):
    return weight.clone()


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_rms_norm, mean_subtracted, r"subtracts the mean first: that is LayerNorm"),
    (checks.check_rms_norm, lambda x, w, eps=1e-5: F.layer_norm(x, (x.shape[-1],), w, None, eps),
     r"subtracts the mean first: that is LayerNorm"),
    (checks.check_rms_norm, eps_outside, r"adds eps outside the square root"),
    (checks.check_rms_norm, no_weight, r"ignores weight"),
    (checks.check_rms_norm, no_eps, r"your rms_norm ignores eps"),
    (checks.check_swiglu, lambda x, g, u, d: F.linear(F.silu(F.linear(x, g)) * F.silu(F.linear(x, u)), d), r"SiLU to both projections"),
    (checks.check_swiglu, lambda x, g, u, d: F.linear(F.silu(F.linear(x, g)) + F.linear(x, u), d), r"adds the two projections"),
    (checks.check_swiglu, lambda x, g, u, d: F.linear(F.relu(F.linear(x, g)) * F.linear(x, u), d), r"ReLU on the gate \(that is ReGLU\)"),
    (checks.check_rms_norm, lambda x, w, eps=1e-5: torch_rms_norm(x, 1 + w, eps), r"multiplies by \(1 \+ weight\): that is Gemma's"),
    (checks.check_rms_norm, lambda x, w, eps=1e-5: x / torch.sqrt((x * x).sum(-1, keepdim=True) / (x.shape[-1] - 1) + eps) * w,
     r"divides the sum of squares by n - 1"),
    (checks.check_rms_norm, lambda x, w, eps=1e-5: x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps) * w, r"the Euclidean norm"),
    (checks.check_rms_norm, lambda x, w, eps=1e-5: x / torch.sqrt((x * x).mean(0, keepdim=True) + eps) * w,
     r"the mean of the squares over axis 0: each vector is normalised on its own"),
    (checks.check_swiglu, gate_up_swapped, r"swaps the gate and up projections"),
    (checks.check_swiglu, geglu, r"uses GELU on the gate \(that is GEGLU\)"),
    (checks.check_swiglu, glu, r"uses sigmoid\(a\) on the gate \(that is GLU\)"),
    (checks.check_swiglu, no_up, r"leaves out the up projection"),
    (checks.check_swiglu, down_transposed, r"raised RuntimeError: .*F.linear\(h, w_down\), not w_down itself"),
    (checks.check_swiglu, silu_on_the_product, r"applies SiLU to the product of the two projections"),
    (checks.check_rope_to_half, whole_matrix, r"permutes the rows of the whole matrix as one head"),
    (checks.check_rope_to_half, inverse, r"applies the inverse permutation"),
    (checks.check_rope_to_half, unchanged, r"returns the rows in their old order"),
    (checks.check_rope_to_half, in_place, r"rope_to_half changed the weight it was given: return a new tensor"),
    (checks.check_expand_kv_heads, tiled, r"tiles the heads \(k0 k1 k2 k0 k1 k2\)"),
    (checks.check_expand_kv_heads, time_axis, r"repeats along the time axis"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)
