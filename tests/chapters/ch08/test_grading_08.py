"""Chapter 08's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), a correct student who wrote every
exercise another way (`variant`: full marks too), the untouched release (zero) and one student with planted bugs,
one per exercise, whose targeted tests are disjoint:

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



def variant() -> dict:
    """Correct work written another way, which must lose nothing anywhere in the notebook: levels from a float64
    division rounded half away from zero (a tie, or a float32 quotient on the other side of one, rounds the other way
    than the reference's round-half-to-even), scales computed in float64 then stored in float32, x @ W.T by matmul,
    the dequantized weight in Int8Linear's forward, layers found by their dotted names, int4 groups by unflatten."""
    return CH.solved({
        QUANT: CH.mutate(QUANT, """    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (out,): one scale per output channel
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: 0 / 1, not 0 / 0
    q = torch.round(w / divisor[:, None]).clamp(-127, 127).to(torch.int8)  # round, then cast: no truncation
""", """    w = weight.detach().double()
    scale = (w.abs().amax(dim=1) / 127).float()
    ratio = w / scale.double().masked_fill(scale == 0, 1.0).unsqueeze(1)
    q = (ratio.sign() * (ratio.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
"""),
        DEQUANT: CH.mutate(DEQUANT, "return q.float() * scale.float()[:, None]",
                           "return torch.mul(q.to(torch.float32), scale.to(torch.float32).unsqueeze(1))"),
        LINEAR: CH.mutate(LINEAR, """    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)  # (..., out): scale each output channel
    return y if bias is None else y + bias.to(x.dtype)""", """    y = torch.matmul(x, q.t().to(x.dtype)) * scale.to(x.dtype)
    if bias is not None:
        y = torch.add(y, bias.to(x.dtype))
    return y"""),
        MODEL: CH.mutate(MODEL, """        return int8_linear(x, self.q, self.scale, self.bias)""",
                         """        return F.linear(x, dequantize_int8(self.q, self.scale).to(x.dtype),
                        None if self.bias is None else self.bias.to(x.dtype))""").replace(
            """    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))""",
            """    for name, child in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, Int8Linear.from_linear(child))"""),
        INT4: CH.mutate(INT4, """    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)  # consecutive inputs
    minimum = groups.amin(dim=2)  # (out, groups)
    scale = (groups.amax(dim=2) - minimum) / 15  # 16 levels, 15 steps
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: 0 / 1, not 0 / 0
    q = torch.round((groups - minimum[..., None]) / divisor[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scale, minimum""", """    groups = weight.detach().float().unflatten(1, (-1, group_size))
    minimum, maximum = groups.aminmax(dim=-1)
    scale = (maximum - minimum) / 15
    ratio = (groups.double() - minimum.double().unsqueeze(-1)) / scale.double().masked_fill(scale == 0, 1).unsqueeze(-1)
    q = (ratio + 0.5).floor().clamp(0, 15).to(torch.uint8).flatten(1)
    return q, scale, minimum"""),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "variant": (variant, set()),
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
