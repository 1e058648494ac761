"""Chapter 02's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release
(zero) and two students with several planted bugs each, one per exercise, chosen so that the tests
each bug must fail are disjoint. The expected failures follow from what each test cell documents
(its first comment line); tests/chapters/ch02/test_hidden_02.py runs the same cells against many more bugs, one
at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.roundtrip import Chapter, round_trip
from tests.planted import ROPE_ROTATE_HALF  # Hugging Face's pairing: a correct RoPE, not this course's

CH = Chapter("02-multihead", "multihead")
MHA, SIN, ROPE, HEADS = ("multi_head_attention-solution", "sinusoidal_encoding-solution", "apply_rope-solution", "heads-solution")


def planted_a() -> dict:
    return CH.solved({
        # scores / sqrt(d_model): the weights are too flat -> visible (vs nn.MultiheadAttention), scale and oracle
        MHA: CH.mutate(MHA, "math.sqrt(self.d_head)", "math.sqrt(self.d_model)"),
        # sin in the odd columns, cos in the even ones -> visible and layout (frequencies compares pairs, unordered)
        SIN: CH.mutate(SIN, "table[:, 0::2] = torch.sin(angle)\n    table[:, 1::2] = torch.cos(angle)",
                       "table[:, 0::2] = torch.cos(angle)\n    table[:, 1::2] = torch.sin(angle)"),
        # positions argument ignored -> visible (it passes explicit positions) and positions
        ROPE: CH.mutate(ROPE, "if positions is None:", "if True:"),
    })


def planted_b() -> dict:
    return CH.solved({
        # merge_heads in (T, B, H, Dh) order, as seq-first code does: right for B = 1, mixes the batch otherwise ->
        # heads-visible and heads-batch only: the module calls merge_heads, but is tested with the reference one
        HEADS: CH.mutate(HEADS, "return x.transpose(1, 2).contiguous().view(batch, time, n_heads * d_head)",
                         "return x.permute(2, 0, 1, 3).reshape(batch, time, n_heads * d_head)"),
        # values projected from `key`: invisible in self-attention -> visible, cross and oracle (their cross-attention cases)
        MHA: CH.mutate(MHA, "self.W_v(value)", "self.W_v(key)"),
        # 10000^(-i/d) instead of 10000^(-2i/d): row 0 is still [0, 1, 0, 1, ...] -> visible and frequencies
        SIN: CH.mutate(SIN, "torch.arange(0, d_model, 2, dtype=torch.float64)", "torch.arange(0, d_model // 2, dtype=torch.float64)"),
        # Hugging Face's rotate_half pairing: still a rotation with the right angles -> visible and pairing
        ROPE: ROPE_ROTATE_HALF,
    })


# student -> (notebook, the tests that must fail)
STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted_a": (planted_a, {"multi_head_attention-visible", "multi_head_attention-scale", "multi_head_attention-oracle",
                              "sinusoidal_encoding-visible", "sinusoidal_encoding-layout", "apply_rope-visible",
                              "apply_rope-positions"}),
    "planted_b": (planted_b, {"heads-visible", "heads-batch", "multi_head_attention-visible", "multi_head_attention-cross",
                              "multi_head_attention-oracle", "sinusoidal_encoding-visible", "sinusoidal_encoding-frequencies",
                              "apply_rope-visible", "apply_rope-pairing"}),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=31)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted_a")
    assert "sin and cos are swapped" in messages["sinusoidal_encoding-visible"]
    assert "expected scale is 1/sqrt(d_head)" in messages["multi_head_attention-visible"]
    messages = roundtrip.messages(graded, CH, "planted_b")
    assert "rotate_half" in messages["apply_rope-visible"]
