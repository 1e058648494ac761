"""Chapter 03's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells are executed in a namespace holding the reference
solutions with ONE planted bug. Every bug must fail exactly the tests documented to target it (the
comment at the top of each cell), and correct alternative implementations must pass everything.
The slower nbgrader round trip (tests/chapters/ch03/test_grading_03.py) checks the same on whole notebooks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import checks
from course_lib.attention import MultiHeadAttention
from course_lib.layers import FeedForward, LayerNorm
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "03-transformer" / "transformer.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "nn": nn, "checks": checks,
                     "MultiHeadAttention": MultiHeadAttention, "FeedForward": FeedForward, "LayerNorm": LayerNorm})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests


LN = "layer_norm"
VAR = "((x - mean) ** 2).mean(dim=-1, keepdim=True)"
SQRT = "torch.sqrt(var + eps)"

LAYER_NORM_LIBRARY_CALLS = '''
def layer_norm(x, weight, bias, eps=1e-5):  # correct: torch.var with correction=0, rsqrt
    mean = x.mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(torch.var(x, dim=-1, correction=0, keepdim=True) + eps) * weight + bias
'''
LAYER_NORM_F = '''
def layer_norm(x, weight, bias, eps=1e-5):  # correct: PyTorch's own
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
'''
MASKS_ALTERNATIVE = '''
def make_padding_mask(tokens, pad_id):  # correct, written differently
    return (tokens != pad_id).unsqueeze(1).unsqueeze(2)


def make_causal_mask(T, device=None):
    i = torch.arange(T, device=device)
    return ~(i[None, :] > i[:, None]).view(1, 1, T, T)


def make_target_mask(tgt, pad_id):
    return torch.logical_and(make_causal_mask(tgt.shape[1]), make_padding_mask(tgt, pad_id))
'''

L = "layers"  # the build exercise: EncoderLayer and DecoderLayer in one answer cell


def in_class(name: str, *replacements: tuple[str, str]) -> str:
    """The layers' reference with each (old, new) replacement applied inside class ``name`` only."""
    code = REFERENCE[L]
    start = code.index(f"class {name}(")
    end = code.find("\nclass ", start + 1) % (len(code) + 1)
    part = code[start:end]
    for old, new in replacements:
        assert old in part, f"the planted bug no longer applies to {name}: {old!r} not found"
        part = part.replace(old, new)
    return code[:start] + part + code[end:]


# (exercise, solution code, the tests it must fail)
CASES = {
    # --- layer norm
    "ln_reference": (LN, REFERENCE[LN], set()),
    "ln_library_calls": (LN, LAYER_NORM_LIBRARY_CALLS, set()),
    "ln_pytorch": (LN, LAYER_NORM_F, set()),
    "ln_unbiased_variance": (LN, mutate(LN, (VAR, "x.var(dim=-1, keepdim=True)")), {"layer_norm-visible", "layer_norm-variance"}),
    "ln_axis_0": (LN, mutate(LN, ("dim=-1", "dim=0")), {"layer_norm-visible", "layer_norm-last_axis"}),
    "ln_global_statistics": (LN, mutate(LN, ("x.mean(dim=-1, keepdim=True)", "x.mean()"), (VAR, "((x - mean) ** 2).mean()")),
                             {"layer_norm-visible", "layer_norm-last_axis"}),
    "ln_eps_outside_sqrt": (LN, mutate(LN, (SQRT, "(torch.sqrt(var) + eps)")), {"layer_norm-visible", "layer_norm-eps"}),
    "ln_no_eps": (LN, mutate(LN, (SQRT, "torch.sqrt(var)")), {"layer_norm-visible", "layer_norm-eps"}),
    "ln_eps_hard_coded": (LN, mutate(LN, (SQRT, "torch.sqrt(var + 1e-5)")), {"layer_norm-eps"}),
    "ln_no_affine": (LN, mutate(LN, (" * weight + bias", "")), {"layer_norm-visible"}),
    # --- masks
    "masks_reference": ("masks", REFERENCE["masks"], set()),
    "masks_alternative": ("masks", MASKS_ALTERNATIVE, set()),
    "causal_without_diagonal": ("masks", mutate("masks", (".tril()", ".tril(-1)")), {"masks-visible", "masks-causal"}),
    "causal_one_step_ahead": ("masks", mutate("masks", (".tril()", ".tril(1)")), {"masks-visible", "masks-causal"}),
    "causal_upper_triangle": ("masks", mutate("masks", (".tril()", ".triu()")), {"masks-visible", "masks-causal"}),
    "padding_not_combined": ("masks", mutate("masks", ("make_padding_mask(tgt, pad_id) & ", "")), {"masks-visible", "masks-combined"}),
    "padding_on_query_axis": ("masks", mutate("masks", ("make_padding_mask(tgt, pad_id) &", "make_padding_mask(tgt, pad_id).transpose(-1, -2) &")),
                              {"masks-visible", "masks-combined"}),
    "pad_id_hard_coded": ("masks", mutate("masks", ("tokens != pad_id", "tokens != 0")),
                          {"masks-visible", "masks-padding"}),  # visible: its left-padded batch with pad_id 3 (issue 24)
    "padding_inverted": ("masks", mutate("masks", ("tokens != pad_id", "tokens == pad_id")), {"masks-visible", "masks-padding"}),
    "padding_on_query_shape": ("masks", mutate("masks", ("[:, None, None, :]", "[:, None, :, None]")), {"masks-visible", "masks-padding"}),
    # --- the build exercise: encoder layer
    "layers_reference": (L, REFERENCE[L], set()),
    "encoder_functional_dropout_done_right": (L, in_class("EncoderLayer", ("self.dropout2(self.ffn(x))", "F.dropout(self.ffn(x), self.dropout2.p, self.training)")), set()),
    "encoder_mask_ignored": (L, in_class("EncoderLayer", ("h, h, h, mask)", "h, h, h)"), ("x, x, x, mask)", "x, x, x)")),
                             {"layers-visible", "layers-encoder_padding", "layers-encoder_pre_ln"}),  # pre_ln has a padding mask
    "encoder_dropout_in_eval": (L, in_class("EncoderLayer", ("self.dropout2(self.ffn(x))", "F.dropout(self.ffn(x), self.dropout2.p)")),
                                {"layers-visible", "layers-encoder_dropout_eval"}),  # visible: since issue 41
    # the visible check compares both arrangements with PyTorch, so pre-LN mistakes fail it too
    "encoder_always_post_ln": (L, in_class("EncoderLayer", ("if self.norm_first:", "if False:")), {"layers-visible", "layers-encoder_pre_ln"}),
    "encoder_arrangements_swapped": (L, in_class("EncoderLayer", ("if self.norm_first:", "if not self.norm_first:")),
                                     {"layers-visible", "layers-encoder_pre_ln"}),
    "encoder_pre_ln_residual_from_normed": (L, in_class("EncoderLayer", ("x = x + self.dropout1(", "x = h + self.dropout1(")),
                                            {"layers-visible", "layers-encoder_pre_ln"}),
    "encoder_post_ln_ffn_without_residual": (L, in_class("EncoderLayer", ("self.norm2(x + self.dropout2(", "self.norm2(0 + self.dropout2(")),
                                             {"layers-visible"}),
    "encoder_extra_parameter": (L, in_class("EncoderLayer", ("self.norm2 = LayerNorm(d_model)",
                                                             "self.norm2 = LayerNorm(d_model)\n        self.scale = nn.Parameter(torch.ones(1))")),
                                {"layers-visible"}),  # the parameter names are the contract
    # --- the build exercise: decoder layer
    "decoder_causal_mask_ignored": (L, in_class("DecoderLayer", ("h, h, h, tgt_mask)", "h, h, h)"), ("x, x, x, tgt_mask)", "x, x, x)")),
                                    {"layers-visible", "layers-causal", "layers-decoder_pre_ln"}),  # pre_ln has a causal mask
    "decoder_memory_mask_ignored": (L, in_class("DecoderLayer", ("memory, memory, memory_mask)", "memory, memory)")),
                                    {"layers-visible", "layers-cross_attention", "layers-decoder_pre_ln"}),  # and a memory mask
    "decoder_cross_attention_on_itself": (L, in_class("DecoderLayer", ("self.cross_attn(self.norm2(x), memory, memory, memory_mask)",
                                                                       "self.cross_attn(self.norm2(x), self.norm2(x), self.norm2(x))"),
                                                      ("self.cross_attn(x, memory, memory, memory_mask)", "self.cross_attn(x, x, x)")),
                                          # unmasked self-attention in the cross slot also sees the future
                                          {"layers-visible", "layers-causal", "layers-cross_attention", "layers-decoder_pre_ln"}),
    "decoder_pre_ln_normalises_memory": (L, in_class("DecoderLayer", ("self.cross_attn(self.norm2(x), memory, memory,",
                                                                      "self.cross_attn(self.norm2(x), self.norm2(memory), self.norm2(memory),")),
                                         {"layers-visible", "layers-decoder_pre_ln"}),  # visible: its pre-LN case
    "decoder_dropout_in_eval": (L, in_class("DecoderLayer", ("self.dropout3(self.ffn(x))", "F.dropout(self.ffn(x), self.dropout3.p)")),
                                {"layers-visible", "layers-decoder_dropout_eval"}),  # visible: since issue 41
    "decoder_always_post_ln": (L, in_class("DecoderLayer", ("if self.norm_first:", "if False:")), {"layers-visible", "layers-decoder_pre_ln"}),
    "decoder_arrangements_swapped": (L, in_class("DecoderLayer", ("if self.norm_first:", "if not self.norm_first:")),
                                     {"layers-visible", "layers-decoder_pre_ln"}),
}


def test_every_test_cell_is_documented_and_every_exercise_is_covered():
    for grade_id, source in CELLS.items():
        if grade_id.endswith("-solution"):
            continue
        first = source.splitlines()[0]
        points = "(2 points)" if grade_id.startswith(f"{L}-") else "(1 point)"  # the build exercise weighs more
        assert first.startswith(f"# Visible test {points}") or first.startswith(f"# Hidden test {points}: "), grade_id
    assert {case[0] for case in CASES.values()} == set(REFERENCE)
    targeted = set().union(*(case[2] for case in CASES.values()))
    assert targeted == {gid for gid in CELLS if not gid.endswith("-solution")}, "every test cell is some bug's target"


@pytest.mark.parametrize("case", list(CASES))
def test_each_bug_fails_exactly_its_tests(case):
    exercise, solution, must_fail = CASES[case]
    assert failing_tests(exercise, solution) == must_fail
