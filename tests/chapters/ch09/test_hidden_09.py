"""Chapter 09's test cells, run directly (no nbgrader) against the classic BPE bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top of each
cell), and correct alternative implementations must pass everything. The classic bugs of the chapter:
overlapping pairs merged twice ("aaa"); in the trainer (planted in a naive learner's trainer), a tie broken
by the order pairs were counted, a run counted without overlaps, characters instead of bytes, repeated chunks
counted once, no stop when the pairs run out; merges applied by frequency in the text instead of by learned
rank, a merge across a pre-tokenization boundary, and a decoder that decodes token by token. The trainer and the
encoder call bpe_merge: grading runs each exercise with the other exercises' reference solutions, so a bug in
exercise 1 costs nothing in exercises 2 and 3 (tests/chapters/ch09/test_grading_09.py checks that, and the rest,
on whole notebooks through nbgrader).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter

import pytest
import torch

from course_lib import checks
from course_lib.bpe import BPETokenizer, count_pairs, pretokenize, vocab_from_merges
from course_lib.data import default_corpus
from course_lib.gpt import text_nats
from course_lib.hf import bytes_to_unicode, hf_encode_bytes, merges_from_hf, train_hf_bpe
from tests.cell_harness import TestCells
from tests.helpers import ROOT
from tests.planted import NAIVE_TRAINER

SOURCE = ROOT / "solutions" / "09-tokenization" / "tokenization.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "heapq": heapq, "math": math, "time": time, "Counter": Counter, "checks": checks,
                             "BPETokenizer": BPETokenizer, "bytes_to_unicode": bytes_to_unicode, "count_pairs": count_pairs,
                             "hf_encode_bytes": hf_encode_bytes, "merges_from_hf": merges_from_hf, "pretokenize": pretokenize,
                             "text_nats": text_nats, "train_hf_bpe": train_hf_bpe,
                             "vocab_from_merges": vocab_from_merges, "default_corpus": default_corpus})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

MERGE, TRAIN, ENCODE, DECODE = "bpe_merge", "train_bpe", "bpe_encode", "bpe_decode"
RANK = 'pair = min(zip(chunk_ids, chunk_ids[1:]), key=lambda p: merges.get(p, float("inf")))'

# a learner's trainer: correct, and naive (every pair recounted after every merge); the trainer's bugs are planted in it
NAIVE = NAIVE_TRAINER
CHOOSE = "pair = min(counts, key=lambda p: (-counts[p], p))"
COUNT = "count_pairs(ids, counts, n)"
TRAIN_ALL = {f"{TRAIN}-visible", f"{TRAIN}-ties", f"{TRAIN}-bytes", f"{TRAIN}-stop"}


def naive(*replacements: tuple[str, str]) -> str:
    code = NAIVE
    for old, new in replacements:
        assert old in code, old
        code = code.replace(old, new)
    return code


CASES = [
    # exercise 1: the merge
    (MERGE, "overlapping pairs merged twice (every matching position, right to left)", '''
def bpe_merge(ids, pair, new_id):
    out = list(ids)
    hits = [i for i in range(len(ids) - 1) if ids[i] == pair[0] and ids[i + 1] == pair[1]]
    for i in reversed(hits):  # every position where the pair starts, overlapping ones too
        out[i:i + 2] = [new_id]
    return out
''', {f"{MERGE}-visible", f"{MERGE}-overlap"}),
    (MERGE, "overlaps merged from the right", '''
def bpe_merge(ids, pair, new_id):
    out = []
    i = len(ids) - 1
    while i >= 0:
        if i >= 1 and ids[i - 1] == pair[0] and ids[i] == pair[1]:
            out.append(new_id)
            i -= 2
        else:
            out.append(ids[i])
            i -= 1
    return out[::-1]
''', {f"{MERGE}-visible", f"{MERGE}-overlap"}),
    (MERGE, "only the first occurrence replaced", '''
def bpe_merge(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == tuple(pair):
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)
''', {f"{MERGE}-visible", f"{MERGE}-overlap", f"{MERGE}-random"}),
    (MERGE, "the input list modified in place", '''
def bpe_merge(ids, pair, new_id):
    i = 0
    while i < len(ids) - 1:
        if ids[i] == pair[0] and ids[i + 1] == pair[1]:
            ids[i:i + 2] = [new_id]
        i += 1
    return ids
''', {f"{MERGE}-visible", f"{MERGE}-random"}),
    (MERGE, "correct: str.replace on ids written as characters", '''
def bpe_merge(ids, pair, new_id):
    as_text = "".join(chr(0x10000 + i) for i in ids)
    return [ord(c) - 0x10000 for c in as_text.replace(chr(0x10000 + pair[0]) + chr(0x10000 + pair[1]), chr(0x10000 + new_id))]
''', set()),
    # exercise 2: the trainer
    (TRAIN, "ties to the pair counted first (max(counts, key=counts.get))", naive((CHOOSE, "pair = max(counts, key=counts.get)")),
     {f"{TRAIN}-visible", f"{TRAIN}-ties"}),
    (TRAIN, "ties to the largest pair", naive((CHOOSE, "pair = max(counts, key=lambda p: (counts[p], p))")),
     {f"{TRAIN}-visible", f"{TRAIN}-ties"}),
    (TRAIN, "a run counted as the merges it allows ('aaa' holds (a, a) once)", naive((COUNT, """for p in set(zip(ids, ids[1:])):
                counts[p] = counts.get(p, 0) + n * (len(ids) - len(bpe_merge(ids, p, -1)))""")),
     {f"{TRAIN}-visible", f"{TRAIN}-bytes"}),
    (TRAIN, "characters instead of UTF-8 bytes", naive(('list(chunk.encode("utf-8"))', "[ord(c) for c in chunk]")),
     {f"{TRAIN}-visible", f"{TRAIN}-bytes"}),
    (TRAIN, "each distinct chunk counted once", naive((COUNT, "count_pairs(ids, counts)")), {f"{TRAIN}-visible", f"{TRAIN}-bytes"}),
    (TRAIN, "no stop when no pair is left (min of an empty dict)", naive(("        if not counts:\n            break\n", "")),
     {f"{TRAIN}-visible", f"{TRAIN}-stop"}),
    (TRAIN, "no ValueError below 256", naive(('    if vocab_size < 256:\n        raise ValueError(f"vocab_size must be at least 256, got {vocab_size}")\n', "")),
     {f"{TRAIN}-visible", f"{TRAIN}-stop"}),
    (TRAIN, "one merge too many (vocab_size - 255)", naive(("while len(merges) < vocab_size - 256:", "while len(merges) <= vocab_size - 256:")),
     TRAIN_ALL),
    (TRAIN, "no pre-tokenization: merges across chunks", naive(("Counter(pretokenize(text))", "Counter([text])")),
     {f"{TRAIN}-visible", f"{TRAIN}-ties", f"{TRAIN}-stop"}),
    (TRAIN, "pairs counted once, never recounted after a merge", naive(
        ("    while len(merges) < vocab_size - 256:\n        counts = {}\n        for ids, n in words:\n            count_pairs(ids, counts, n)\n",
         "    counts = {}\n    for ids, n in words:\n        count_pairs(ids, counts, n)\n    while len(merges) < vocab_size - 256:\n"),
        ("        merges[pair] = 256 + len(merges)\n", "        merges[pair] = 256 + len(merges)\n        del counts[pair]\n")),
     TRAIN_ALL),
    (TRAIN, "correct: naive, every pair recounted after every merge", naive(), set()),
    (TRAIN, "correct: the tie rule as max with negated ids, every chunk occurrence on its own", naive(
        (CHOOSE, "pair = max(counts, key=lambda p: (counts[p], -p[0], -p[1]))"),
        ("for chunk, n in Counter(pretokenize(text)).items()", "for chunk, n in ((chunk, 1) for chunk in pretokenize(text))")), set()),
    # exercise 3: the encoder
    (ENCODE, "merges by frequency in the text, not by rank", mutate(ENCODE, (RANK, '''counts = count_pairs(chunk_ids)
            known = [p for p in counts if p in merges]
            pair = max(known, key=lambda p: counts[p]) if known else (-1, -1)''')),
     {f"{ENCODE}-visible", f"{ENCODE}-rank", f"{ENCODE}-hf"}),
    (ENCODE, "no pre-tokenization: merges across chunk boundaries", mutate(ENCODE, ("for chunk in pretokenize(text):", "for chunk in [text]:")),
     {f"{ENCODE}-visible", f"{ENCODE}-boundary", f"{ENCODE}-hf"}),
    (ENCODE, "leftmost known pair first", mutate(ENCODE, (RANK, "pair = next((p for p in zip(chunk_ids, chunk_ids[1:]) if p in merges), (-1, -1))")),
     {f"{ENCODE}-visible", f"{ENCODE}-rank", f"{ENCODE}-hf"}),
    (ENCODE, "correct: each merge once, in the order learned", '''
def bpe_encode(text, merges):
    ids = []
    for chunk in pretokenize(text):
        chunk_ids = list(chunk.encode("utf-8"))
        for pair, new_id in sorted(merges.items(), key=lambda item: item[1]):
            chunk_ids = bpe_merge(chunk_ids, pair, new_id)
        ids += chunk_ids
    return ids
''', set()),
    # exercise 4: the decoder
    (DECODE, "each token decoded on its own (errors replaced)", mutate(DECODE, (
        'return b"".join(vocab[int(i)] for i in ids).decode("utf-8", errors="replace")',
        'return "".join(vocab[int(i)].decode("utf-8", errors="replace") for i in ids)')),
     {f"{DECODE}-visible", f"{DECODE}-utf8"}),
    (DECODE, "each token decoded on its own (strict)", mutate(DECODE, (
        'return b"".join(vocab[int(i)] for i in ids).decode("utf-8", errors="replace")',
        'return "".join(vocab[int(i)].decode("utf-8") for i in ids)')),
     {f"{DECODE}-visible", f"{DECODE}-utf8"}),
    (DECODE, "correct: an incremental decoder", '''
import codecs

def bpe_decode(ids, vocab):
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return "".join(decoder.decode(vocab[int(i)]) for i in ids) + decoder.decode(b"", final=True)
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {MERGE, TRAIN, ENCODE, DECODE}
    assert {e: len(cells_of(e)) for e in REFERENCE} == {MERGE: 3, TRAIN: 4, ENCODE: 4, DECODE: 2}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS


@pytest.mark.parametrize("exercise", [MERGE, TRAIN, ENCODE, DECODE])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
