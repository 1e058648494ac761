"""Chapter 11's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with five planted bugs, one per exercise, whose targeted tests are disjoint:

* rms_norm: eps outside the square root -> the visible test and `eps` (on inputs whose root mean square is
  large next to eps, `mean` cannot tell);
* swiglu: the leading axes flattened into one -> the visible test and `shapes` (the values are right);
* rope_to_half: the inverse permutation -> the visible test, `heads` and `model`;
* expand_kv_heads: the heads tiled instead of grouped -> all three of its tests;
* llama_conversion (the build exercise, 2 points a test): W_k permuted as if it had n_head heads, both ways ->
  the visible test and `logits` (the round trip still closes, and nothing is refused wrongly).

tests/chapters/ch11/test_hidden_11.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("11-modern-decoder", "modern_decoder")
RMS, SWI, ROPE, KV = "rms_norm-solution", "swiglu-solution", "rope_to_half-solution", "expand_kv_heads-solution"
CONV = "llama_conversion-solution"


def planted() -> dict:
    notebook = CH.solved({
        RMS: CH.mutate(RMS, "return x * torch.rsqrt(mean_square + eps) * weight", "return x / (torch.sqrt(mean_square) + eps) * weight"),
        SWI: CH.mutate(SWI, "return F.linear(gate * up, w_down)", "return F.linear(gate * up, w_down).reshape(-1, w_down.shape[0])"),
        ROPE: CH.mutate(ROPE, "return weight.reshape(n_heads, d_head // 2, 2, columns)", "return weight.reshape(n_heads, 2, d_head // 2, columns)"),
        KV: CH.mutate(KV, "return kv.repeat_interleave(n_rep, dim=1)", "return kv.repeat(1, n_rep, 1, 1)"),
        CONV: CH.mutate(CONV, "weight = rope_to_half(weight, c.n_kv_head)", "weight = rope_to_half(weight, c.n_head)").replace(
            "weight = rope_to_interleaved(weight, config.n_kv_head)", "weight = rope_to_interleaved(weight, config.n_head)"),
    })
    return notebook



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("rms_norm", "visible", "eps") | failing("swiglu", "visible", "shapes")
                | failing("rope_to_half", "visible", "heads", "model") | failing("expand_kv_heads", "visible", "groups", "attention")
                | failing("llama_conversion", "visible", "logits")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=20)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "adds eps outside the square root" in messages["rms_norm-visible"]
    assert "applies the inverse permutation" in messages["rope_to_half-visible"]
    assert "tiles the heads" in messages["expand_kv_heads-visible"]
    assert "permutes W_k as if it had n_head = 4 heads" in messages["llama_conversion-visible"]
