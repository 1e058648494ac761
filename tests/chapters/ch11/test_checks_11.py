"""Chapter 11's learner-facing checks: the reference and correct alternatives pass; each classic bug gets a specific message."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks, hf
from course_lib.layers import swiglu
from course_lib.positional import rope_to_half
from tests.helpers import mutant


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


# ----------------------------------------------------------------------------- exercise 5: the conversion both ways


def mutated(function, *replacements):
    """The course_lib.hf function with each (old, new) replacement applied to its source, defined in its module's namespace."""
    return mutant(function, *replacements, namespace=vars(hf))


TO, FROM = hf.llama_to_hf, hf.llama_from_hf
TO_Q, TO_K = "weight = rope_to_half(weight, c.n_head)", "weight = rope_to_half(weight, c.n_kv_head)"
FROM_Q, FROM_K = "weight = rope_to_interleaved(weight, config.n_head)", "weight = rope_to_interleaved(weight, config.n_kv_head)"
V_TOO = ('name.endswith("self_attn.k_proj.weight")', 'name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight"))')


def to_hf_in_place(model):
    """Permutes our model's own W_q and W_k rows in place, then converts it as a half-layout model would be."""
    c = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.copy_(rope_to_half(layer.self_attn.q_proj.weight, c.n_head))
            layer.self_attn.k_proj.weight.copy_(rope_to_half(layer.self_attn.k_proj.weight, c.n_kv_head))
    c.rope_layout = "half"
    try:
        return TO(model)
    finally:
        c.rope_layout = "interleaved"


def test_the_course_conversion_passes_and_each_half_is_judged_with_the_others():
    checks.check_llama_conversion(TO, FROM)


@pytest.mark.parametrize("to_hf,from_hf,message", [
    (mutated(TO, (TO_Q, "weight = weight"), (TO_K, "weight = weight")), FROM,
     r"llama_to_hf copies W_q and W_k without the permutation"),
    (mutated(TO, (TO_K, "weight = weight")), FROM, r"llama_to_hf permutes W_q but not W_k"),
    (mutated(TO, V_TOO), FROM, r"llama_to_hf permutes the rows of W_v too"),
    (mutated(TO, (TO_Q, "weight = rope_to_interleaved(weight, c.n_head)"), (TO_K, "weight = rope_to_interleaved(weight, c.n_kv_head)")),
     FROM, r"llama_to_hf permutes W_q and W_k the wrong way, with rope_to_interleaved"),
    (mutated(TO, (TO_K, "weight = rope_to_half(weight, c.n_head)")), FROM, r"llama_to_hf permutes W_k as if it had n_head = 4 heads"),
    (mutated(TO, ("tie_word_embeddings=False", "tie_word_embeddings=True")), FROM, r"its lm_head is tied to the token embedding"),
    (mutated(TO, ("rms_norm_eps=c.eps,", "")), FROM, r"its rms_norm_eps is 1e-06, the model's eps is 0.001"),
    (mutated(TO, ('rope_parameters={"rope_type": "default", "rope_theta": c.rope_base}, ', "")), FROM, r"its rope_theta is 10000"),
    (mutated(TO, ("if c.window is None:", "if True:")), FROM, r"window = 4 should return a transformers.MistralForCausalLM"),
    (to_hf_in_place, FROM, r"llama_to_hf changed the model it was given"),
    (TO, mutated(FROM, (FROM_Q, "weight = weight"), (FROM_K, "weight = weight")),
     r"llama_from_hf\(hf_model, 'interleaved'\) copies W_q and W_k without the permutation"),
    (TO, mutated(FROM, V_TOO), r"llama_from_hf\(hf_model, 'interleaved'\) permutes the rows of W_v too"),
    (TO, mutated(FROM, (FROM_Q, "weight = rope_to_half(weight, config.n_head)"), (FROM_K, "weight = rope_to_half(weight, config.n_kv_head)")),
     r"llama_from_hf\(hf_model, 'interleaved'\) permutes W_q and W_k the wrong way, with rope_to_half"),
    (TO, mutated(FROM, (FROM_K, "weight = rope_to_interleaved(weight, config.n_head)")),
     r"llama_from_hf\(hf_model, 'interleaved'\) permutes W_k as if it had n_head = 4 heads"),
    (TO, mutated(FROM, ("rope_layout=rope_layout)", "rope_layout=\"half\")")), r"config.rope_layout is 'half', expected 'interleaved'"),
    (TO, mutated(FROM, ("eps=c.rms_norm_eps, ", "")), r"config.eps is 1e-05, expected 0.001, from Hugging Face's rms_norm_eps"),
    (TO, mutated(FROM, ('window=getattr(c, "sliding_window", None)', "window=None")), r"config.window is None, expected 4"),
    (TO, mutated(FROM, ("raise ValueError(", "print(")), r"converted a LlamaForCausalLM with hidden_act='gelu'"),
    (TO, mutated(FROM, (' or getattr(c, "mlp_bias", False)', "")),
     r"with mlp_bias=True raised RuntimeError \(.*\), expected a ValueError naming bias \(our Llama's MLP has no biases\)"),
])
def test_conversion_bugs_get_specific_messages(to_hf, from_hf, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_llama_conversion(to_hf, from_hf)
