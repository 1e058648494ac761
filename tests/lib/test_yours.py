"""course_lib.yours: the learner's function runs the chapter once it passes its visible check."""
from __future__ import annotations

import torch

from course_lib import checks
from course_lib.attention import masked_softmax as reference
from course_lib.yours import passes, yours


def learners_masked_softmax(scores, mask=None):  # correct, written differently from the course's
    if mask is None:
        return torch.softmax(scores, dim=-1)
    exp = (scores - scores.amax(-1, keepdim=True)).exp() * mask
    total = exp.sum(-1, keepdim=True)
    return torch.where(total > 0, exp / total.clamp_min(1e-30), 0.0)


def unfinished(scores, mask=None):
    raise NotImplementedError()


def no_mask(scores, mask=None):  # the classic mistake: the padding mask is ignored
    return torch.softmax(scores, dim=-1)


def nan_on_fully_masked(scores, mask=None):  # the other classic mistake: -inf fill, NaN on a fully masked row
    return torch.softmax(scores if mask is None else scores.masked_fill(~mask, float("-inf")), dim=-1)


def test_a_passing_function_is_used_and_said(capsys):
    chosen = yours(learners_masked_softmax, checks.check_masked_softmax, reference)
    assert chosen is learners_masked_softmax
    assert capsys.readouterr().out == "using your masked_softmax\n", "the check's own output is not repeated"


def test_an_unfinished_or_wrong_function_gives_way_to_the_course(capsys):
    for learners in (unfinished, no_mask, nan_on_fully_masked):
        assert yours(learners, checks.check_masked_softmax, reference) is reference
        assert capsys.readouterr().out == "your masked_softmax does not pass its check yet: the course's version runs below\n"
    assert not passes(no_mask, checks.check_masked_softmax) and passes(reference, checks.check_masked_softmax)


def test_the_check_gives_back_the_random_numbers_it_draws():
    def check_that_draws(function):
        torch.randn(100)
        function()

    def fails():
        raise AssertionError("wrong")

    torch.manual_seed(5)
    expected = torch.randn(3)
    for function in (lambda: None, fails):
        torch.manual_seed(5)
        passes(function, check_that_draws)
        assert torch.equal(torch.randn(3), expected)
