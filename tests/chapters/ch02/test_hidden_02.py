"""Chapter 02's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells are executed in a namespace holding the reference
solutions with ONE planted bug. Every bug must fail exactly the tests documented to target it (the
comment at the top of each cell), and the correct alternative implementations must pass everything.
The slower nbgrader round trip (tests/chapters/ch02/test_grading_02.py) checks the same on whole notebooks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import checks
from course_lib.attention import masked_softmax
from tests.cell_harness import TestCells
from tests.helpers import ROOT
from tests.planted import ROPE_ROTATE_HALF

SOURCE = ROOT / "solutions" / "02-multihead" / "multihead.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "nn": nn, "checks": checks, "masked_softmax": masked_softmax})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests


SINUSOIDAL_PER_COLUMN_EXPONENT = '''
def sinusoidal_encoding(max_len, d_model):
    table = torch.zeros(max_len, d_model)
    for pos in range(max_len):
        for j in range(d_model):
            angle = pos / 10000 ** (j / d_model)  # exponent from the column index j, not the pair index
            table[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return table
'''
SINUSOIDAL_FLOAT32 = '''
def sinusoidal_encoding(max_len, d_model):  # the Annotated Transformer's version, in float32: correct
    pe = torch.zeros(max_len, d_model)
    position = torch.arange(0, max_len).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe
'''
ROPE_FLOAT32_COMPLEX = '''
def apply_rope(x, positions=None, base=10000.0):  # complex numbers in float32: correct
    if positions is None:
        positions = torch.arange(x.shape[-2])
    theta = 1.0 / base ** (torch.arange(0, x.shape[-1], 2).float() / x.shape[-1])
    rotation = torch.polar(torch.ones(()), positions[..., None].float() * theta)
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * rotation).flatten(-2).to(x.dtype)
'''

MERGE = "return x.transpose(1, 2).contiguous().view(batch, time, n_heads * d_head)"
SPLIT = "return x.view(batch, time, n_heads, d_model // n_heads).transpose(1, 2)"

# exercise, bug name, solution source, the tests it must fail (and why)
CASES = [
    # heads
    ("heads", "split without transpose", mutate("heads", (SPLIT, "return x.reshape(batch, n_heads, time, d_model // n_heads)")),
     {"heads-visible", "heads-split_columns"}),
    ("heads", "merge: view without contiguous", mutate("heads", (".transpose(1, 2).contiguous().view(", ".transpose(1, 2).view(")),
     {"heads-visible", "heads-contiguous"}),  # raises on a fresh tensor only; works on split_heads' layout
    ("heads", "merge without transpose", mutate("heads", (MERGE, "return x.reshape(batch, time, n_heads * d_head)")),
     {"heads-visible", "heads-merge_order"}),
    ("heads", "merge in seq-first order", mutate("heads", (MERGE, "return x.permute(2, 0, 1, 3).reshape(batch, time, n_heads * d_head)")),
     {"heads-visible", "heads-batch"}),  # right for B = 1
    # multi-head attention
    ("multi_head_attention", "unscaled", mutate("multi_head_attention", (" / math.sqrt(self.d_head)", "")),
     {"multi_head_attention-visible", "multi_head_attention-scale", "multi_head_attention-oracle"}),
    ("multi_head_attention", "scaled by sqrt(d_model)", mutate("multi_head_attention", ("math.sqrt(self.d_head)", "math.sqrt(self.d_model)")),
     {"multi_head_attention-visible", "multi_head_attention-scale", "multi_head_attention-oracle"}),
    ("multi_head_attention", "mask inverted", mutate("multi_head_attention", ("masked_softmax(scores, mask)", "masked_softmax(scores, None if mask is None else ~mask)")),
     {"multi_head_attention-visible", "multi_head_attention-mask", "multi_head_attention-fully_masked", "multi_head_attention-oracle"}),  # visible: its padding-mask case; the fully masked query then sees every key
    ("multi_head_attention", "mask ignored", mutate("multi_head_attention", ("masked_softmax(scores, mask)", "masked_softmax(scores)")),
     {"multi_head_attention-visible", "multi_head_attention-mask", "multi_head_attention-fully_masked", "multi_head_attention-oracle"}),  # visible: its padding-mask case
    ("multi_head_attention", "-inf softmax", mutate("multi_head_attention", ("masked_softmax(scores, mask)",
                                                                          'torch.softmax(scores if mask is None else scores.masked_fill(~mask, float("-inf")), dim=-1)')),
     {"multi_head_attention-visible", "multi_head_attention-fully_masked"}),  # visible: its query with no key (issue 24)
    ("multi_head_attention", "values from key", mutate("multi_head_attention", ("self.W_v(value)", "self.W_v(key)")),
     {"multi_head_attention-visible", "multi_head_attention-cross", "multi_head_attention-oracle"}),  # visible and oracle: their cross-attention case (self-attention passes key is value)
    ("multi_head_attention", "keys and values from query", mutate("multi_head_attention", ("self.W_k(key)", "self.W_k(query)"), ("self.W_v(value)", "self.W_v(query)")),
     {"multi_head_attention-visible", "multi_head_attention-cross", "multi_head_attention-oracle", "multi_head_attention-permutation"}),
    # visible, oracle, permutation: their cross-attention cases (Tq != Tk: the scores cannot broadcast)
    ("multi_head_attention", "heads mixed across batch", mutate("multi_head_attention", (
        "heads = self.dropout(weights) @ v",
        "heads = (self.dropout(weights) @ v).flatten(0, 1).unflatten(0, (v.shape[1], v.shape[0])).transpose(0, 1)")),
     {"multi_head_attention-visible", "multi_head_attention-batch", "multi_head_attention-oracle"}),  # B = 2 there; the other tests use B = 1
    # the bugs of the build exercise (issue 32); the oracle test compares everything with nn.MultiheadAttention, so fails them all
    ("multi_head_attention", "heads merged by view, no transpose", mutate("multi_head_attention", (
        "self.W_o(merge_heads(heads))", "self.W_o(heads.view(query.shape[0], query.shape[1], self.d_model))")),
     {"multi_head_attention-visible", "multi_head_attention-cross", "multi_head_attention-fully_masked",
      "multi_head_attention-oracle", "multi_head_attention-permutation"}),  # positions mixed: permutation, and query 1's zero row spread
    ("multi_head_attention", "mask applied after softmax", mutate("multi_head_attention", (
        "masked_softmax(scores, mask)", "torch.softmax(scores, dim=-1) if mask is None else torch.softmax(scores, dim=-1) * mask")),
     {"multi_head_attention-visible", "multi_head_attention-mask", "multi_head_attention-oracle"}),  # a fully masked row is still 0
    ("multi_head_attention", "output projection forgotten", mutate("multi_head_attention", (
        "return self.W_o(merge_heads(heads)), weights", "return merge_heads(heads), weights")),
     {"multi_head_attention-visible", "multi_head_attention-cross", "multi_head_attention-fully_masked",
      "multi_head_attention-oracle"}),  # the weights are right: scale, mask, batch and permutation pass
    ("multi_head_attention", "k and v projections swapped", mutate("multi_head_attention", ("self.W_k(key)", "self.W_v(key)"),
                                                                   ("self.W_v(value)", "self.W_k(value)")),
     {"multi_head_attention-visible", "multi_head_attention-scale", "multi_head_attention-cross", "multi_head_attention-oracle"}),
    # issue 41: a module that always builds its biases (4,224 parameters for D = 32 instead of 4 D^2 = 4,096)
    ("multi_head_attention", "bias=False ignored", mutate("multi_head_attention", *[
        (f"self.{name} = nn.Linear(d_model, d_model, bias=bias)", f"self.{name} = nn.Linear(d_model, d_model)")
        for name in ("W_q", "W_k", "W_v", "W_o")]),
     {"multi_head_attention-visible", "multi_head_attention-oracle"}),
    # issue 41: weights averaged over the heads cost the tests that grade the per-head shape, not the scale, mask, ... ones
    ("multi_head_attention", "weights averaged over the heads", mutate("multi_head_attention", (
        "return self.W_o(merge_heads(heads)), weights", "return self.W_o(merge_heads(heads)), weights.mean(1)")),
     {"multi_head_attention-visible", "multi_head_attention-cross", "multi_head_attention-oracle"}),  # cross: its output is read head by head
    ("multi_head_attention", "weights averaged over the heads, the head axis kept", mutate("multi_head_attention", (
        "return self.W_o(merge_heads(heads)), weights", "return self.W_o(merge_heads(heads)), weights.mean(1, keepdim=True)")),
     {"multi_head_attention-visible", "multi_head_attention-cross", "multi_head_attention-oracle"}),  # not the scale test either
    ("multi_head_attention", "no ValueError for d_model % n_heads", mutate("multi_head_attention", (
        "if d_model % n_heads != 0:", "if False:"),
        ("self.d_head = d_model, n_heads, d_model // n_heads", "self.d_head = d_model, n_heads, math.ceil(d_model / n_heads)")),
     {"multi_head_attention-visible", "multi_head_attention-errors"}),
    # sinusoidal
    ("sinusoidal_encoding", "sin and cos swapped", mutate("sinusoidal_encoding", ("torch.sin(angle)", "SIN"), ("torch.cos(angle)", "torch.sin(angle)"), ("SIN", "torch.cos(angle)")),
     {"sinusoidal_encoding-visible", "sinusoidal_encoding-layout"}),
    ("sinusoidal_encoding", "all sines first", mutate("sinusoidal_encoding", ("table[:, 0::2]", "table[:, : d_model // 2]"), ("table[:, 1::2]", "table[:, d_model // 2:]")),
     {"sinusoidal_encoding-visible", "sinusoidal_encoding-layout", "sinusoidal_encoding-frequencies"}),  # a different frequency per column too
    ("sinusoidal_encoding", "exponent i/d", mutate("sinusoidal_encoding", ("torch.arange(0, d_model, 2, dtype=torch.float64)", "torch.arange(0, d_model // 2, dtype=torch.float64)")),
     {"sinusoidal_encoding-visible", "sinusoidal_encoding-frequencies"}),
    ("sinusoidal_encoding", "exponent from the column index", SINUSOIDAL_PER_COLUMN_EXPONENT,
     {"sinusoidal_encoding-visible", "sinusoidal_encoding-frequencies"}),
    ("sinusoidal_encoding", "correct, in float32", SINUSOIDAL_FLOAT32, set()),
    # RoPE
    ("apply_rope", "rotate_half pairing", ROPE_ROTATE_HALF, {"apply_rope-visible", "apply_rope-pairing"}),
    ("apply_rope", "not a rotation (missing minus)", mutate("apply_rope", ("even * cos - odd * sin", "even * cos + odd * sin")),
     {"apply_rope-visible", "apply_rope-relative"}),
    ("apply_rope", "clockwise", mutate("apply_rope", ("(even * cos - odd * sin, even * sin + odd * cos)", "(even * cos + odd * sin, -even * sin + odd * cos)")),
     {"apply_rope-visible"}),  # a consistent rotation by -p*theta: only the formula itself tells
    ("apply_rope", "frequencies base^(-i/Dh)", mutate("apply_rope", ("torch.arange(0, d_head, 2, dtype", "torch.arange(0, d_head // 2, dtype")),
     {"apply_rope-visible", "apply_rope-frequencies"}),
    ("apply_rope", "base ignored", mutate("apply_rope", ("theta = base **", "theta = 10000.0 **")),
     {"apply_rope-visible", "apply_rope-frequencies"}),  # visible: its base=100 case (issue 24)
    ("apply_rope", "positions ignored", mutate("apply_rope", ("if positions is None:", "if True:")),
     {"apply_rope-visible", "apply_rope-positions"}),
    ("apply_rope", "positions (T,) only", mutate("apply_rope", ("positions.to(torch.float64)[..., None]", "positions.to(torch.float64)[:, None]")),
     {"apply_rope-visible", "apply_rope-positions"}),  # visible: its (B, 1, T) positions (issue 24)
    ("apply_rope", "correct, complex float32", ROPE_FLOAT32_COMPLEX, set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {"heads", "multi_head_attention", "sinusoidal_encoding", "apply_rope"}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 3


@pytest.mark.parametrize("exercise", list(REFERENCE))
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
