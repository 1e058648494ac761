"""Chapter 15's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it, and correct alternatives must
pass everything. Oracle: partial matching by the ``regex`` package on bytes (course_lib.checks.ch15), never the
course's index.
"""
from __future__ import annotations

import pytest
import regex
import torch

from course_lib import assets, checks, structured
from course_lib.checks.ch15 import regex_allows, regex_allows_eos, state_prefixes
from course_lib.structured import ByteDFA
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "15-structured-decoding" / "structured_decoding.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "regex": regex, "checks": checks, "assets": assets, "structured": structured,
                             "regex_allows": regex_allows, "regex_allows_eos": regex_allows_eos,
                             "state_prefixes": state_prefixes, "ByteDFA": ByteDFA})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

TI, CM = "token_index", "constrained_mask"
WALK = "end = dfa.walk(state, data) if data else None"
KEEP = "keep[list(allowed)] = True"
EOS = "if accepting and eos_token_id is not None:"
RETURN = 'return logits.masked_fill(~keep, float("-inf"))'


def ex(exercise: str, *names: str) -> set[str]:
    return {f"{exercise}-{name}" for name in names}


CASES = [
    (TI, "a token accepted when only its first byte matches",
     mutate(TI, (WALK, "end = (dfa.walk(state, data) or dfa.walk(state, data[:1])) if data else None")),
     ex(TI, "visible", "bytes", "walk")),
    (TI, "the state not advanced over a multi-byte token", mutate(TI, ("allowed[token] = end", "allowed[token] = dfa.walk(state, data[:1])")),
     ex(TI, "visible", "walk")),
    (TI, "the index built over characters", mutate(TI, (WALK, 'data = data.decode("utf-8", errors="replace").encode()\n'
                                                               "            " + WALK)),
     ex(TI, "visible", "bytes")),
    (TI, "the empty token allowed", mutate(TI, (WALK, "end = dfa.walk(state, data)")), ex(TI, "visible")),
    (TI, "correct: a walk over the transitions written out, tokens grouped by first byte", '''
def token_index(dfa, token_bytes):
    by_first = {}
    for token, data in enumerate(token_bytes):
        if data:
            by_first.setdefault(data[0], []).append(token)
    index = []
    for state in range(dfa.num_states):
        row = {}
        for byte, tokens in by_first.items():
            if byte not in dfa.transitions[state]:
                continue
            for token in tokens:
                at = state
                for b in token_bytes[token]:
                    at = dfa.transitions[at].get(b)
                    if at is None:
                        break
                if at is not None:
                    row[token] = at
        index.append(dict(sorted(row.items())))
    return index
''', set()),
    (CM, "EOS allowed in a state that is not accepting", mutate(CM, (EOS, "if eos_token_id is not None:")), ex(CM, "visible", "eos")),
    (CM, "a large negative logit instead of -inf", mutate(CM, (RETURN, "return logits.masked_fill(~keep, -1e9)")), ex(CM, "visible", "eos")),
    (CM, "the logits masked in place", mutate(CM, (RETURN, 'return logits.masked_fill_(~keep, float("-inf"))')), ex(CM, "visible")),
    (CM, "the masked logits renormalised", mutate(CM, (RETURN, 'return torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)')),
     ex(CM, "visible", "generate")),
    (CM, "EOS written into the index row it is given", mutate(CM, (KEEP, "if accepting and eos_token_id is not None:\n"
                                                                         "        allowed[eos_token_id] = -1\n    " + KEEP)),
     ex(CM, "visible", "eos")),
    (CM, "a mask kept between calls", "KEPT = {}\n" + mutate(CM, ("keep = torch.zeros(logits.shape[-1], dtype=torch.bool)",
                                                  "keep = KEPT.setdefault(logits.shape[-1], torch.zeros(logits.shape[-1], dtype=torch.bool))")),
     ex(CM, "visible", "eos", "generate")),
    (CM, "an empty row (an accepting state with nothing after it) not handled", mutate(CM, (KEEP, "keep[torch.tensor(list(allowed))] = True")),
     ex(CM, "visible", "eos")),
    (CM, "correct: a tensor of -inf with the allowed logits copied in", '''
def constrained_mask(logits, allowed, accepting, eos_token_id):
    ids = sorted(allowed) + ([eos_token_id] if accepting and eos_token_id is not None else [])
    out = torch.full_like(logits, float("-inf"))
    out[ids] = logits[ids]
    return out
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {TI, CM}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 3


@pytest.mark.parametrize("exercise", [TI, CM])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
