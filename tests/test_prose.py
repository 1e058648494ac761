"""Every number in a chapter's prose is shown by a cell of that chapter, or cited (tests/prose.py says how)."""
from __future__ import annotations

import pytest

from course_lib import grading
from tests.conftest import ROOT
from tests.prose import is_shown, prose_numbers, shown_values, unshown_numbers

#: Per chapter: numbers the prose cites rather than computes, each with its source.
CITED: dict[str, dict[str, str]] = {
    "00-orientation": {
    },

    "01-attention": {
    },

    "02-multihead": {
    },

    "03-transformer": {
    },

    "04-gpt": {
        "0.01": "OpenAI's released GPT-2 code, github.com/openai/gpt-2 src/model.py: wpe drawn with "
                "tf.random_normal_initializer(stddev=0.01)",
    },

    "05-kv-cache": {
        "4096": "Jiang et al. (2023), Mistral 7B, arXiv:2310.06825, section 2 and table 1: window size W = 4096",
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
        "0.076": "Kaplan et al. (2020), Scaling Laws for Neural Language Models, equation (1.1): alpha_N = 0.076",
    },

    "11-modern-decoder": {
    },

    "14-tiled-attention": {
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


@pytest.mark.parametrize("prose,shown,ok", [
    ("38.6 M parameters", "38,597,376", True),      # read in the prose's unit
    ("61 % of the bound", "0.613", True),            # a fraction shown as a percentage
    ("61 % of the bound", "61.3%", True),
    ("about 2.3", "2.26", True),                     # rounded as the prose writes it
    ("about 2.3", "2.36", False),
    ("eps 1e-5", "eps=1e-05", True),
    ("eps 1e-5", "2e-05", False),                    # chapter 03's finding: the prose said 1e-5, the cell printed 2e-5
    ("104,973 parameters", "92,621", False),
])
def test_a_number_is_shown_only_by_a_value_that_rounds_to_it(prose, shown, ok):
    (number,) = prose_numbers(prose)
    assert is_shown(number, shown_values([shown])) is ok
