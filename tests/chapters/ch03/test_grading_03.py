"""Chapter 03's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release
(zero) and two students with one planted bug in every exercise, chosen so that the tests each bug
must fail are disjoint. Why each bug fails exactly those tests follows from what each test cell
documents (its first comment line); tests/chapters/ch03/test_hidden_03.py runs the same cells against many more
bugs, one at a time and without nbgrader.

The notebook's later cells use the learner's functions and layers only once they pass their visible
checks (course_lib's otherwise), so a bug in one exercise cannot cost points in another.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.roundtrip import Chapter, round_trip

CH = Chapter("03-transformer", "transformer")
LN, MASKS, LAYERS = "layer_norm-solution", "masks-solution", "layers-solution"  # layers: the build exercise, both classes


def planted_a() -> dict:
    return CH.solved({
        # torch.var's default divides by D - 1 -> the visible check and the variance test (eps = 0, short vectors);
        # the eps test uses variances far below eps, where the divisor does not matter
        LN: CH.mutate(LN, "((x - mean) ** 2).mean(dim=-1, keepdim=True)", "x.var(dim=-1, keepdim=True)"),
        # causal mask without its diagonal (off by one) -> visible and causal; the combined test compares the
        # target mask with the learner's own padding & causal masks, so it still passes
        MASKS: CH.mutate(MASKS, ".tril()", ".tril(-1)"),
        # the encoder's padding mask never reaches self-attention -> visible, encoder_padding and encoder_pre_ln (all
        # with padding); encoder_dropout_eval uses no mask, and the decoder is untouched
        LAYERS: CH.mutate(LAYERS, "h, h, h, mask)", "h, h, h)").replace("x, x, x, mask)", "x, x, x)"),
    })


def planted_b() -> dict:
    return CH.solved({
        # statistics over axis 0 -> visible and last_axis; the variance and eps tests use 1-D vectors, where axis 0 is the last
        LN: CH.mutate(LN, "dim=-1", "dim=0"),
        # the decoder mask forgets the padding -> visible and combined
        MASKS: CH.mutate(MASKS, "make_padding_mask(tgt, pad_id) & ", ""),
        # the decoder's cross-attention without the source padding mask -> visible, cross_attention and decoder_pre_ln
        # (all with a memory mask); causal uses none, and the encoder is untouched
        LAYERS: CH.mutate(LAYERS, "memory, memory, memory_mask)", "memory, memory)"),
    })


# student -> (notebook, the tests that must fail)
STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted_a": (planted_a, {"layer_norm-visible", "layer_norm-variance", "masks-visible", "masks-causal",
                              "layers-visible", "layers-encoder_padding", "layers-encoder_pre_ln"}),
    "planted_b": (planted_b, {"layer_norm-visible", "layer_norm-last_axis", "masks-visible", "masks-combined",
                              "layers-visible", "layers-cross_attention", "layers-decoder_pre_ln"}),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=24)  # 4 + 4 + the build exercise's 8 test cells at 2 points  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted_a")
    assert "you divided by D - 1" in messages["layer_norm-visible"]
    assert "the diagonal is False" in messages["masks-visible"]
    assert "same output with and without the padding mask" in messages["layers-visible"]
    messages = roundtrip.messages(graded, CH, "planted_b")
    assert "combine the padding mask and the causal mask with &" in messages["masks-visible"]
    assert "normalise each vector over the last axis" in messages["layer_norm-visible"]
    assert "ignores memory_mask" in messages["layers-visible"]
