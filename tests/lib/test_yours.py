"""course_lib.yours: the learner's function runs the chapter once it passes its visible check."""
from __future__ import annotations

import inspect
import json
import math
import random
import sys

import numpy as np
import pytest
import torch

import course_lib.bpe
import course_lib.decoding
import course_lib.gpt
import course_lib.kv_cache
from course_lib import checks
from course_lib.attention import masked_softmax as reference
from course_lib.yours import notebook_of, passes, yours, yours_from
from tests.helpers import ROOT


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


# yours_from: the learner's function from their notebook of an earlier chapter, beside the current one

SETUP = "import random\nimport torch\nimport course_lib\nfrom course_lib import checks\nfrom course_lib.yours import yours\n" \
        "course_lib.setup_notebook()\nprint('set up')\n"
CORRECT = inspect.getsource(learners_masked_softmax).replace("learners_masked_softmax", "masked_softmax")


def notebook(*cells):
    """An nbgrader notebook: a markdown cell, the set-up cell, then ("answer" | "code", source) cells."""
    def code(source, answer):
        meta = {"nbgrader": {"grade_id": "x-solution", "solution": True, "grade": False}} if answer else {}
        return {"cell_type": "code", "metadata": meta, "source": source.splitlines(keepends=True), "outputs": [],
                "execution_count": None}
    return {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# 01"}, code(SETUP, False),
                      *(code(source, kind == "answer") for kind, source in cells)],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A course folder whose chapter 02 is the working directory; write(cells) saves chapter 01's notebook."""
    (tmp_path / "course" / "02-multihead").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "course" / "02-multihead")

    def write(*cells):
        (tmp_path / "course" / "01-attention").mkdir(exist_ok=True)
        path = tmp_path / "course" / "01-attention" / "attention.ipynb"
        path.write_text(json.dumps(notebook(*cells)))
        return path
    return write


def from_01(name="masked_softmax"):
    return yours_from("01-attention", name, checks.check_masked_softmax, reference)


def test_a_passing_answer_from_the_earlier_notebook_is_used_and_said(course, capsys):
    course(("answer", "import math\n" + CORRECT + "print('a stray line: it does not run')\n"))
    chosen = from_01()
    assert chosen is not reference and chosen.__globals__["math"] is math  # the notebook's own, with its own imports
    scores = torch.randn(2, 3, 4)
    mask = torch.rand(2, 1, 4) > 0.3
    torch.testing.assert_close(chosen(scores, mask), reference(scores, mask), rtol=1e-6, atol=1e-7)
    assert capsys.readouterr().out == "using your masked_softmax from ../01-attention/attention.ipynb\n", \
        "one line; neither the set-up cell's print nor the answer cell's stray statement shows"


@pytest.mark.parametrize("answer, why", [
    (inspect.getsource(unfinished).replace("unfinished", "masked_softmax"), "does not pass its check yet"),
    (inspect.getsource(no_mask).replace("no_mask", "masked_softmax"), "does not pass its check yet"),
    ("def masked_softmax(scores, mask=None):\n    return torch.softmax(scores, dim=-1\n", "does not run (SyntaxError"),
    (CORRECT + "\nSCALE = 1 / 0\n", "does not run (ZeroDivisionError"),  # a constant is a definition: it runs
])
def test_an_unfinished_wrong_or_broken_answer_gives_way_to_the_course(course, capsys, answer, why):
    course(("answer", answer))
    assert from_01() is reference
    out = capsys.readouterr().out
    assert out.startswith("your masked_softmax in ../01-attention/attention.ipynb " + why), out
    assert out.endswith("runs below\n") and out.count("\n") == 1, out


def test_a_syntax_error_says_what_and_where_in_the_answer_cell(course, capsys):
    course(("answer", "def masked_softmax(scores, mask=None):\n    return torch.softmax(scores, dim=-1\n"))
    assert from_01() is reference
    assert capsys.readouterr().out == ("your masked_softmax in ../01-attention/attention.ipynb does not run (SyntaxError: "
                                       "'(' was never closed, line 2 of its answer cell): the course's masked_softmax "
                                       "runs below\n")


@pytest.mark.parametrize("setup, why", [("import math,\n", "(SyntaxError: "), ("raise RuntimeError('no data')\n", "(RuntimeError: no data)")])
def test_a_set_up_cell_that_does_not_run_says_why(course, capsys, monkeypatch, setup, why):
    monkeypatch.setattr(sys.modules[__name__], "SETUP", setup)
    course(("answer", CORRECT))
    assert from_01() is reference
    out = capsys.readouterr().out
    assert out.startswith(f"../01-attention/attention.ipynb's set-up cell does not run {why}"), out
    assert out.endswith(": the course's masked_softmax runs below\n"), out
    if "SyntaxError" in why:
        assert out.endswith(", line 1): the course's masked_softmax runs below\n"), out


def test_a_missing_notebook_or_answer_gives_the_course_and_says_why(course, capsys):
    assert from_01() is reference
    assert capsys.readouterr().out == ("no ../01-attention/attention.ipynb beside this notebook: "
                                       "the course's masked_softmax runs below\n")
    course(("code", "x = 1\n"))
    assert from_01() is reference
    assert "has no answer cell that defines masked_softmax" in capsys.readouterr().out


def test_a_notebook_saved_since_is_read_again(course, capsys):
    course(("answer", inspect.getsource(no_mask).replace("no_mask", "masked_softmax")))
    assert from_01() is reference
    course(("answer", CORRECT))
    assert from_01() is not reference


def test_only_answers_and_the_chapters_own_choices_run_up_to_the_name(course, capsys, tmp_path):
    # the earlier chapter's own choice (a yours(...) line) holds for its later answers: its wrong helper is replaced
    course(("answer", "def helper(x):\n    return x + 1\n"),
           ("code", "helper = yours(helper, lambda f: None if f(3) == 6 else 1 / 0, lambda x: 2 * x)\n"),
           ("code", "open('written.txt', 'w').write('no')\n"),
           ("answer", "def value():\n    return helper(0)\n\nopen('written.txt', 'w').write('no')\n"),
           ("answer", "def later(x):\n    return x\n\nlater = 1 / 0\n"))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    anything = lambda f: None  # noqa: E731 - a check that passes
    assert yours_from("01-attention", "value", anything, None)() == 0, "the course's helper (2x), as the chapter chose"
    assert yours_from("01-attention", "helper", anything, None)(1) == 2, "the learner's helper as their answer cell made it"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "no other statement ran: nothing was written"
    assert capsys.readouterr().out.count("using your") == 2


def test_the_earlier_set_up_cell_leaves_random_states_and_threads_as_they_were(course, capsys):
    course(("answer", CORRECT))
    states = []
    for _ in range(2):
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        from_01()  # its set-up cell runs setup_notebook(): seeds 0, one thread
        states.append((torch.randn(3), random.random(), np.random.rand(), torch.get_num_threads()))
        torch.set_num_threads(threads)
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert str(states[0]) == str(states[1]) == str((torch.randn(3), random.random(), np.random.rand(), 2))


def test_only_the_course_folder_is_read(course, capsys, tmp_path):
    outside = tmp_path / "elsewhere.ipynb"
    outside.write_text(json.dumps(notebook(("answer", CORRECT))))
    (tmp_path / "course" / "01-attention").mkdir()
    (tmp_path / "course" / "01-attention" / "attention.ipynb").symlink_to(outside)
    assert from_01() is reference
    assert "lies outside this course folder" in capsys.readouterr().out
    for chapter in ("../01-attention", "01-attention/../..", "1-attention", "01_attention", "", None):
        with pytest.raises(ValueError, match="chapter must be a chapter folder's name"):
            yours_from(chapter, "masked_softmax", checks.check_masked_softmax, reference)


def test_the_release_holds_every_earlier_piece_the_later_chapters_read_unfinished(monkeypatch, capsys):
    # the names later chapters ask for (chapters 05, 07, 08 and 12's last section) are answer cells of the release,
    # found and unfinished: the course's runs, saying so (a renamed exercise would say "has no answer cell")
    monkeypatch.chdir(ROOT / "notebooks" / "12-serving")
    wanted = [("04-gpt", "GPT", checks.check_gpt, course_lib.gpt.GPT),
              ("05-kv-cache", "generate_cached", checks.check_generate_cached, course_lib.kv_cache.generate_cached),
              ("09-tokenization", "bpe_encode", checks.check_bpe_encode, course_lib.bpe.bpe_encode),
              ("09-tokenization", "bpe_decode", checks.check_bpe_decode, course_lib.bpe.bpe_decode),
              *[("06-decoding", name, getattr(checks, f"check_{name}"), getattr(course_lib.decoding, name))
                for name in ("apply_repetition_penalty", "apply_temperature", "top_k_filter", "top_p_filter")]]
    for chapter, name, check, course in wanted:
        assert yours_from(chapter, name, check, course) is course
        assert capsys.readouterr().out == (f"your {name} in {notebook_of(chapter).as_posix()} does not pass its check yet: "
                                           "the course's version runs below\n")



def test_feedback_in_the_notebook_does_not_need_the_grader(course, capsys, monkeypatch):
    """yours_from runs an earlier answer's definitions as the clean room grades them (course_lib.answers), without
    the grader: with course_lib.grading unimportable, the learner's function is still found and used."""
    monkeypatch.setitem(sys.modules, "course_lib.grading", None)  # any import of the grader now raises ImportError
    course(("answer", CORRECT))
    assert from_01() is not reference
    assert capsys.readouterr().out == "using your masked_softmax from ../01-attention/attention.ipynb\n"
