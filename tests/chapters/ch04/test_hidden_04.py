"""Chapter 04's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells are executed in a namespace holding the reference
solutions with ONE planted bug. Every bug must fail exactly the tests documented to target it (the
comment at the top of each cell), and correct alternative implementations must pass everything.
The slower nbgrader round trip (tests/chapters/ch04/test_grading_04.py) checks the same on whole notebooks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import checks
from course_lib.attention import masked_softmax
from course_lib.gpt import GPTConfig
from tests.cell_harness import TestCells
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread, as in the notebook

SOURCE = ROOT / "solutions" / "04-gpt" / "gpt.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "nn": nn, "checks": checks, "masked_softmax": masked_softmax,
                             "GPTConfig": GPTConfig})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

ATT, GPT, CNT = "causal_self_attention", "gpt", "gpt_param_count"
MASKED = "masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), causal)"
SPLIT = "t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)"
MERGE = "y.transpose(1, 2).contiguous().view(B, T, C)"
TIE = "self.lm_head.weight = self.transformer.wte.weight"
LOSS = "F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)"
HEAD = "self.lm_head(self.transformer.ln_f(x))"

CASES = [
    # causal self-attention: the mask
    (ATT, "mask built but not applied", mutate(ATT, (MASKED, MASKED.replace(", causal)", ")"))),
     {f"{ATT}-visible", f"{ATT}-future", f"{ATT}-heads"}),
    (ATT, "mask shifted down: diagonal left out", mutate(ATT, (".tril()", ".tril(-1)")),
     {f"{ATT}-visible", f"{ATT}-self", f"{ATT}-heads"}),  # no leak; token 0 has nothing to attend to
    (ATT, "mask shifted up: sees the next token", mutate(ATT, (".tril()", ".tril(1)")),
     {f"{ATT}-visible", f"{ATT}-future", f"{ATT}-heads"}),  # a one-token sequence is unaffected
    (ATT, "triu instead of tril", mutate(ATT, (".tril()", ".triu()")),
     {f"{ATT}-visible", f"{ATT}-future", f"{ATT}-heads"}),
    (ATT, "mask inverted", mutate(ATT, (MASKED, MASKED.replace(", causal)", ", ~causal)"))),
     {f"{ATT}-visible", f"{ATT}-future", f"{ATT}-self", f"{ATT}-heads"}),
    (ATT, "scaled by sqrt(C)", mutate(ATT, ("math.sqrt(C // self.n_head)", "math.sqrt(C)")),
     {f"{ATT}-visible", f"{ATT}-heads"}),  # still causal, and exact for one token
    (ATT, "not scaled", mutate(ATT, (" / math.sqrt(C // self.n_head)", "")), {f"{ATT}-visible", f"{ATT}-heads"}),
    (ATT, "heads split without transpose", mutate(ATT, (SPLIT, "t.reshape(B, self.n_head, T, C // self.n_head)")),
     {f"{ATT}-visible", f"{ATT}-future", f"{ATT}-heads"}),  # positions mixed inside a head leak the future
    (ATT, "heads merged without transpose", mutate(ATT, (MERGE, "y.reshape(B, T, C)")),
     {f"{ATT}-visible", f"{ATT}-future", f"{ATT}-heads"}),
    (ATT, "correct: -inf and torch.softmax", mutate(ATT, (MASKED, 'torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head))'
                                                                 '.masked_fill(~causal, float("-inf")), dim=-1)')), set()),
    (ATT, "correct: F.scaled_dot_product_attention", mutate(ATT, (
        "y = self.attn_dropout(weights) @ v", "y = F.scaled_dot_product_attention(q, k, v, is_causal=True)")), set()),
    # the GPT: its names and the tie
    (GPT, "tie by copy", mutate(GPT, (TIE, "self.lm_head.weight = nn.Parameter(self.transformer.wte.weight.detach().clone())")),
     {f"{GPT}-visible", f"{GPT}-tying"}),  # the parity tests give the copy the embedding's values (randomize_as_gpt2)
    (GPT, "re-assignment order: head re-created after the tie", mutate(GPT, (
        TIE, TIE + "\n        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)")),
     {f"{GPT}-visible", f"{GPT}-tying"}),
    (GPT, "no tie at all", mutate(GPT, (TIE, "pass")), {f"{GPT}-visible", f"{GPT}-tying"}),
    (GPT, "the head reads a detached copy of the tied matrix", mutate(GPT, (
        HEAD, "F.linear(self.transformer.ln_f(x), self.lm_head.weight.detach())")), {f"{GPT}-tying"}),  # only the gradient tells
    # the GPT: its forward pass
    (GPT, "positions 0..block_size-1 whatever T", mutate(GPT, ("torch.arange(T, device=idx.device)",
                                                              "torch.arange(self.config.block_size, device=idx.device)")),
     {f"{GPT}-visible", f"{GPT}-hf"}),  # the other hidden tests use T = block_size
    (GPT, "no position embedding", mutate(GPT, (" + self.transformer.wpe(positions)", "")), {f"{GPT}-visible", f"{GPT}-hf"}),
    (GPT, "no final LayerNorm", mutate(GPT, (HEAD, "self.lm_head(x)")), {f"{GPT}-visible", f"{GPT}-hf"}),
    (GPT, "exact GELU", mutate(GPT, ('F.gelu(self.c_fc(x), approximate="tanh")', "F.gelu(self.c_fc(x))")),
     {f"{GPT}-visible", f"{GPT}-hf"}),
    (GPT, "post-LN block", mutate(GPT, ("x = x + self.attn(self.ln_1(x))", "x = self.ln_1(x + self.attn(x))"),
                                  ("return x + self.mlp(self.ln_2(x))", "return self.ln_2(x + self.mlp(x))")),
     {f"{GPT}-visible", f"{GPT}-hf"}),
    (GPT, "no residual around the MLP", mutate(GPT, ("return x + self.mlp(self.ln_2(x))", "return self.mlp(self.ln_2(x))")),
     {f"{GPT}-visible", f"{GPT}-hf"}),
    # the GPT: its initialisation
    (GPT, "residual projections not scaled", mutate(GPT, ("std=0.02 / math.sqrt(2 * config.n_layer)", "std=0.02")),
     {f"{GPT}-visible", f"{GPT}-init"}),
    (GPT, "residual projections scaled by 1/sqrt(n_layer)", mutate(GPT, ("math.sqrt(2 * config.n_layer)", "math.sqrt(config.n_layer)")),
     {f"{GPT}-visible", f"{GPT}-init"}),
    (GPT, "biases left at PyTorch's default", mutate(GPT, ("nn.init.zeros_(module.bias)", "pass")), {f"{GPT}-visible", f"{GPT}-init"}),
    (GPT, "embeddings left at PyTorch's N(0, 1)", mutate(GPT, ("isinstance(module, (nn.Linear, nn.Embedding))", "isinstance(module, nn.Linear)")),
     {f"{GPT}-visible", f"{GPT}-init"}),  # the tied head is a Linear: wte (= lm_head) is drawn anyway; wpe is not
    (GPT, "uniform weights of the right standard deviation", mutate(GPT, (
        "nn.init.normal_(module.weight, mean=0.0, std=0.02)", "nn.init.uniform_(module.weight, -0.02 * 3 ** 0.5, 0.02 * 3 ** 0.5)")),
     {f"{GPT}-visible", f"{GPT}-init"}),
    # the GPT: its loss and its length check
    (GPT, "loss over padding: mean includes the -100 positions", mutate(GPT, (LOSS, LOSS[:-1] + ', reduction="none").mean()')),
     {f"{GPT}-loss"}),
    (GPT, "targets not used: loss against the inputs", mutate(GPT, ("targets.reshape(B * T)", "idx.reshape(B * T)")),
     {f"{GPT}-visible", f"{GPT}-loss"}),
    (GPT, "targets shifted a second time", mutate(GPT, (LOSS, "F.cross_entropy(logits[:, :-1].reshape(B * (T - 1), -1), "
                                                              "targets[:, 1:].reshape(B * (T - 1)), ignore_index=-100)")),
     {f"{GPT}-visible", f"{GPT}-loss"}),
    (GPT, "no length check", mutate(GPT, ("if T > self.config.block_size:", "if False:")), {f"{GPT}-length"}),
    (GPT, "length error without the limit", mutate(GPT, ('f"sequence length must be <= block_size = {self.config.block_size}, got {T}"',
                                                         '"sequence too long"')), {f"{GPT}-length"}),
    # the GPT: other correct designs
    (GPT, "correct: nanoGPT's tie direction", mutate(GPT, (TIE, "self.transformer.wte.weight = self.lm_head.weight")), set()),
    (GPT, "correct: loss from log_softmax over the real targets", mutate(GPT, (LOSS, (
        "(lambda lp, t: -lp[t != -100].gather(1, t[t != -100, None]).mean())"
        "(torch.log_softmax(logits.view(B * T, -1), dim=-1), targets.reshape(B * T))"))), set()),
    (GPT, "correct: an nn.Sequential MLP with GPT-2's names", mutate(GPT, ("self.mlp = GPTMLP(config)", (
        "self.mlp = nn.Sequential(__import__('collections').OrderedDict(c_fc=nn.Linear(config.n_embd, 4 * config.n_embd), "
        "gelu=nn.GELU(approximate='tanh'), c_proj=nn.Linear(4 * config.n_embd, config.n_embd)))"))), set()),
    # parameter count
    (CNT, "bias flag ignored", mutate(CNT, ("b = 1 if config.bias else 0", "b = 1")),
     {f"{CNT}-visible", f"{CNT}-bias"}),  # the visible check now counts a bias=False model too
    (CNT, "position embedding forgotten", mutate(CNT, ("embeddings = V * C + block_size * C", "embeddings = V * C")),
     {f"{CNT}-visible", f"{CNT}-gpt2"}),
    (CNT, "head counted despite tying", mutate(CNT, ("head = 0 if tied else V * C", "head = V * C")),
     {f"{CNT}-visible", f"{CNT}-gpt2", f"{CNT}-untied"}),
    (CNT, "final LayerNorm forgotten", mutate(CNT, ("final_norm = C + b * C", "final_norm = 0")),
     {f"{CNT}-visible", f"{CNT}-gpt2", f"{CNT}-bias"}),  # its bias is one of the biases
    (CNT, "MLP of width C instead of 4C", mutate(CNT, ("per_layer = 12 * C * C + 2 * C + b * (2 * C + 3 * C + C + 4 * C + C)",
                                                      "per_layer = 6 * C * C + 2 * C + b * (2 * C + 3 * C + C + C + C)")),
     {f"{CNT}-visible", f"{CNT}-gpt2", f"{CNT}-bias"}),
    (CNT, "correct: closed form", '''
def gpt_param_count(config, tied=True):
    C, b = config.n_embd, config.bias
    return (config.vocab_size * (1 if tied else 2) + config.block_size) * C + config.n_layer * (12 * C * C + (13 if b else 2) * C) + (2 if b else 1) * C
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {ATT, GPT, CNT}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 4


@pytest.mark.parametrize("exercise", [ATT, GPT, CNT])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
