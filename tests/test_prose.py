"""Every number in a chapter's prose is shown by a cell of that chapter, or cited (tests/prose.py says how)."""
from __future__ import annotations

import pytest

from course_lib import grading
from tests.conftest import ROOT
from tests.prose import prose_numbers, unshown_numbers

#: Per chapter: numbers the prose cites rather than computes, each with its source.
CITED: dict[str, dict[str, str]] = {
    "00-orientation": {
        "11": "a chapter number in the table of chapters (11 from GPT-2 to Llama), not a measured figure",
    },

    "01-attention": {
    },

    "02-multihead": {
    },

    "03-transformer": {
    },

    "04-gpt": {
    },

    "05-kv-cache": {
    },

    "06-decoding": {
    },

    "07-speculative": {
    },

    "08-memory-bound": {
    },

    "09-tokenization": {
    },

    "10-scaling-laws": {
    },

    "11-modern-decoder": {
    },

}

CHAPTERS = grading.chapters(ROOT)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_number_in_the_prose_is_shown_by_a_cell_or_cited(chapter):
    problems = [p for path in sorted((ROOT / "solutions" / chapter).glob("*.ipynb"))
                for p in unshown_numbers(path, CITED.get(chapter, {}))]
    assert not problems, "\n".join(problems)


def test_the_check_reads_numbers_as_a_reviewer_would():
    found = [n.text for n in prose_numbers(
        "The baseline has 104,973 parameters (Bahdanau et al., 2015, chapter 05), 38.6 M in all, "
        "std ×7.84, 61 % of [the roof](https://x.org/2.5), eps 1e-5, float32, GPT-2, 3 heads, 100 steps, 24 layers.")]
    assert found == ["104,973", "38.6 M", "7.84", "61 %", "1e-5", "24"]
