"""Chapter 08's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades three students: the reference (full marks), the untouched release
(zero) and one student with four planted bugs, one per exercise, whose targeted tests are disjoint:

* bytes_per_token: one KV cache shared by the whole batch -> the visible test and `kv`;
* quantize_int8: a division by the scale even where it is 0 -> the visible test and `zero` (an exact zero row
  happens to give q = 0, since NaN casts to int8 as 0 here; a row whose scale underflows to 0 does not);
* dequantize_int8: the scale along the columns -> the visible test and `axis`;
* int8_linear: the bias multiplied by the scale too -> the visible test and `bias`;
* quantize_model: the LM head left unquantized (the blocks only) -> the visible test and `model`;
* quantize_int4: a division by the scale even where it is 0 -> the visible test and `constant` (a group spanning
  7e-45, whose float32 scale underflows to 0, gets level 15 from 7e-45 / 0 = inf).

tests/chapters/ch08/test_hidden_08.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("08-memory-bound", "memory_bound")
BYTES, QUANT, DEQUANT, LINEAR, MODEL = ("bytes_per_token-solution", "quantize_int8-solution", "dequantize_int8-solution",
                                        "int8_linear-solution", "quantize_model-solution")
INT4 = "quantize_int4-solution"


def planted() -> dict:
    return CH.solved({
        BYTES: CH.mutate(BYTES, "return (weights * element + batch_size * kv_cache * cache_element) / batch_size",
                         "return (weights * element + kv_cache * cache_element) / batch_size"),
        QUANT: CH.mutate(QUANT, "q = torch.round(w / divisor[:, None])", "q = torch.round(w / scale[:, None])"),
        DEQUANT: CH.mutate(DEQUANT, "scale.float()[:, None]", "scale.float()[None, :]"),
        LINEAR: CH.mutate(LINEAR, "return y if bias is None else y + bias.to(x.dtype)",
                          "return (y if bias is None else y + bias.to(x.dtype)) * scale.to(x.dtype)").replace(
            "y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)", "y = F.linear(x, q.to(x.dtype))"),
        MODEL: CH.mutate(MODEL, "for module in list(model.modules()):", "for module in list(model.transformer.h.modules()):"),
        INT4: CH.mutate(INT4, "/ divisor[..., None])", "/ scale[..., None])"),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("bytes_per_token", "visible", "kv") | failing("quantize_int8", "visible", "zero")
                | failing("dequantize_int8", "visible", "axis") | failing("int8_linear", "visible", "bias")
                | failing("quantize_model", "visible", "model") | failing("quantize_int4", "visible", "constant")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=31)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "underflows to 0" in messages["quantize_int8-zero"]
    assert "a division by a zero scale" in messages["quantize_int8-visible"]
    assert "you multiplied the bias by the scale too" in messages["int8_linear-visible"]
    assert "left 1 of the 9 nn.Linear layers unquantized: lm_head" in messages["quantize_model-visible"]
    assert "underflows to 0 in float32" in messages["quantize_int4-visible"]
    assert "got scale 0.0, levels [0, 15]" in messages["quantize_int4-constant"]
