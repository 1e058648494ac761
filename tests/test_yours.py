"""course_lib.yours: the learner's function runs the chapter once it passes its visible check."""
from __future__ import annotations

import torch

from course_lib import checks
from course_lib.attention import masked_softmax as reference
from course_lib.yours import passes, yours


def learners_masked_softmax(scores, mask=None):
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def unfinished(scores, mask=None):
    raise NotImplementedError()


def no_mask(scores, mask=None):  # the classic mistake: the padding mask is ignored
    return torch.softmax(scores, dim=-1)


def test_a_passing_function_is_used_and_said(capsys):
    chosen = yours(learners_masked_softmax, checks.check_masked_softmax, reference)
    assert chosen is learners_masked_softmax
    assert capsys.readouterr().out == "using your masked_softmax\n", "the check's own output is not repeated"


def test_an_unfinished_or_wrong_function_gives_way_to_the_course(capsys):
    for learners in (unfinished, no_mask):
        assert yours(learners, checks.check_masked_softmax, reference) is reference
        assert capsys.readouterr().out == "your masked_softmax does not pass its check yet: the course's version runs below\n"
    assert not passes(no_mask, checks.check_masked_softmax) and passes(reference, checks.check_masked_softmax)
