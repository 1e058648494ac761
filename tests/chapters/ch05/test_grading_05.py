"""Chapter 05's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release (zero)
and two students with three planted bugs each, one per exercise. The expected failures follow from
what each test cell documents (its first comment line); tests/chapters/ch05/test_hidden_05.py runs the same cells
against more bugs, one at a time and without nbgrader. The exercises are independent: the loop of
exercise 2 (the cache and the loop) runs on course_lib's cached_forward, the formula of exercise 3 on nothing else.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("05-kv-cache", "kv_cache")
STEP, GEN, SIZE = "cached_attention_step-solution", "generate_cached-solution", "kv_cache_bytes-solution"
MASK = "torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(diagonal=P)"
FORMULA = "return 2 * n_layer * batch_size * seq_len * H_kv * head_dim * element"


def planted_a() -> dict:
    return CH.solved({
        # the causal mask dropped: right for one new token, wrong for chunks -> visible, chunk and prefill
        STEP: CH.mutate(STEP, MASK, "torch.ones(T, P + T, dtype=torch.bool)"),
        # the position is never advanced after the first decode step -> visible, positions, padding and hf
        GEN: CH.mutate(GEN, "            position = position + 1\n", ""),
        # H instead of H_kv -> visible (its GQA case) and gqa
        SIZE: CH.mutate(SIZE, "H_kv = n_head if n_kv_head is None else n_kv_head", "H_kv = n_head"),
    })


def planted_b() -> dict:
    return CH.solved({
        # the mask not offset by the cached length: a decode step sees only slot 0 -> visible, decode, chunk and gqa
        STEP: CH.mutate(STEP, ".tril(diagonal=P)", ".tril()"),
        # the cache says it is full one token early (>= max_len) -> visible and full (generate_cached never fills its cache)
        GEN: CH.mutate(GEN, "if self.length + T > self.max_len:", "if self.length + T >= self.max_len:"),
        # keys only, or values only: the factor 2 forgotten -> visible and gpt2large (the other hidden tests are ratios)
        SIZE: CH.mutate(SIZE, FORMULA, FORMULA.replace("2 * ", "")),
    })



# student -> (notebook, the tests that must fail)
STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted_a": (planted_a, failing("cached_attention_step", "visible", "chunk", "prefill") | failing("generate_cached", "visible", "positions", "padding", "hf")
                  | failing("kv_cache_bytes", "visible", "gqa")),
    "planted_b": (planted_b, failing("cached_attention_step", "visible", "decode", "chunk", "gqa")
                  | failing("generate_cached", "visible", "full") | failing("kv_cache_bytes", "visible", "gpt2large")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=25)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted_a")
    assert "Is the causal mask missing?" in messages["cached_attention_step-visible"]
    assert "(do the positions advance with the cache)?" in messages["generate_cached-visible"]
    messages = roundtrip.messages(graded, CH, "planted_b")
    assert "the causal mask not offset by the 4 cached tokens (tril(diagonal=0))" in messages["cached_attention_step-visible"]
    assert "but 3 + 2 tokens fit: the cache is full only when length + T > max_len" in messages["generate_cached-visible"]
    assert "(ratio 0.5;" in messages["kv_cache_bytes-visible"]
