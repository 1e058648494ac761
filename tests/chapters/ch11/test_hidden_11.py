"""Chapter 11's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top of each
cell), and correct alternative implementations must pass everything. The oracles: float64 formulas,
torch.nn.functional.rms_norm, the row order spelled out index by index (checks.half_rows), and attention scores
under chapter 02's interleaved RoPE (course_lib.positional.apply_rope) against the half layout.
tests/chapters/ch11/test_grading_11.py checks the same on whole notebooks through nbgrader.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.positional import apply_rope, apply_rope_half
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "11-modern-decoder" / "modern_decoder.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "F": F, "checks": checks, "apply_rope": apply_rope, "apply_rope_half": apply_rope_half})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

RMS, SWI, ROPE, KV = "rms_norm", "swiglu", "rope_to_half", "expand_kv_heads"
RMS_LINE = "return x * torch.rsqrt(mean_square + eps) * weight"
GATE, UP = "gate = F.silu(F.linear(x, w_gate))", "up = F.linear(x, w_up)"
DOWN = "return F.linear(gate * up, w_down)"
D_HEAD = "d_head = rows // n_heads"
PERMUTE = "return weight.reshape(n_heads, d_head // 2, 2, columns).transpose(1, 2).reshape(rows, columns)"


def targets(exercise: str, *names: str) -> set[str]:
    return {f"{exercise}-{name}" for name in names}


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
    (ROPE, "correct: an index per head", '''
def rope_to_half(weight, n_heads):
    d = weight.shape[0] // n_heads
    order = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    return torch.cat([weight[h * d:(h + 1) * d][order] for h in range(n_heads)])
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {RMS, SWI, ROPE, KV}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == 3


@pytest.mark.parametrize("exercise", [RMS, SWI, ROPE, KV])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
