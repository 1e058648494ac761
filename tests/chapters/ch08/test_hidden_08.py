"""Chapter 08's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top of each
cell), and correct alternative implementations must pass everything. The hidden tests' oracles are float64
formulas, the bytes of a real model's tensors, and Hugging Face's parameter count of GPT-2 small.
tests/chapters/ch08/test_grading_08.py checks the same on whole notebooks through nbgrader.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import checks
from course_lib.gpt import GPT, GPTConfig, gpt_param_count
from course_lib.quantize import INT4_GROUP_SIZES
from tests.cell_harness import TestCells
from tests.helpers import ROOT, failing

SOURCE = ROOT / "solutions" / "08-memory-bound" / "memory_bound.ipynb"
GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
HARNESS = TestCells(SOURCE, {"copy": copy, "torch": torch, "F": F, "nn": nn, "checks": checks, "GPT": GPT, "GPTConfig": GPTConfig,
                             "GPT2_SMALL": GPT2_SMALL, "gpt_param_count": gpt_param_count, "INT4_GROUP_SIZES": INT4_GROUP_SIZES})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

BYTES, QUANT, DEQUANT, LINEAR, MODEL = "bytes_per_token", "quantize_int8", "dequantize_int8", "int8_linear", "quantize_model"
RETURN = "return (weights * element + batch_size * kv_cache * cache_element) / batch_size"
WEIGHTS = "weights = gpt_param_count(config) - config.block_size * config.n_embd"
KV = "kv_cache = 2 * config.n_layer * context * config.n_embd"
ELEMENT = "element = torch.empty((), dtype=dtype).element_size()"
CACHE_ELEMENT = "cache_element = torch.empty((), dtype=cache_dtype).element_size()"
SCALE = "scale = w.abs().amax(dim=1) / 127"
Q = "q = torch.round(w / divisor[:, None]).clamp(-127, 127).to(torch.int8)"
Y = "y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)"
ADD = "return y if bias is None else y + bias.to(x.dtype)"
FROM = "q, scale = quantize_int8(linear.weight)"
OWN = "w = linear.weight.detach().float()\n        {scale}\n        q = {rounding}(w / scale[:, None]).clamp(-127, 127).to(torch.int8)"
KEEP = "return cls(q, scale, linear.bias)"
WALK = "for module in list(model.modules()):"
FORWARD = "return int8_linear(x, self.q, self.scale, self.bias)"
PLAIN_ATTRIBUTES = (('self.register_buffer("q", q.detach().contiguous())', "self.q = q.detach().contiguous()"),
                    ('self.register_buffer("scale", scale.detach().float())', "self.scale = scale.detach().float()"),
                    ('self.register_buffer("bias", None if bias is None else bias.detach().float())',
                     "self.bias = None if bias is None else bias.detach().float()"))



CASES = [
    # bytes per token
    (BYTES, "the KV cache forgotten", mutate(BYTES, (RETURN, "return weights * element / batch_size")),
     failing(BYTES, "visible", "kv", "gpt2")),
    (BYTES, "keys only: no factor 2", mutate(BYTES, (KV, "kv_cache = config.n_layer * context * config.n_embd")),
     failing(BYTES, "visible", "kv", "gpt2")),
    (BYTES, "per step, not per token", mutate(BYTES, (RETURN, "return weights * element + batch_size * kv_cache * cache_element")),
     failing(BYTES, "visible", "kv", "batch")),
    (BYTES, "one KV cache shared by the batch", mutate(BYTES, (RETURN, "return (weights * element + kv_cache * cache_element) / batch_size")),
     failing(BYTES, "visible", "kv")),
    (BYTES, "the position table counted", mutate(BYTES, (WEIGHTS, "weights = gpt_param_count(config)")),
     failing(BYTES, "visible", "batch", "gpt2")),
    (BYTES, "the tied head counted twice", mutate(BYTES, (WEIGHTS, WEIGHTS + " + config.vocab_size * config.n_embd")),
     failing(BYTES, "visible", "batch", "gpt2")),
    (BYTES, "4 bytes whatever the dtype", mutate(BYTES, (ELEMENT, "element = 4"), (CACHE_ELEMENT, "cache_element = 4")),
     failing(BYTES, "visible", "kv", "gpt2")),
    (BYTES, "the cache in the weights' dtype (int8 beside int8 weights)", mutate(BYTES, (CACHE_ELEMENT, "cache_element = element")),
     failing(BYTES, "visible", "kv", "gpt2")),
    (BYTES, "the cache always float32", mutate(BYTES, (CACHE_ELEMENT, "cache_element = 4")),
     failing(BYTES, "visible", "kv", "gpt2")),
    (BYTES, "correct: weights counted on a meta-device model", '''
def bytes_per_token(config, batch_size, context, dtype=torch.float32, cache_dtype=None):
    with torch.device("meta"):
        model = GPT(config)
    weights = sum(p.numel() for name, p in model.named_parameters() if name != "transformer.wpe.weight")
    per_sequence = 2 * config.n_layer * context * config.n_embd
    bits = torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits
    cache_bits = torch.finfo(cache_dtype or (dtype if dtype.is_floating_point else torch.float32)).bits
    return (weights * bits / batch_size + per_sequence * cache_bits) / 8
''', set()),
    # quantize
    (QUANT, "one scale for the whole tensor", mutate(QUANT, (SCALE, "scale = (w.abs().amax() / 127).expand(w.shape[0]).clone()")),
     failing(QUANT, "visible", "channel", "symmetric", "zero")),
    (QUANT, "truncation instead of rounding", mutate(QUANT, (Q, "q = (w / divisor[:, None]).clamp(-127, 127).to(torch.int8)")),
     failing(QUANT, "visible", "round")),
    (QUANT, "the asymmetric -128: scale max/128, clamp(-128, 127)", mutate(QUANT, (SCALE, "scale = w.abs().amax(dim=1) / 128"),
                                                                          (Q, Q.replace("clamp(-127, 127)", "clamp(-128, 127)"))),
     failing(QUANT, "visible", "channel", "round", "symmetric", "zero")),
    (QUANT, "128 wraps around to -128", mutate(QUANT, (SCALE, "scale = w.abs().amax(dim=1) / 128"),
                                              (Q, Q.replace("clamp(-127, 127)", "clamp(-128, 128)"))),
     failing(QUANT, "visible", "channel", "round", "symmetric", "zero")),
    (QUANT, "division by a zero scale", mutate(QUANT, (Q, "q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)")),
     failing(QUANT, "visible", "zero")),  # the visible check's row of 1.4e-44 (scale 0 in float32) catches it too
    (QUANT, "division by a zero scale, unclamped: NaN and inf cast to int8", mutate(QUANT, (Q, "q = torch.round(w / scale[:, None]).to(torch.int8)")),
     failing(QUANT, "visible")),  # the casts give 0 on this CPU, so q looks right; the visible check sees the cast
    (QUANT, "guarded on all-zero rows, not on zero scales", mutate(QUANT, ("divisor = torch.where(scale > 0,", "divisor = torch.where(w.abs().amax(dim=1) > 0,")),
     failing(QUANT, "visible", "zero")),
    (QUANT, "the scale in bfloat16", mutate(QUANT, ("    return q, scale", "    return q, scale.bfloat16()")),
     failing(QUANT, "visible", "channel", "round", "zero", "dtype")),  # 8 significant bits: the scales are off too
    (QUANT, "the scale in the weight's dtype", mutate(QUANT, ("    return q, scale", "    return q, scale.to(weight.dtype)")),
     failing(QUANT, "visible", "dtype")),
    (QUANT, "one scale per input channel", mutate(QUANT, (SCALE, "scale = w.abs().amax(dim=0) / 127"),
                                                 ("divisor[:, None]", "divisor[None, :]")),
     failing(QUANT, "visible", "channel", "round", "symmetric", "zero")),
    (QUANT, "correct: a row at a time, in float64", '''
def quantize_int8(weight):
    rows, scales = [], []
    for row in weight.double():
        absmax = row.abs().max()
        scale = (absmax / 127).float()
        rows.append(torch.zeros_like(row, dtype=torch.int8) if scale == 0 else torch.round(row / scale.double()).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return torch.stack(rows), torch.stack(scales)
''', set()),
    # dequantize
    (DEQUANT, "the scale on the columns", mutate(DEQUANT, ("return q.float() * scale.float()[:, None]", "return q.float() * scale.float()[None, :]")),
     failing(DEQUANT, "visible", "axis")),
    (DEQUANT, "still int8", mutate(DEQUANT, ("return q.float() * scale.float()[:, None]", "return q * scale[:, None].to(torch.int8)")),
     failing(DEQUANT, "visible", "axis")),
    (DEQUANT, "correct: torch.mul with broadcasting", '''
def dequantize_int8(q, scale):
    return torch.mul(q.to(torch.float32), scale.to(torch.float32).unsqueeze(1))
''', set()),
    # int8 linear
    (LINEAR, "the scale on the inputs", mutate(LINEAR, (Y, "y = F.linear(x * scale.to(x.dtype), q.to(x.dtype))")),
     failing(LINEAR, "visible", "scale", "bias", "shapes")),
    (LINEAR, "the bias scaled too", mutate(LINEAR, (Y, "y = F.linear(x, q.to(x.dtype))"),
                                          (ADD, "return (y if bias is None else y + bias.to(x.dtype)) * scale.to(x.dtype)")),
     failing(LINEAR, "visible", "bias")),
    (LINEAR, "the scale forgotten", mutate(LINEAR, (Y, "y = F.linear(x, q.to(x.dtype))")),
     failing(LINEAR, "visible", "scale", "bias", "shapes")),
    (LINEAR, "always float32", mutate(LINEAR, (Y, "y = F.linear(x.float(), q.float()) * scale.float()")),
     failing(LINEAR, "shapes")),  # the visible test's float64 input has a float64 bias, which promotes the sum back
    (LINEAR, "correct: dequantize, then F.linear", '''
def int8_linear(x, q, scale, bias=None):
    weight = q.to(x.dtype) * scale.to(x.dtype)[:, None]
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
''', set()),


    # the int8 model: Int8Linear and quantize_model
    (MODEL, "one scale for the whole tensor", mutate(MODEL, (FROM, OWN.format(
        scale="scale = (w.abs().max() / 127).expand(w.shape[0]).clone()", rounding="torch.round"))),
     failing(MODEL, "visible", "layer", "model")),
    (MODEL, "the scale from the mean of the row", mutate(MODEL, (FROM, OWN.format(
        scale="scale = w.abs().mean(dim=1) / 127", rounding="torch.round"))),
     failing(MODEL, "visible", "layer", "model")),
    (MODEL, "rounding by floor", mutate(MODEL, (FROM, OWN.format(
        scale="scale = w.abs().amax(dim=1) / 127", rounding="torch.floor"))),
     failing(MODEL, "visible", "layer", "model")),
    (MODEL, "the bias quantized with the weight's scale", mutate(MODEL, (KEEP, "return cls(q, scale, None if linear.bias is None "
                                                                             "else torch.round(linear.bias / scale).clamp(-127, 127) * scale)")),
     failing(MODEL, "visible", "bias")),
    (MODEL, "the LM head left unquantized: the blocks only", mutate(MODEL, (WALK, "for module in list(model.transformer.h.modules()):")),
     failing(MODEL, "visible", "model")),
    (MODEL, "a copy returned, the model left as it is", mutate(MODEL, (WALK, "model = copy.deepcopy(model)\n    " + WALK)),
     failing(MODEL, "visible", "model")),
    (MODEL, "no checks of the arguments", mutate(MODEL, ("raise ValueError(f\"linear must", "pass  # (f\"linear must"),
                                                 ("if not isinstance(model, nn.Module):\n        raise", "if False:\n        raise")),
     failing(MODEL, "errors")),
    (MODEL, "q, scale and bias plain attributes, not buffers", mutate(MODEL, *PLAIN_ATTRIBUTES),
     failing(MODEL, "visible", "layer", "bias")),
    (MODEL, "a float64 input returned as float32", mutate(MODEL, (FORWARD, "return int8_linear(x.float(), self.q, self.scale, self.bias)")),
     failing(MODEL, "visible", "layer")),
    (MODEL, "correct: the weight dequantized in forward, the tree walked by name", '''
class Int8Linear(nn.Module):
    def __init__(self, q, scale, bias=None):
        super().__init__()
        if q.dtype != torch.int8 or q.ndim != 2:
            raise ValueError("q: expected a 2-D int8 tensor")
        if scale.shape != (q.shape[0],):
            raise ValueError("scale: expected shape (out,)")
        if bias is not None and bias.shape != (q.shape[0],):
            raise ValueError("bias: expected shape (out,)")
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(torch.float32))
        self.register_buffer("bias", bias.detach().clone().float() if bias is not None else None)

    @classmethod
    def from_linear(cls, linear):
        if type(linear) is not nn.Linear:
            raise ValueError("linear: expected an nn.Linear")
        return cls(*quantize_int8(linear.weight.data), linear.bias)

    def forward(self, x):
        weight = (self.q.to(x.dtype) * self.scale.to(x.dtype).unsqueeze(1))
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))


def quantize_model(model):
    if not isinstance(model, nn.Module):
        raise ValueError("model: expected an nn.Module")
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Int8Linear.from_linear(getattr(parent, child)))
    return model
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {BYTES, QUANT, DEQUANT, LINEAR, MODEL, "quantize_int4"}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 2


@pytest.mark.parametrize("exercise", [BYTES, QUANT, DEQUANT, LINEAR, MODEL])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


def _hidden_test_message(grade_id: str, solution: str) -> str:
    """The message of the AssertionError that test cell `grade_id` raises for `solution` (ONE planted bug)."""
    namespace = dict(HARNESS.namespace)
    for code in REFERENCE.values():
        exec(code, namespace)  # noqa: S102 - the notebook's own reference code
    exec(solution, namespace)  # noqa: S102
    with pytest.raises(AssertionError) as error:
        exec(CELLS[grade_id], namespace)  # noqa: S102
    return str(error.value)


def test_a_float64_input_returned_as_float32_is_named_by_its_dtype():
    solution = mutate(MODEL, (FORWARD, "return int8_linear(x.float(), self.q, self.scale, self.bias)"))
    assert "a float64 input should give a float64 output (x's dtype), got torch.float32" in _hidden_test_message(
        "quantize_model-layer", solution)


def test_plain_attributes_are_named_with_what_they_lose():
    message = _hidden_test_message("quantize_model-layer", mutate(MODEL, *PLAIN_ATTRIBUTES))
    assert "registered buffers" in message and "state_dict holds []" in message
    with pytest.raises(checks.CheckFailed, match=r"q, scale, bias should be registered buffers .* not in the layer's state_dict"):
        namespace = dict(HARNESS.namespace)
        for code in REFERENCE.values():
            exec(code, namespace)  # noqa: S102
        exec(mutate(MODEL, *PLAIN_ATTRIBUTES), namespace)  # noqa: S102
        checks.check_quantize_model(namespace["quantize_model"])


# ---- exercise 5: int4 with a scale and a minimum per group

INT4 = "quantize_int4"
MIN = "minimum = groups.amin(dim=2)  # (out, groups)"
STEPS = "scale = (groups.amax(dim=2) - minimum) / 15  # 16 levels, 15 steps"
LEVELS = "q = torch.round((groups - minimum[..., None]) / divisor[..., None]).clamp(0, 15).to(torch.uint8)"
GROUPS = "groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)  # consecutive inputs"

INT4_CASES = [
    (INT4, "one scale and minimum per row, repeated for each group", mutate(INT4, (MIN, "minimum = groups.amin(dim=(1, 2))[:, None].expand(-1, groups.shape[1])"),
                                                                          (STEPS, "scale = (groups.amax(dim=(1, 2))[:, None] - minimum) / 15")),
     failing(INT4, "visible", "groups", "levels", "constant")),
    (INT4, "groups of every n-th input", mutate(INT4, (GROUPS, "groups = weight.detach().float().reshape(out_features, group_size, "
                                                        "in_features // group_size).transpose(1, 2)"),
                                               ("return q.reshape(out_features, in_features)", "return q.transpose(1, 2).reshape(out_features, in_features)")),
     failing(INT4, "visible", "groups", "round", "levels", "constant")),
    (INT4, "truncation instead of rounding", mutate(INT4, (LEVELS, LEVELS.replace("torch.round(", "("))),
     failing(INT4, "visible", "round")),
    (INT4, "16 steps: (max - min) / 16, levels 0..16", mutate(INT4, (STEPS, "scale = (groups.amax(dim=2) - minimum) / 16"),
                                                       (LEVELS, LEVELS.replace("clamp(0, 15)", "clamp(0, 16)"))),
     failing(INT4, "visible", "groups", "levels", "constant")),  # the constant test checks an ordinary group's scale too
    (INT4, "the symmetric -8..7 (Q4_0) under this contract", mutate(INT4, (MIN, "minimum = torch.zeros_like(groups[..., 0])"),
                                                                   (STEPS, "scale = groups.abs().amax(dim=2) / 8"),
                                                                   (LEVELS, "q = torch.round(groups / divisor[..., None]).clamp(-8, 7).to(torch.int8)")),
     failing(INT4, "visible", "groups", "round", "levels", "constant")),
    (INT4, "division by a zero scale", mutate(INT4, (LEVELS, LEVELS.replace("/ divisor[", "/ scale["))),
     failing(INT4, "visible", "constant")),
    (INT4, "no check of group_size", mutate(INT4, ("if not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:",
                                                  "if False:"), ("if in_features % group_size:", "if False:")),
     failing(INT4, "visible", "errors")),
    (INT4, "the minimum returned as a zero point in levels, round(-minimum / scale)",
     mutate(INT4, ("return q.reshape(out_features, in_features), scale, minimum",
                   "return q.reshape(out_features, in_features), scale, torch.round(-minimum / divisor)")),
     failing(INT4, "visible", "groups", "round", "constant")),
    (INT4, "computed in the weight's dtype (bfloat16), cast at the end", mutate(INT4, (GROUPS, GROUPS.replace(".float()", "")), (
        "return q.reshape(out_features, in_features), scale, minimum",
        "return q.reshape(out_features, in_features), scale.float(), minimum.float()")),
     failing(INT4, "visible")),  # only the visible test has a bfloat16 weight
    (INT4, "correct: ties rounded away from zero, floor(x + 0.5)",
     mutate(INT4, (LEVELS, LEVELS.replace("torch.round(", "torch.floor(0.5 + "))), set()),
    (INT4, "correct: group by group in float64, scale float32", '''
def quantize_int4(weight, group_size=32):
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size {group_size}: expected 32, 64 or 128")
    if weight.shape[1] % group_size:
        raise ValueError(f"weight: {weight.shape[1]} inputs are not a multiple of group_size {group_size}")
    rows, inp = weight.shape
    q = torch.zeros(rows, inp, dtype=torch.uint8)
    scale, minimum = torch.zeros(rows, inp // group_size), torch.zeros(rows, inp // group_size)
    for r in range(rows):
        for c in range(inp // group_size):
            group = weight[r, c * group_size:(c + 1) * group_size].double()
            step = ((group.max() - group.min()) / 15).float()
            scale[r, c], minimum[r, c] = step, group.min()
            if step > 0:
                q[r, c * group_size:(c + 1) * group_size] = torch.round((group - group.min()) / step.double()).to(torch.uint8)
    return q, scale, minimum
''', set()),
]


def test_the_int4_reference_passes_every_test():
    assert failing_tests(INT4, REFERENCE[INT4]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", INT4_CASES, ids=[f"{c[0]}:{c[1]}" for c in INT4_CASES])
def test_each_int4_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
