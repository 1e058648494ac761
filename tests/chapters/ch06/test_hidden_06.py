"""Chapter 06's test cells, run directly (no nbgrader) against the classic decoding bugs, one planted bug at a time.

Each exercise's visible and hidden test cells are executed in a namespace holding the reference
solutions with ONE planted bug. Every bug must fail exactly the tests documented to target it (the
first comment line of each cell), and correct alternative implementations must pass everything.
The slower nbgrader round trip (tests/chapters/ch06/test_grading_06.py) checks the same on whole notebooks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.hf import to_hf
from course_lib.kv_cache import KVCache, cached_forward
from tests.cell_harness import TestCells
from tests.helpers import ROOT, failing

SOURCE = ROOT / "solutions" / "06-decoding" / "decoding.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "checks": checks, "to_hf": to_hf,
                             "KVCache": KVCache, "cached_forward": cached_forward})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

TEMP, TOPK, TOPP, REP, GREEDY, BEAM = "temperature", "top_k", "top_p", "repetition_penalty", "greedy", "beam_search"
ZERO_BRANCH = """    if temperature == 0:
        is_max = logits == logits.amax(dim=-1, keepdim=True)
        return torch.where(is_max, 0.0, float("-inf")).to(logits.dtype)
"""
KTH = "kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)"
TOPK_RETURN = 'return logits.masked_fill(logits < kth_largest, float("-inf"))'
DROP = "drop = tail_mass <= 1 - p"
PENALTY = "score = torch.where(score < 0, score * penalty, score / penalty)"
ARGMAX = "next_token = logits[:, -1, :].argmax(dim=-1)  # (B,)"
ALL_DONE = "if finished.all():"
LENGTH = "(cur_len + 1 - T0) ** length_penalty"
NEVER_LENGTH = 'best_len = max_len - T0 if early_stopping == "never" and length_penalty > 0 else cur_len + 1 - T0'
EARLY_TRUE = """        if early_stopping is True:
            searching &= finished_scores[:, -1] == -inf
"""



CASES = [
    # temperature
    (TEMP, "temperature 0 divides by zero", mutate(TEMP, (ZERO_BRANCH, "")), failing(TEMP, "visible", "zero")),
    (TEMP, "multiplies by the temperature", mutate(TEMP, ("return logits / temperature", "return logits * temperature")),
     failing(TEMP, "visible", "scale")),
    (TEMP, "no check for negative temperatures", mutate(TEMP, ("if not temperature >= 0:", "if False:")),
     failing(TEMP, "visible", "negative")),
    (TEMP, "correct: argmax one-hot for temperature 0", mutate(TEMP, (ZERO_BRANCH, """    if temperature == 0:
        return torch.full_like(logits, float("-inf")).scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
""")), set()),
    # top-k
    (TOPK, "exactly k indices: ties with the k-th dropped", mutate(TOPK, (TOPK_RETURN, (
        'return torch.full_like(logits, float("-inf")).scatter(-1, torch.topk(logits, k, dim=-1).indices, '
        'torch.topk(logits, k, dim=-1).values)'))), failing(TOPK, "visible", "ties")),
    (TOPK, "k larger than the vocabulary not clamped", mutate(TOPK, ("k = min(k, logits.shape[-1])", "pass")),
     failing(TOPK, "visible", "large")),
    (TOPK, "returns probabilities instead of logits", mutate(TOPK, (TOPK_RETURN,
        'return logits.softmax(-1).masked_fill(logits < kth_largest, float("-inf"))')),
     failing(TOPK, "visible", "large", "logits")),
    (TOPK, "threshold from logits compared with probabilities, filtered set to 0", mutate(TOPK, (TOPK_RETURN,
        "return logits.masked_fill(logits.softmax(-1) < kth_largest, 0.0)")), failing(TOPK, "visible", "ties", "logits")),
    (TOPK, "k checked for its range only: 2.5, numpy integers and tensors not refused", mutate(TOPK, (
        "if isinstance(k, bool) or not isinstance(k, int) or k < 1:", "if k < 1:")), failing(TOPK, "large")),
    (TOPK, "no check of k", mutate(TOPK, ("if isinstance(k, bool) or not isinstance(k, int) or k < 1:", "if False:")),
     failing(TOPK, "large")),
    (TOPK, "correct: top-k on probabilities, logits returned", mutate(TOPK, (KTH,
        "kth_largest = torch.topk(logits.softmax(-1), k, dim=-1).values[..., -1:]"), (
        "logits < kth_largest", "logits.softmax(-1) < kth_largest")), set()),
    # top-p
    (TOPP, "the crossing token dropped", mutate(TOPP, (DROP, "drop = tail_mass - sorted_logits.softmax(dim=-1) < 1 - p")),
     failing(TOPP, "visible", "crossing", "order")),
    (TOPP, "crossing token dropped and no token kept below the top probability", mutate(TOPP, (
        DROP, "drop = tail_mass - sorted_logits.softmax(dim=-1) < 1 - p"), ("drop[..., -1] = False", "pass")),
     failing(TOPP, "visible", "crossing", "one", "order")),
    (TOPP, "mask left in sorted order", mutate(TOPP, ("drop = drop.scatter(-1, order, drop)", "pass")),
     failing(TOPP, "visible", "crossing", "one", "order")),
    (TOPP, "correct: descending sort, mass before the token < p", mutate(TOPP, (
        "sorted_logits, order = torch.sort(logits, dim=-1, descending=False)",
        "sorted_logits, order = torch.sort(logits, dim=-1, descending=True)"), (
        "tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)",
        "tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)"),
        (DROP, "drop = tail_mass >= p"), ("drop[..., -1] = False", "drop[..., 0] = False")), set()),
    (TOPP, "no check of p", mutate(TOPP, ("if not 0 < p <= 1:", "if False:")), failing(TOPP, "one")),
    # repetition penalty
    (REP, "divides negative logits too", mutate(REP, (PENALTY, "score = score / penalty")),
     failing(REP, "visible", "negative", "rows")),
    (REP, "penalised once per occurrence", mutate(REP, (
        "score = torch.gather(logits, 1, input_ids)  # (B, T): the logit of every token seen so far", """logits = logits.clone()
    for b in range(input_ids.shape[0]):
        for t in input_ids[b].tolist():
            logits[b, t] = logits[b, t] * penalty if logits[b, t] < 0 else logits[b, t] / penalty
    return logits""")), failing(REP, "visible", "once")),
    (REP, "every row penalised by all rows' tokens", mutate(REP, (
        "score = torch.gather(logits, 1, input_ids)", "input_ids = input_ids.reshape(1, -1).expand(logits.shape[0], -1)\n"
        "    score = torch.gather(logits, 1, input_ids)")), failing(REP, "visible", "rows")),
    (REP, "no check of the penalty", mutate(REP, ("if not penalty > 0:", "if False:")), failing(REP, "rows")),
    # greedy
    (GREEDY, "one row's EOS stops the batch", mutate(GREEDY, (ALL_DONE, "if finished.any():")),
     failing(GREEDY, "visible", "batch_eos", "padding")),
    (GREEDY, "greedy that samples", mutate(GREEDY, (ARGMAX,
        "next_token = torch.multinomial(logits[:, -1, :].softmax(-1), 1).squeeze(1)")),
     failing(GREEDY, "visible", "argmax")),
    (GREEDY, "finished rows keep generating", mutate(GREEDY, ("next_token = torch.where(finished, pad_token_id, next_token)",
                                                              "pass")), failing(GREEDY, "visible", "padding")),
    (GREEDY, "never stops early", mutate(GREEDY, (ALL_DONE, "if False:")), failing(GREEDY, "visible", "stop")),
    (GREEDY, "an EOS in the prompt finishes the row", mutate(GREEDY, (
        "finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # (B,)",
        "finished = (idx == eos_token_id).any(dim=1) if eos_token_id is not None else "
        "torch.zeros(idx.shape[0], dtype=torch.bool)")), failing(GREEDY, "visible", "padding")),  # visible: issue 24
    # beam search (the build exercise): slow cases (Hugging Face runs in its tests), so only the main ones
    (BEAM, "length penalty counts the prompt", mutate(BEAM, (LENGTH, "(cur_len + 1) ** length_penalty")),
     failing(BEAM, "visible", "hf", "rows", "brute", "eos")),
    (BEAM, "the K beams start equal: copies of one sequence", mutate(BEAM, (
        "running_scores[:, 0] = 0.0", "running_scores[:, :] = 0.0")), failing(BEAM, "visible", "hf", "rows", "brute")),
    (BEAM, "attention mask ignored", mutate(BEAM, ("cached_forward(model, new, cache, mask)",
                                                   "cached_forward(model, new, cache)")), failing(BEAM, "visible", "rows")),
    (BEAM, "early_stopping=True treated as False", mutate(BEAM, (EARLY_TRUE, "")), failing(BEAM, "visible", "hf")),
    # issue 41: "never" treated as False was caught by the hidden Hugging Face test only
    (BEAM, 'early_stopping="never" treated as False', mutate(BEAM, (NEVER_LENGTH, "best_len = cur_len + 1 - T0")),
     failing(BEAM, "visible", "hf")),
    (BEAM, "pad_token_id=None pads with 0, not the EOS id", mutate(BEAM, (
        "pad = pad_token_id if pad_token_id is not None else max(eos, 0)", "pad = pad_token_id if pad_token_id is not None else 0")),
     failing(BEAM, "eos")),
    (BEAM, "returns every sequence at full length", mutate(BEAM, (
        "finished[:, 0, :int(finished_len[:, 0].max())]", "finished[:, 0]")), failing(BEAM, "visible", "hf", "eos")),
    # visible: its early_stopping=True case ends both rows before max_new_tokens (issue 41)
    (BEAM, "correct: no cache kept, the whole prefix recomputed each step", mutate(BEAM, (
        "log_probs = cached_forward(model, new, cache, mask)[:, -1]",
        "log_probs = cached_forward(model, running[:, :, :cur_len].reshape(B * K, cur_len), KVCache.for_model("
        "model, B * K, cur_len), None if mask is None else mask[:, :cur_len])[:, -1]"),
        ("        cache.reorder((source + rows * K).view(-1))\n", "")), set()),
    # the docstring lets a learner ignore logits_processor: no check or test may pass it
    (BEAM, "correct: logits_processor ignored", mutate(BEAM, (
        "        if logits_processor is not None:\n"
        "            log_probs = logits_processor(running[:, :, :cur_len].reshape(B * K, cur_len), log_probs)\n", "")),
     set()),
    (BEAM, "no ValueError", mutate(BEAM, ('if early_stopping not in (True, False, "never"):', "if False:"), (
        "if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:", "if False:")),
     failing(BEAM, "errors")),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {TEMP, TOPK, TOPP, REP, GREEDY, BEAM}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 4


@pytest.mark.parametrize("exercise", [TEMP, TOPK, TOPP, REP, GREEDY, BEAM])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
