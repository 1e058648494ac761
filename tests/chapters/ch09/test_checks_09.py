"""Chapter 09's learner-facing checks: the reference passes; each classic bug gets a specific message; the oracles
agree with Hugging Face tokenizers and with course_lib.bpe."""
from __future__ import annotations

from collections import Counter

import pytest

from course_lib import bpe, checks, hf
from course_lib.data import default_corpus


def test_the_oracles_agree_with_hugging_face_and_the_reference():
    text = default_corpus()[:60_000]
    merges = checks.hf_trained_merges(text, 400)
    assert merges == hf.merges_from_hf(hf.train_hf_bpe(text, 400))
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


def naive_trainer(choose=lambda counts: min(counts, key=lambda p: (-counts[p], p)), chunk_ids=lambda chunk: list(chunk.encode("utf-8")),
                  weighted=True, overlaps=True, pretokenized=True, stops=True, extra=0, recount=True, checks_size=True,
                  min_count=1):
    """A learner's trainer (every pair recounted after every merge), correct with the defaults; each option plants one bug."""
    def train_bpe(text, vocab_size):
        if checks_size and vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256, got {vocab_size}")
        words = [[chunk_ids(chunk), n if weighted else 1] for chunk, n in Counter(bpe.pretokenize(text) if pretokenized else [text]).items()]
        merges, counts = {}, {}
        while len(merges) < vocab_size - 256 + extra:
            if recount or not merges:
                counts = {}
                for ids, n in words:
                    for pair in (zip(ids, ids[1:]) if overlaps else set(zip(ids, ids[1:]))):
                        counts[pair] = counts.get(pair, 0) + n * (1 if overlaps else len(ids) - len(bpe.bpe_merge(ids, pair, -1)))
            if (not counts or max(counts.values()) < min_count) and stops:
                break
            pair = choose(counts)
            merges[pair] = 256 + len(merges)
            counts.pop(pair)
            for word in words:
                word[0] = bpe.bpe_merge(word[0], pair, merges[pair])
        return merges
    return train_bpe


def bytes_tie_trainer(text, vocab_size):
    """A naive trainer that breaks ties by the pairs' bytes instead of their ids: the same as ids until a merged token ties."""
    words = [[list(chunk.encode("utf-8")), n] for chunk, n in Counter(bpe.pretokenize(text)).items()]
    merges, vocab = {}, {i: bytes([i]) for i in range(256)}
    while len(merges) < vocab_size - 256:
        counts = {}
        for ids, n in words:
            bpe.count_pairs(ids, counts, n)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], vocab[p[0]], vocab[p[1]]))
        merges[pair] = 256 + len(merges)
        vocab[merges[pair]] = vocab[pair[0]] + vocab[pair[1]]
        for word in words:
            word[0] = bpe.bpe_merge(word[0], pair, merges[pair])
    return merges


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
    (checks.check_train_bpe, naive_trainer(choose=lambda counts: max(counts, key=counts.get)),
     r"train_bpe\('low lower newest widest', 262\): merge 0 \(new id 256\) is yours \(108, 111\) \(b'l' \+ b'o'\), expected "
     r"\(101, 115\) \(b'e' \+ b's'\): both occur 2 times, the most, a tie; a tie goes to the smallest pair"),
    (checks.check_train_bpe, naive_trainer(choose=lambda counts: max(counts, key=lambda p: (counts[p], p))),
     r"is yours \(119, 101\) .* a tie goes to the smallest pair \(a, b\), compared as tuples \(\(101, 115\) < \(119, 101\)\)"),
    (checks.check_train_bpe, bytes_tie_trainer,
     r"merge 1 \(new id 257\) is yours \(256, 116\) .* a tie; .* nor to the pair whose bytes sort first"),
    (checks.check_train_bpe, naive_trainer(overlaps=False),
     r"train_bpe\('zzzz abab', 258\): .* yours occurs 2 times in the text, the expected 3\. Count a pair at every position"),
    (checks.check_train_bpe, naive_trainer(chunk_ids=lambda chunk: [ord(c) for c in chunk]),
     r"train_bpe\('日本語 日本 ñoño', 260\): .* start as its UTF-8 bytes \(chunk.encode\('utf-8'\), 0..255\), not its characters"),
    (checks.check_train_bpe, naive_trainer(weighted=False), r"A chunk counts as often as it occurs in the text"),
    (checks.check_train_bpe, naive_trainer(pretokenized=False),
     r"whose bytes b'k\\n' are in no chunk of pretokenize\(text\): count and merge pairs inside each chunk, never across"),
    (checks.check_train_bpe, naive_trainer(recount=False),
     r"merges 0..1 agree; merge 2 .* which no longer occurs once merges 0..1 are applied: count the pairs again"),
    (checks.check_train_bpe, naive_trainer(stops=False),
     r"train_bpe\('abab', 1000\) raised ValueError: .* training stops early, below vocab_size"),
    (checks.check_train_bpe, naive_trainer(min_count=2),
     r"returned \d+ merges, expected \d+: you stopped when the most frequent pair occurs only once .* A pair that occurs once is still merged"),
    (checks.check_train_bpe, naive_trainer(extra=1), r"returned 7 merges, expected 6: .* so vocab_size - 256 merges"),
    (checks.check_train_bpe, naive_trainer(extra=-1), r"returned 5 merges, expected 6: the vocabulary is the 256 bytes plus"),
    (checks.check_train_bpe, naive_trainer(checks_size=False), r"train_bpe\('abc', 255\) returned \{\}, expected ValueError"),
    (checks.check_train_bpe, lambda text, vocab_size: list(bpe.train_bpe(text, vocab_size).items()), r"should return a dict"),
    (checks.check_train_bpe, lambda text, vocab_size: {p: i - 1 for p, i in bpe.train_bpe(text, vocab_size).items()},
     r"the new ids should be 256, 257, ... in the order the merges were learned"),
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


@pytest.mark.parametrize("trainer", [
    naive_trainer(),
    naive_trainer(choose=lambda counts: max(counts, key=lambda p: (counts[p], -p[0], -p[1]))),
    naive_trainer(choose=lambda counts: sorted(counts.items(), key=lambda item: (-item[1], item[0]))[0][0]),
], ids=["naive", "max with negated ids", "sorted"])
def test_correct_trainers_pass(trainer, capsys):
    checks.check_train_bpe(trainer)
    assert "all visible checks passed" in capsys.readouterr().out


def test_the_trainer_oracle_is_hugging_faces_in_either_order_and_ours_in_our_order():
    text = default_corpus()[:20_000] + " aaaa aaa 日本語 🙂🙂"
    merges, vocab = checks.hf_trainer_oracle(text, 400, order="hf")
    assert merges == hf.merges_from_hf(hf.train_hf_bpe(text, 400)) and vocab != checks.vocab_oracle(merges)  # its own ids
    merges, vocab = checks.hf_trainer_oracle(text, 400, order="bytes")
    assert list(merges.items()) == list(bpe.train_bpe(text, 400).items()) and vocab == checks.vocab_oracle(merges)
    with pytest.raises(ValueError, match="order must be 'hf' or 'bytes'"):
        checks.hf_trainer_oracle(text, 300, order="ids")
