"""Chapter 11's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top of each
cell), and correct alternative implementations must pass everything. The oracles: float64 formulas,
torch.nn.functional.rms_norm, the row order spelled out index by index (checks.half_rows), attention scores
under chapter 02's interleaved RoPE (course_lib.positional.apply_rope) against the half layout, and (exercise 5,
the conversion) Hugging Face's LlamaForCausalLM and MistralForCausalLM built from their own configurations.
tests/chapters/ch11/test_grading_11.py checks the same on whole notebooks through nbgrader.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from course_lib import checks
from course_lib.llama import Llama, LlamaConfig
from course_lib.positional import apply_rope, apply_rope_half, rope_to_interleaved
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "11-modern-decoder" / "modern_decoder.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "F": F, "checks": checks, "apply_rope": apply_rope, "apply_rope_half": apply_rope_half,
                             "transformers": transformers, "Llama": Llama, "LlamaConfig": LlamaConfig,
                             "rope_to_interleaved": rope_to_interleaved})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

RMS, SWI, ROPE, KV, CONV = "rms_norm", "swiglu", "rope_to_half", "expand_kv_heads", "llama_conversion"
RMS_LINE = "return x * torch.rsqrt(mean_square + eps) * weight"
GATE, UP = "gate = F.silu(F.linear(x, w_gate))", "up = F.linear(x, w_up)"
DOWN = "return F.linear(gate * up, w_down)"
D_HEAD = "d_head = rows // n_heads"
PERMUTE = "return weight.reshape(n_heads, d_head // 2, 2, columns).transpose(1, 2).reshape(rows, columns)"
TO_Q, TO_K = "weight = rope_to_half(weight, c.n_head)", "weight = rope_to_half(weight, c.n_kv_head)"
FROM_Q, FROM_K = "weight = rope_to_interleaved(weight, config.n_head)", "weight = rope_to_interleaved(weight, config.n_kv_head)"
K_NAME = 'name.endswith("self_attn.k_proj.weight")'
CONVERSION_BY_COPY = """
def _half_order(heads, d):
    return torch.cat([h * d + torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2))) for h in range(heads)])


def llama_to_hf(model):
    import transformers
    c = model.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                  max_position_embeddings=c.block_size, rms_norm_eps=c.eps, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": c.rope_base})
    hf = (transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=c.window, **common)) if c.window
          else transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)))
    theirs = hf.state_dict()
    with torch.no_grad():
        for name, w in model.state_dict().items():
            heads = c.n_head if "q_proj" in name else c.n_kv_head if "k_proj" in name else 0
            theirs[name].copy_(w[_half_order(heads, c.head_dim)] if heads and c.rope_layout == "interleaved" else w)
    return hf.eval()


def llama_from_hf(hf_model, rope_layout="half"):
    c = hf_model.config
    rope = dict(c.rope_parameters)
    problems = {"rope_type": rope["rope_type"] != "default", "hidden_act": c.hidden_act != "silu",
                "bias": bool(getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)),
                "head_dim": c.head_dim * c.num_attention_heads != c.hidden_size}
    for setting, bad in problems.items():
        if bad:
            raise ValueError(f"cannot convert: {setting}")
    model = Llama(LlamaConfig(c.vocab_size, c.max_position_embeddings, c.num_hidden_layers, c.num_attention_heads,
                              c.hidden_size, c.num_key_value_heads, c.intermediate_size, rope["rope_theta"], c.rms_norm_eps,
                              getattr(c, "sliding_window", None), rope_layout))
    ours = model.state_dict()
    with torch.no_grad():
        for name, w in hf_model.state_dict().items():
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads if "k_proj" in name else 0
            if heads and rope_layout == "interleaved":
                ours[name][_half_order(heads, c.head_dim)] = w  # the half layout's rows go back to their places
            else:
                ours[name].copy_(w)
    return model.eval()
"""


def targets(exercise: str, *names: str) -> set[str]:
    return {f"{exercise}-{name}" for name in names}


MLP_BIAS_UNCHECKED = (' or getattr(c, "mlp_bias", False)', "")

CASES = [
    # RMSNorm
    (RMS, "eps outside the square root", mutate(RMS, (RMS_LINE, "return x / (torch.sqrt(mean_square) + eps) * weight")),
     targets(RMS, "visible", "eps")),
    (RMS, "no eps", mutate(RMS, (RMS_LINE, "return x * torch.rsqrt(mean_square) * weight")), targets(RMS, "visible", "eps")),
    (RMS, "mean subtracted (LayerNorm without bias)",
     mutate(RMS, ("mean_square = x.pow(2)", "x = x - x.mean(dim=-1, keepdim=True)\n    mean_square = x.pow(2)")),
     targets(RMS, "visible", "eps", "mean")),
    (RMS, "correct: divided by sqrt", mutate(RMS, (RMS_LINE, "return x / torch.sqrt(mean_square + eps) * weight")), set()),
    (RMS, "correct: F.rms_norm", '''
def rms_norm(x, weight, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
''', set()),
    # SwiGLU
    (SWI, "gate and up projections swapped", mutate(SWI, (GATE, "gate = F.silu(F.linear(x, w_up))"), (UP, "up = F.linear(x, w_gate)")),
     targets(SWI, "visible", "gate")),
    (SWI, "GELU on the gate (GEGLU)", mutate(SWI, (GATE, "gate = F.gelu(F.linear(x, w_gate))")), targets(SWI, "visible", "gate")),
    (SWI, "leading axes flattened", mutate(SWI, (DOWN, "return F.linear(gate * up, w_down).reshape(-1, w_down.shape[0])")),
     targets(SWI, "visible", "shapes")),
    (SWI, "w_down transposed (works only when F == C)", mutate(SWI, (DOWN, "return F.linear(gate * up, w_down.T)")),
     targets(SWI, "visible", "gate", "shapes")),
    (SWI, "correct: matrix products", '''
def swiglu(x, w_gate, w_up, w_down):
    a = x @ w_gate.T
    return (a * torch.sigmoid(a) * (x @ w_up.T)) @ w_down.T
''', set()),
    # RoPE permutation
    (ROPE, "the inverse permutation", mutate(ROPE, (PERMUTE, "return weight.reshape(n_heads, 2, d_head // 2, columns).transpose(1, 2).reshape(rows, columns)")),
     targets(ROPE, "visible", "heads", "model")),
    (ROPE, "the whole matrix as one head", mutate(ROPE, (D_HEAD, "d_head, n_heads = rows, 1")), targets(ROPE, "visible", "heads", "model")),
    (ROPE, "no permutation", mutate(ROPE, (PERMUTE, "return weight.clone()")), targets(ROPE, "visible", "heads", "model")),
    # grouped-query heads
    (KV, "tiled instead of grouped", mutate(KV, ("return kv.repeat_interleave(n_rep, dim=1)", "return kv.repeat(1, n_rep, 1, 1)")),
     targets(KV, "visible", "groups", "attention")),
    (KV, "repeated along the time axis", mutate(KV, ("return kv.repeat_interleave(n_rep, dim=1)", "return kv.repeat_interleave(n_rep, dim=2)")),
     targets(KV, "visible", "groups", "attention")),
    (KV, "correct: Hugging Face's repeat_kv", """
def expand_kv_heads(kv, n_rep):
    B, H_kv, T, Dh = kv.shape
    return kv[:, :, None].expand(B, H_kv, n_rep, T, Dh).reshape(B, H_kv * n_rep, T, Dh)
""", set()),
    # the conversion both ways, the build exercise
    (CONV, "W_q and W_k not permuted on the way to Hugging Face", mutate(CONV, (TO_Q, "weight = weight"), (TO_K, "weight = weight")),
     targets(CONV, "visible", "logits", "roundtrip")),
    (CONV, "no permutation either way", mutate(CONV, (TO_Q, "weight = weight"), (TO_K, "weight = weight"), (FROM_Q, "weight = weight"),
                                                (FROM_K, "weight = weight")), targets(CONV, "visible", "logits")),
    (CONV, "W_v permuted too, both ways", mutate(CONV, (K_NAME, 'name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight"))')),
     targets(CONV, "visible", "logits")),
    (CONV, "W_k permuted with n_head heads, both ways", mutate(CONV, (TO_K, "weight = rope_to_half(weight, c.n_head)"),
                                                               (FROM_K, "weight = rope_to_interleaved(weight, config.n_head)")),
     targets(CONV, "visible", "logits")),
    (CONV, "the head tied to the embedding", mutate(CONV, ("tie_word_embeddings=False", "tie_word_embeddings=True")),
     targets(CONV, "visible", "logits", "roundtrip")),
    (CONV, "eps dropped both ways (each library's default)", mutate(CONV, ("rms_norm_eps=c.eps,", ""), ("eps=c.rms_norm_eps, ", "")),
     targets(CONV, "visible", "logits", "roundtrip")),
    (CONV, "rope_theta dropped both ways", mutate(CONV, ('rope_parameters={"rope_type": "default", "rope_theta": c.rope_base}, ', ""),
                                                   ('rope_base=float(c.rope_parameters["rope_theta"]),', "")),
     targets(CONV, "visible", "logits", "roundtrip")),
    (CONV, "the window ignored (always Llama, no window back)", mutate(CONV, ("if c.window is None:", "if True:"),
                                                                         ('window=getattr(c, "sliding_window", None)', "window=None")),
     targets(CONV, "visible", "logits", "roundtrip")),
    (CONV, "nothing refused", mutate(CONV, ("raise ValueError(", "print(")), targets(CONV, "visible", "errors")),
    (CONV, "MLP biases not refused", mutate(CONV, MLP_BIAS_UNCHECKED), targets(CONV, "visible", "errors")),
    (CONV, "the inverse permutation both ways", mutate(CONV, (TO_Q, "weight = rope_to_interleaved(weight, c.n_head)"),
                                                        (TO_K, "weight = rope_to_interleaved(weight, c.n_kv_head)"),
                                                        (FROM_Q, "weight = rope_to_half(weight, config.n_head)"),
                                                        (FROM_K, "weight = rope_to_half(weight, config.n_kv_head)")),
     targets(CONV, "visible", "logits")),
    (CONV, "correct: copied into Hugging Face's tensors, rows by index", CONVERSION_BY_COPY, set()),
    (ROPE, "correct: an index per head", '''
def rope_to_half(weight, n_heads):
    d = weight.shape[0] // n_heads
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    return torch.cat([weight[h * d:(h + 1) * d][order] for h in range(n_heads)])
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {RMS, SWI, ROPE, KV, CONV}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == (4 if exercise == CONV else 3)


@pytest.mark.parametrize("exercise", [RMS, SWI, ROPE, KV, CONV])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


def test_a_refusal_that_is_not_a_valueerror_says_one_was_expected():
    """llama_from_hf without the mlp_bias check fails later, in load_state_dict (a RuntimeError): the hidden test says
    which error was expected, not only the learner's raw one."""
    namespace = dict(HARNESS.namespace)
    for code in REFERENCE.values():
        exec(code, namespace)  # noqa: S102 - the notebook's own reference code
    exec(mutate(CONV, MLP_BIAS_UNCHECKED), namespace)  # noqa: S102
    with pytest.raises(AssertionError, match=r"mlp_bias.*expected a ValueError naming 'bias' .* got RuntimeError"):
        exec(CELLS["llama_conversion-errors"], namespace)  # noqa: S102
