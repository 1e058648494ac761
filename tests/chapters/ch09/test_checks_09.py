"""Chapter 09's learner-facing checks: the reference passes; each classic bug gets a specific message; the oracles
agree with Hugging Face tokenizers and with course_lib.bpe."""
from __future__ import annotations

import pytest

from course_lib import bpe, checks
from course_lib.data import default_corpus


def test_the_oracles_agree_with_hugging_face_and_the_reference():
    text = default_corpus()[:60_000]
    merges = checks.hf_trained_merges(text, 400)
    assert merges == bpe.merges_from_hf(bpe.train_hf_bpe(text, 400))
    sample = default_corpus()[-5_000:] + " naïve 日本語 🙂"
    assert checks.hf_encode_oracle(sample, merges) == bpe.bpe_encode(sample, merges)
    assert checks.vocab_oracle(merges) == bpe.vocab_from_merges(merges)
    assert checks.merge_oracle([5, 5, 5, 1, 5, 5], (5, 5), 9) == [9, 5, 1, 9]


def overlapping_merge(ids, pair, new_id):
    out = list(ids)
    for i in reversed([i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) == tuple(pair)]):
        out[i:i + 2] = [new_id]
    return out


def mutating_merge(ids, pair, new_id):
    out = bpe.bpe_merge(ids, pair, new_id)
    ids[:] = out
    return out


def first_occurrence_merge(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == tuple(pair):
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)


def overlaps_from_the_right(ids, pair, new_id):
    out, i = [], len(ids) - 1
    while i >= 0:
        if i >= 1 and (ids[i - 1], ids[i]) == tuple(pair):
            out.append(new_id)
            i -= 2
        else:
            out.append(ids[i])
            i -= 1
    return out[::-1]


def leftmost_encode(text, merges):
    ids = []
    for chunk in bpe.pretokenize(text):
        chunk_ids = list(chunk.encode("utf-8"))
        while (pair := next((p for p in zip(chunk_ids, chunk_ids[1:]) if p in merges), None)) is not None:
            chunk_ids = bpe.bpe_merge(chunk_ids, pair, merges[pair])
        ids += chunk_ids
    return ids


def highest_rank_encode(text, merges):
    ids = []
    for chunk in bpe.pretokenize(text):
        chunk_ids = list(chunk.encode("utf-8"))
        while (pair := max(zip(chunk_ids, chunk_ids[1:]), key=lambda p: merges.get(p, -1), default=None)) in merges:
            chunk_ids = bpe.bpe_merge(chunk_ids, pair, merges[pair])
        ids += chunk_ids
    return ids


def frequency_encode(text, merges):
    ids = []
    for chunk in bpe.pretokenize(text):
        chunk_ids = list(chunk.encode("utf-8"))
        while True:
            counts = bpe.count_pairs(chunk_ids)
            known = [p for p in counts if p in merges]
            if not known:
                break
            pair = max(known, key=counts.get)
            chunk_ids = bpe.bpe_merge(chunk_ids, pair, merges[pair])
        ids += chunk_ids
    return ids


def _whole(text, merges):
    ids = list(text.encode("utf-8"))
    for pair, new_id in sorted(merges.items(), key=lambda item: item[1]):
        ids = bpe.bpe_merge(ids, pair, new_id)
    return ids


def per_token_decode(ids, vocab):
    return "".join(vocab[i].decode("utf-8", errors="replace") for i in ids)


def strict_per_token_decode(ids, vocab):
    return "".join(vocab[i].decode("utf-8") for i in ids)


def strict_decode(ids, vocab):
    return b"".join(vocab[i] for i in ids).decode("utf-8")


def ignoring_decode(ids, vocab):
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="ignore")


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_bpe_merge, overlapping_merge, r"returned \[9\], expected \[9, 5\]: occurrences overlap here"),
    (checks.check_bpe_merge, first_occurrence_merge, r"returned \[9, 3, 1, 2\], .*you replaced only the first occurrence"),
    (checks.check_bpe_merge, overlaps_from_the_right, r"returned \[5, 9\], expected \[9, 5\]: occurrences overlap here"),
    (checks.check_bpe_merge, mutating_merge, r"changed its input list to \[9, 3, 9\]: build and return a new list"),
    (checks.check_bpe_encode, frequency_encode, r"you merged the most frequent pair .* merges are applied by rank"),
    (checks.check_bpe_encode, highest_rank_encode, r"you merged the pair with the HIGHEST rank \(the latest learned"),
    (checks.check_bpe_encode, leftmost_encode, r"returned \[257, 99\], expected \[97, 256\]: 'b' \+ 'c' was learned first"),
    (checks.check_bpe_encode, _whole, r"the merge 'e' \+ ' ' crossed a pre-tokenization boundary"),
    (checks.check_bpe_decode, per_token_decode, r"returned '��', expected 'é' .* join the bytes of ALL tokens first"),
    (checks.check_bpe_decode, strict_per_token_decode, r"raised UnicodeDecodeError .* join the bytes of ALL tokens first"),
    (checks.check_bpe_decode, strict_decode, r"raised UnicodeDecodeError: bytes that are not UTF-8 must become '\\ufffd'"),
    (checks.check_bpe_decode, ignoring_decode, r"returned 'hi', expected 'h\ufffdi\ufffd': .* dropping it \(errors=\"ignore\"\)"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)
