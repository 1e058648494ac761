"""Visible checks of chapter 09 (byte-level BPE), and the independent oracles they compare against.

Oracles: Python's own ``str.replace`` for a merge (non-overlapping, left to right, on ids written as
characters), Hugging Face ``tokenizers``' BPE model given the same merges for encoding, and the original
text for decoding; never course_lib.bpe's reference solutions.
"""
from __future__ import annotations

from .core import fail, passed

__all__ = ["check_bpe_merge", "check_bpe_encode", "check_bpe_decode", "merge_oracle", "hf_encode_oracle",
           "hf_trained_merges", "vocab_oracle"]

_OFFSET = 0x10000  # ids written as characters from U+10000 on, so that any id < 0xFFFFF is one character


def merge_oracle(ids, pair, new_id) -> list[int]:
    """bpe_merge by str.replace: the ids as characters, every occurrence of the pair replaced, left to right,
    without overlaps (what str.replace does)."""
    text = "".join(chr(_OFFSET + i) for i in ids)
    merged = text.replace(chr(_OFFSET + pair[0]) + chr(_OFFSET + pair[1]), chr(_OFFSET + new_id))
    return [ord(c) - _OFFSET for c in merged]


def _byte_level_chars() -> dict[int, str]:
    """Hugging Face ByteLevel's character for each byte, from its own alphabet: a byte whose Latin-1 character is in
    the alphabet stands for itself, the others take the remaining characters in order (GPT-2's construction)."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    own = {b: chr(b) for b in range(256) if chr(b) in alphabet}
    rest = sorted(alphabet - set(own.values()))
    others = [b for b in range(256) if b not in own]
    return {**own, **dict(zip(others, rest))}


def vocab_oracle(merges: dict) -> dict:
    """{id: bytes} for merges {(a, b): new_id}: 256 single bytes, then each merge's bytes in the order of new ids."""
    vocab = {i: bytes([i]) for i in range(256)}
    for (a, b), new_id in sorted(merges.items(), key=lambda item: item[1]):
        vocab[new_id] = vocab[a] + vocab[b]
    return vocab


def hf_encode_oracle(text: str, merges: dict) -> list[int]:
    """Hugging Face tokenizers' BPE with OUR merges and ids (GPT-2 byte-level pre-tokenization, no prefix space)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = _byte_level_chars()
    vocab = vocab_oracle(merges)
    token = {i: "".join(chars[b] for b in data) for i, data in vocab.items()}
    ordered = sorted(merges.items(), key=lambda item: item[1])
    model = models.BPE(vocab={s: i for i, s in token.items()}, merges=[(token[a], token[b]) for (a, b), _ in ordered])
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tokenizer.encode(text).ids


def hf_trained_merges(text: str, vocab_size: int) -> dict:
    """Merges {(a, b): new_id} (our ids: bytes 0..255, then 256, 257, ... in order) learned by Hugging Face's
    BpeTrainer on text with byte-level pre-tokenization."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {c: b for b, c in _byte_level_chars().items()}
    ids = {bytes([b]): b for b in range(256)}
    merges = {}
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        a, b = (bytes(byte_of[c] for c in s) for s in (left, right))
        merges[(ids[a], ids[b])] = ids[a + b] = 256 + len(merges)
    return merges


def _call(fn, name, *args):
    try:
        return fn(*args)
    except UnicodeDecodeError as error:
        fail(f"{name} raised UnicodeDecodeError ({error.reason} at byte {error.start}): a token's bytes need not be "
             "a whole character; join the bytes of ALL tokens first, then decode once")


def _as_ids(result, name, what):
    if not isinstance(result, list) or not all(isinstance(i, int) for i in result):
        fail(f"{name} should return a list of ints, got {type(result).__name__} ({what})")
    return result


def check_bpe_merge(bpe_merge) -> None:
    """Visible checks for chapter 09, exercise 1: replacement, left to right, no overlaps, input untouched."""
    ids = [1, 2, 3, 1, 2]
    got = _as_ids(bpe_merge(ids, (1, 2), 9), "bpe_merge", "[1, 2, 3, 1, 2]")
    if got == [9, 3, 1, 2]:
        fail("bpe_merge([1, 2, 3, 1, 2], (1, 2), 9) returned [9, 3, 1, 2], expected [9, 3, 9]: you replaced only the "
             "first occurrence of the pair; replace every occurrence, scanning the whole list")
    if got != [9, 3, 9]:
        fail(f"bpe_merge([1, 2, 3, 1, 2], (1, 2), 9) returned {got}, expected [9, 3, 9]")
    if ids != [1, 2, 3, 1, 2]:
        fail(f"bpe_merge changed its input list to {ids}: build and return a new list")
    for case, expected in (([5, 5, 5], [9, 5]), ([5, 5, 5, 5], [9, 9]), ([7, 5, 5, 5, 7], [7, 9, 5, 7])):
        got = _as_ids(bpe_merge(list(case), (5, 5), 9), "bpe_merge", str(case))
        if got != expected:
            fail(f"bpe_merge({case}, (5, 5), 9) returned {got}, expected {expected}: occurrences overlap here; once the "
                 "first two 5s are merged, the next 5 can only pair with the one after it (scan left to right, and "
                 "skip past a pair you merged)")
    for case, pair, expected in (([], (1, 2), []), ([1], (1, 2), [1]), ([2, 1], (1, 2), [2, 1]), ([3, 1, 2], (1, 2), [3, 9])):
        got = _as_ids(bpe_merge(list(case), pair, 9), "bpe_merge", str(case))
        if got != expected:
            fail(f"bpe_merge({case}, {pair}, 9) returned {got}, expected {expected}")
    import random

    rng = random.Random(901)
    for case in range(200):
        ids = [rng.randrange(3) for _ in range(rng.randrange(12))]
        pair = (rng.randrange(3), rng.randrange(3))
        got = _as_ids(bpe_merge(list(ids), pair, 7), "bpe_merge", f"random case {case}")
        if got != merge_oracle(ids, pair, 7):
            fail(f"bpe_merge({ids}, {pair}, 7) returned {got}, expected {merge_oracle(ids, pair, 7)}")
    passed("bpe_merge")


def check_bpe_encode(bpe_encode) -> None:
    """Visible checks for chapter 09, exercise 2: bytes, rank order, chunk boundaries, Hugging Face parity."""
    got = _as_ids(bpe_encode("héllo", {}), "bpe_encode", "no merges")
    if got != list("héllo".encode("utf-8")):
        fail(f"with no merges, bpe_encode('héllo', {{}}) must return the UTF-8 bytes {list('héllo'.encode('utf-8'))}, "
             f"got {got}")
    merges = {(97, 98): 256, (98, 99): 257}  # 'a' 'b' learned first, then 'b' 'c'
    got = _as_ids(bpe_encode("abcbc", merges), "bpe_encode", "abcbc")
    latest_first = [257, 99, 256]  # 'abcbc' with 'b' 'c' learned first: what merging the latest-learned pair first gives
    if got == [97, 257, 257] and _as_ids(bpe_encode("abcbc", {(98, 99): 256, (97, 98): 257}), "bpe_encode",
                                         "abcbc") == latest_first:
        fail("bpe_encode('abcbc', {(97, 98): 256, (98, 99): 257}) returned [97, 257, 257]: you merged the pair with the "
             "HIGHEST rank (the latest learned, new id 257) first; merges are applied lowest rank first, the order they "
             "were learned: (97, 98) -> 256 first, giving [256, 99, 257]")
    if got == [97, 257, 257]:
        fail("bpe_encode('abcbc', {(97, 98): 256, (98, 99): 257}) returned [97, 257, 257]: you merged the most frequent pair "
             "('b', 'c' twice) first, but merges are applied by rank, the order they were learned: (97, 98) -> 256 first, "
             "giving [256, 99, 257]")
    if got != [256, 99, 257]:
        fail(f"bpe_encode('abcbc', {{(97, 98): 256, (98, 99): 257}}) returned {got}, expected [256, 99, 257] (merge the "
             "lowest-ranked pair present, again and again)")
    got = _as_ids(bpe_encode("abc", {(98, 99): 256, (97, 98): 257}), "bpe_encode", "abc")
    if got != [97, 256]:
        fail(f"bpe_encode('abc', {{(98, 99): 256, (97, 98): 257}}) returned {got}, expected [97, 256]: 'b' + 'c' was learned "
             "first (the lower new id), so it is merged first, even though 'a' + 'b' comes first in the text")
    got = _as_ids(bpe_encode("the cat", {(101, 32): 256}), "bpe_encode", "the cat")
    if 256 in got:
        fail(f"bpe_encode('the cat', {{(101, 32): 256}}) returned {got}: the merge 'e' + ' ' crossed a pre-tokenization "
             "boundary ('the' | ' cat'); encode each chunk of pretokenize(text) on its own")
    if got != list(b"the cat"):
        fail(f"bpe_encode('the cat', {{(101, 32): 256}}) returned {got}, expected the bytes {list(b'the cat')}")
    text = ("The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
            "or other iterable object. Naïve café: 3.14159 != 2.71828;  \n\n    indented\tline. 日本語 🙂")
    merges = hf_trained_merges(text * 3, 330)
    for sample in (text, "aaaa bbbb   the the the", "iterate iterable iteration"):
        got = _as_ids(bpe_encode(sample, merges), "bpe_encode", "Hugging Face parity")
        expected = hf_encode_oracle(sample, merges)
        if got != expected:
            first = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))
            fail(f"on {sample[:40]!r}... your ids differ from Hugging Face tokenizers' with the same merges, first at "
                 f"token {first}: yours {got[first:first + 5]}, theirs {expected[first:first + 5]} "
                 f"({len(got)} tokens vs {len(expected)})")
    passed("bpe_encode")


def check_bpe_decode(bpe_decode) -> None:
    """Visible checks for chapter 09, exercise 3: bytes joined, then decoded; characters split over tokens."""
    merges = {(104, 105): 256, (256, 33): 257, (0xC3, 0xA9): 258, (0xE6, 0x97): 259}
    vocab = vocab_oracle(merges)
    for ids, expected in (([104, 105], "hi"), ([257], "hi!"), ([256, 32, 258], "hi é"), ([], "")):
        got = _call(bpe_decode, "bpe_decode", ids, vocab)
        if not isinstance(got, str):
            fail(f"bpe_decode should return a str, got {type(got).__name__}")
        if got != expected:
            fail(f"bpe_decode({ids}, vocab) returned {got!r}, expected {expected!r}")
    for ids, expected, what in (([0xC3, 0xA9], "é", "'é' as its two bytes"), ([259, 0xA5], "日", "'日' split after 2 of its 3 bytes"),
                                ([0xF0, 0x9F, 0x99, 0x82], "🙂", "'🙂' as its four bytes")):
        got = _call(bpe_decode, "bpe_decode", ids, vocab)
        if got != expected:
            fail(f"bpe_decode({ids}, vocab) returned {got!r}, expected {expected!r} ({what}): a token's bytes need not "
                 "be a whole character; join the bytes of ALL tokens first, then decode UTF-8 once")
    # a model may emit bytes that are not UTF-8 (a character cut short, a stray continuation byte): each bad
    # sequence becomes U+FFFD, as bytes.decode("utf-8", errors="replace") and Hugging Face's GPT-2 tokenizer do
    ids, expected = [104, 0xE6, 0x97, 105, 0xA9], "h\ufffdi\ufffd"
    try:
        got = bpe_decode(ids, vocab)
    except UnicodeDecodeError:
        fail(f"bpe_decode({ids}, vocab) raised UnicodeDecodeError: bytes that are not UTF-8 must become '\\ufffd' "
             "(decode with errors=\"replace\"), not stop the decoding")
    if got != expected:
        fail(f"bpe_decode({ids}, vocab) returned {got!r}, expected {expected!r}: each byte sequence that is not UTF-8 "
             "becomes one '\\ufffd' (errors=\"replace\"); dropping it (errors=\"ignore\") hides it")
    passed("bpe_decode")
