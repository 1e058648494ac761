"""course_lib.bpe against independent oracles: Hugging Face ``tokenizers`` (pre-tokenization, training, encoding,
decoding), transformers' copy of GPT-2's byte map, a from-scratch recount of pair counts, and the text itself."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from course_lib import bpe, checks, hf
from course_lib.data import default_corpus
from course_lib.pretrain import VAL_FRACTION

ADVERSARIAL = [
    "", "a", "aaaa", "aaa aaa aaaaa", "  leading spaces", "trailing spaces   ", "\n\n\t\r\n", "tabs\tand\u00a0nbsp",
    "naïve café déjà vu", "日本語のテキストです", "emoji 🙂 family 👩‍👩‍👧 flag 🇫🇷", "e\u0301 combining", "\x00\x01\x7f\x1b[0m",
    "zero\u200bwidth", "it's we're they've I'm you'll he'd", "123 4567.89 1e-9", "x" * 500, "שלום עולם", "Ünïcödé\U0010ffff",
    "'s's's", "a\u2028b\u2029c", "   \n   \n", "\ufeffbom",
]


@pytest.fixture(scope="module")
def corpus():
    text = default_corpus()
    cut = int(len(text) * (1 - VAL_FRACTION))
    return text[:cut], text[cut:]


@pytest.fixture(scope="module")
def hf512(corpus):
    return hf.train_hf_bpe(corpus[0], 512)


def test_pretokenize_equals_hugging_face_byte_level_on_the_corpus_and_adversarial_strings(corpus):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # one help topic at a time: Hugging Face's pre_tokenize_str takes time quadratic in the string's length
    for text in [*(corpus[0] + corpus[1]).split("\n\n"), *ADVERSARIAL]:
        ours = [chunk.encode("utf-8") for chunk in bpe.pretokenize(text)]
        assert ours == [hf.hf_token_bytes(chunk) for chunk, _ in byte_level.pre_tokenize_str(text)], text[:50]
        assert "".join(bpe.pretokenize(text)) == text


def test_byte_map_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert hf.bytes_to_unicode() == bytes_to_unicode()
    from tokenizers import pre_tokenizers

    assert set(hf.bytes_to_unicode().values()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_count_pairs_counts_every_position():
    assert bpe.count_pairs([5, 5, 5]) == {(5, 5): 2}
    assert bpe.count_pairs([1, 2, 1, 2], weight=3) == {(1, 2): 6, (2, 1): 3}
    counts = bpe.count_pairs([1, 2])
    assert bpe.count_pairs([2, 1], counts) is counts and counts == {(1, 2): 1, (2, 1): 1}
    assert bpe.count_pairs([]) == {} and bpe.count_pairs([7]) == {}


@pytest.mark.parametrize("ids,pair,expected", [
    ([5, 5, 5], (5, 5), [9, 5]), ([5, 5, 5, 5], (5, 5), [9, 9]), ([1, 2, 3, 1, 2], (1, 2), [9, 3, 9]),
    ([], (1, 2), []), ([1], (1, 2), [1]), ([2, 1], (1, 2), [2, 1]),
])
def test_bpe_merge_is_left_to_right_without_overlaps(ids, pair, expected):
    assert bpe.bpe_merge(ids, pair, 9) == expected


def test_bpe_merge_equals_str_replace_on_random_cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        ids = torch.randint(0, 3, (int(torch.randint(0, 15, (1,), generator=gen)),), generator=gen).tolist()
        pair = tuple(torch.randint(0, 3, (2,), generator=gen).tolist())
        as_text = "".join("abc"[i] for i in ids).replace("abc"[pair[0]] + "abc"[pair[1]], "X")
        assert bpe.bpe_merge(ids, pair, 9) == ["abcX".index(c) if c != "X" else 9 for c in as_text]


def naive_train(text: str, vocab_size: int) -> dict:
    """The textbook trainer: recount every pair of every chunk occurrence from scratch at each step (slow, obvious)."""
    chunks = [list(chunk.encode("utf-8")) for chunk in bpe.pretokenize(text)]
    merges = {}
    while len(merges) < vocab_size - 256:
        counts = Counter()
        for ids in chunks:
            counts.update(zip(ids, ids[1:]))
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges[best] = 256 + len(merges)
        chunks = [bpe.bpe_merge(ids, best, merges[best]) for ids in chunks]
    return merges


def test_incremental_trainer_equals_the_naive_one(corpus):
    text = corpus[0][:8_000] + "aaaa aaa aaaaa abababab " * 20 + "日本語 🙂🙂 " * 5
    assert bpe.train_bpe(text, 380) == naive_train(text, 380)
    assert bpe.train_bpe("ab ab", 1000) == {(97, 98): 256, (32, 256): 257}  # stops when no pair is left


@pytest.mark.parametrize("vocab_size", [300, 512, 1024])
def test_hugging_faces_trainer_shown_the_bytes_in_our_order_learns_our_merges(corpus, vocab_size):
    theirs, vocab = checks.hf_trainer_oracle(corpus[0], vocab_size, order="bytes")
    ours = bpe.train_bpe(corpus[0], vocab_size)
    assert list(ours.items()) == list(theirs.items()) and bpe.vocab_from_merges(ours) == vocab


def test_hugging_faces_trainer_in_our_order_agrees_on_adversarial_strings_until_the_pairs_run_out():
    for text in ADVERSARIAL:
        theirs, vocab = checks.hf_trainer_oracle(text * 3, 1000, order="bytes")
        ours = bpe.train_bpe(text * 3, 1000)
        assert list(ours.items()) == list(theirs.items()) and bpe.vocab_from_merges(ours) == vocab, text[:50]


def test_with_our_tie_rule_the_first_difference_is_a_tie(corpus, hf512):
    ours, theirs = bpe.train_bpe(corpus[0], 512), hf.merges_from_hf(hf512)
    step = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    counts = {}
    for chunk, freq in Counter(bpe.pretokenize(corpus[0])).items():
        ids = list(chunk.encode("utf-8"))
        for pair, new_id in list(ours.items())[:step]:
            ids = bpe.bpe_merge(ids, pair, new_id)
        bpe.count_pairs(ids, counts, freq)
    mine, hers = list(ours)[step], list(theirs)[step]
    assert counts[mine] == counts[hers] == max(counts.values()) and mine < hers


def test_our_encoder_with_hugging_faces_merges_gives_exactly_its_tokens(corpus, hf512):
    ours = bpe.BPETokenizer(hf.merges_from_hf(hf512))
    for text in [corpus[1], *ADVERSARIAL]:
        assert ours.token_bytes(bpe.bpe_encode(text, ours.merges)) == hf.hf_encode_bytes(hf512, text), text[:50]


def test_our_trained_vocabulary_compresses_within_one_percent_of_hugging_faces(corpus, hf512):
    for vocab_size, theirs in ((512, hf512), (1024, hf.train_hf_bpe(corpus[0], 1024))):
        ours = bpe.BPETokenizer.train(corpus[0], vocab_size)
        n_ours, n_hf = len(ours.encode(corpus[1])), len(theirs.encode(corpus[1]).ids)
        assert abs(n_ours / n_hf - 1) < 0.01, (vocab_size, n_ours, n_hf)


def test_round_trip_is_exact_on_the_corpus_and_adversarial_strings(corpus, hf512):
    tokenizer = bpe.BPETokenizer.train(corpus[0], 512)
    text = corpus[0] + corpus[1]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    for s in ADVERSARIAL:
        ids = tokenizer.encode(s)
        assert tokenizer.decode(ids) == s and hf512.decode(hf512.encode(s).ids) == s
        assert b"".join(tokenizer.token_bytes(ids)) == s.encode("utf-8")


def test_the_cached_encoder_equals_bpe_encode(corpus):
    tokenizer = bpe.BPETokenizer.train(corpus[0], 400)
    assert tokenizer.encode(corpus[1][:5000]) == bpe.bpe_encode(corpus[1][:5000], tokenizer.merges)


def test_the_tokenizer_takes_the_learners_functions_by_the_plug_in_rule():
    """Keywords named after the course functions they replace, defaulting to the course's own (no None fallback)."""
    import inspect

    parameters = inspect.signature(bpe.BPETokenizer).parameters
    assert parameters["bpe_encode"].default is bpe.bpe_encode and parameters["bpe_decode"].default is bpe.bpe_decode
    assert "encode" not in parameters and "decode" not in parameters


def test_the_tokenizer_runs_the_encode_and_decode_it_is_given():
    merges = {(104, 105): 256}  # 'h' 'i'
    calls = []

    def encode(text, merges):  # as a learner's bpe_encode, counting its calls
        calls.append(text)
        return bpe.bpe_encode(text, merges)

    tokenizer = bpe.BPETokenizer(merges, bpe_encode=encode, bpe_decode=lambda ids, vocab: "decoded")
    assert tokenizer.encode("hi hi") == [256, 32, 256] and calls == ["hi", " hi"]
    assert tokenizer.encode("hi") == [256] and calls == ["hi", " hi"]  # each distinct chunk encoded once
    assert tokenizer.decode([256]) == "decoded"
    assert bpe.BPETokenizer(merges).decode(tokenizer.encode("hi hi")) == "hi hi"  # the defaults: bpe_encode, bpe_decode


def test_decode_joins_bytes_before_decoding():
    vocab = bpe.vocab_from_merges({(0xE6, 0x97): 256})
    assert bpe.bpe_decode([256, 0xA5], vocab) == "日"
    assert bpe.bpe_decode([0xFF], vocab) == "\ufffd"  # not UTF-8: replaced, never an exception


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 256"):
        bpe.train_bpe("abc", 100)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 256"):
        bpe.train_bpe("abc", 300.0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\]"):
        bpe.BPETokenizer({(1, 2): 256}).decode([257])
    with pytest.raises(ValueError, match="merges must map pairs to the new ids"):
        bpe.BPETokenizer({(1, 2): 300})
    with pytest.raises(ValueError, match="text must be a str"):
        bpe.pretokenize(b"bytes")
    with pytest.raises(ValueError, match="merges must only use ids defined before them"):
        bpe.vocab_from_merges({(1, 300): 256})
