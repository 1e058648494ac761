"""Chapter 09's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release (zero) and two
students with planted bugs whose targeted tests are disjoint:

* planted_a: bpe_merge merges overlapping occurrences twice (every matching position, "aaa" -> one token) ->
  the visible test and `overlap` only (pairs of two different ids cannot overlap, so `random` passes); train_bpe
  breaks ties by the order it counted pairs (max(counts, key=counts.get)) -> the visible test and `ties` (the
  `bytes` and `stop` texts have no ties); bpe_decode decodes token by token -> the visible test and `utf8`.
  train_bpe and bpe_encode call the buggy merge in the notebook, but grading runs them with the reference merge:
  they lose nothing for it.
* planted_b: train_bpe counts a run as the merges it allows ("aaa" holds (a, a) once) -> the visible test and
  `bytes`; bpe_encode merges the pair most frequent in the text instead of the earliest learned -> the visible
  test, `rank` and `hf` (the boundary cases have no merge inside a chunk, so `boundary` passes).

tests/chapters/ch09/test_hidden_09.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.planted import NAIVE_TRAINER
from tests.roundtrip import Chapter, round_trip

CH = Chapter("09-tokenization", "tokenization")
MERGE, TRAIN, ENCODE, DECODE = "bpe_merge-solution", "train_bpe-solution", "bpe_encode-solution", "bpe_decode-solution"

OVERLAPPING_MERGE = '''def bpe_merge(ids, pair, new_id):
    out = list(ids)
    hits = [i for i in range(len(ids) - 1) if ids[i] == pair[0] and ids[i + 1] == pair[1]]
    for i in reversed(hits):  # every position where the pair starts, overlapping ones too
        out[i:i + 2] = [new_id]
    return out
'''

FIRST_COUNTED_TIE = NAIVE_TRAINER.replace("pair = min(counts, key=lambda p: (-counts[p], p))", "pair = max(counts, key=counts.get)")
RUNS_WITHOUT_OVERLAP = NAIVE_TRAINER.replace("            count_pairs(ids, counts, n)\n", """            for p in set(zip(ids, ids[1:])):
                counts[p] = counts.get(p, 0) + n * (len(ids) - len(bpe_merge(ids, p, -1)))
""")
assert FIRST_COUNTED_TIE != NAIVE_TRAINER != RUNS_WITHOUT_OVERLAP


def planted_a() -> dict:
    return CH.solved({
        MERGE: OVERLAPPING_MERGE,
        TRAIN: FIRST_COUNTED_TIE,
        DECODE: CH.mutate(DECODE, 'return b"".join(vocab[int(i)] for i in ids).decode("utf-8", errors="replace")',
                          'return "".join(vocab[int(i)].decode("utf-8", errors="replace") for i in ids)'),
    })


def planted_b() -> dict:
    return CH.solved({
        TRAIN: RUNS_WITHOUT_OVERLAP,
        ENCODE: CH.mutate(ENCODE, 'pair = min(zip(chunk_ids, chunk_ids[1:]), key=lambda p: merges.get(p, float("inf")))',
                          'counts = count_pairs(chunk_ids)\n'
                          '            known = [p for p in counts if p in merges]\n'
                          '            pair = max(known, key=lambda p: counts[p]) if known else (-1, -1)'),
    })



STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted_a": (planted_a, failing("bpe_merge", "visible", "overlap") | failing("train_bpe", "visible", "ties")
                  | failing("bpe_decode", "visible", "utf8")),
    "planted_b": (planted_b, failing("train_bpe", "visible", "bytes") | failing("bpe_encode", "visible", "rank", "hf")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=17)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    a, b = roundtrip.messages(graded, CH, "planted_a"), roundtrip.messages(graded, CH, "planted_b")
    assert "occurrences overlap here" in a["bpe_merge-visible"]
    assert "join the bytes of ALL tokens first" in a["bpe_decode-visible"]
    assert "a tie goes to the smallest pair" in a["train_bpe-visible"]
    assert "Count a pair at every position" in b["train_bpe-visible"]
    assert "merges are applied by rank" in b["bpe_encode-visible"]
