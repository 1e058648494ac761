"""Visible checks of chapter 09 (byte-level BPE), and the independent oracles they compare against.

Oracles: Python's own ``str.replace`` for a merge (non-overlapping, left to right, on ids written as
characters), Hugging Face ``tokenizers``' BpeTrainer shown the bytes in our order for training (merge for merge;
a from-scratch recount of the pairs names the first difference's cause), its BPE model given the same merges for
encoding, and the original text for decoding; never course_lib.bpe's reference solutions.
"""
from __future__ import annotations

from .core import call_learner, fail, passed

__all__ = ["check_bpe_merge", "check_train_bpe", "check_bpe_encode", "check_bpe_decode", "merge_oracle", "hf_encode_oracle",
           "hf_trained_merges", "hf_trainer_oracle", "vocab_oracle", "compare_training"]

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


def _hf_chunks(text: str) -> list[bytes]:
    """The chunks of text as Hugging Face's ByteLevel pre-tokenizer (GPT-2's pattern, no prefix space) cuts them."""
    from tokenizers import pre_tokenizers

    byte_of = {c: b for b, c in _byte_level_chars().items()}
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return [bytes(byte_of[c] for c in chunk) for chunk, _ in pre.pre_tokenize_str(text)]


def hf_trainer_oracle(text: str, vocab_size: int, order: str = "hf") -> tuple[dict, dict]:
    """What Hugging Face's BpeTrainer learns from text: merges {(a, b): new_id} in OUR ids (bytes 0..255, then 256,
    257, ... in the order learned), and its vocabulary {id: bytes} in ITS ids. It trains on the chunks of its
    ByteLevel pre-tokenizer, each byte written as one character, all 256 in the alphabet, no special tokens.

    order="hf": the bytes written as ByteLevel writes them, so its ids number the bytes in the order of those
    characters and a tie in the count goes to the smallest pair in that numbering (what ``hf.train_hf_bpe`` learns);
    order="bytes": byte b written as chr(256 + b), so that its alphabet, sorted by character, numbers the bytes
    0..255 as we do: its ids are ours, and its tie rule (the smallest pair of its ids) is ours."""
    import json

    from tokenizers import Tokenizer, models, trainers

    if order not in ("hf", "bytes"):
        raise ValueError(f"order must be 'hf' or 'bytes', got {order!r}")
    chars = _byte_level_chars() if order == "hf" else {b: chr(256 + b) for b in range(256)}
    byte_of = {c: b for b, c in chars.items()}
    words = ["".join(chars[b] for b in chunk) for chunk in _hf_chunks(text)]
    tokenizer = Tokenizer(models.BPE())  # no pre-tokenizer: each string it is given is one word
    tokenizer.train_from_iterator(words, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                                             initial_alphabet=sorted(chars.values())))
    ids = {bytes([b]): b for b in range(256)}
    merges = {}
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        a, b = (bytes(byte_of[c] for c in s) for s in (left, right))
        merges[(ids[a], ids[b])] = ids[a + b] = 256 + len(merges)
    vocab = {i: bytes(byte_of[c] for c in token) for token, i in tokenizer.get_vocab().items()}
    return merges, vocab


def hf_trained_merges(text: str, vocab_size: int, order: str = "hf") -> dict:
    """The merges of ``hf_trainer_oracle(text, vocab_size, order)``."""
    return hf_trainer_oracle(text, vocab_size, order)[0]


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


def _recount(chunks: list[bytes], merges: list, weighted: bool = True, overlaps: bool = True) -> dict:
    """Pair counts in chunks once merges [((a, b), new_id), ...] are applied (str.replace): every position of every
    chunk; with weighted=False each distinct chunk once; with overlaps=False a run "aaa" holds (a, a) once."""
    counts: dict = {}
    for chunk in (chunks if weighted else dict.fromkeys(chunks)):
        ids = list(chunk)
        for pair, new_id in merges:
            ids = merge_oracle(ids, pair, new_id)
        for pair in (zip(ids, ids[1:]) if overlaps else dict.fromkeys(zip(ids, ids[1:]))):
            counts[pair] = counts.get(pair, 0) + (1 if overlaps else len(ids) - len(merge_oracle(ids, pair, -1)))
    return counts


def _most(counts: dict, pair) -> bool:
    return counts.get(pair, 0) == max(counts.values(), default=0) > 0


def _train_call(text: str, vocab_size: int) -> str:
    shown = repr(text) if len(text) <= 40 else repr(text[:37]) + "..."
    return f"train_bpe({shown}, {vocab_size})"


def compare_training(train_bpe, text: str, vocab_size: int) -> None:
    """Fail, naming the first difference and its likely cause, unless train_bpe(text, vocab_size) returns Hugging Face's
    merges (bytes in our order, ``hf_trainer_oracle``), merge for merge in the order learned, and its vocabulary."""
    call = _train_call(text, vocab_size)
    got = call_learner(lambda: train_bpe(text, vocab_size), call, "with no pair left to merge (every chunk one token), "
                       "training stops early, below vocab_size", errors=(Exception,))
    if not isinstance(got, dict):
        fail(f"{call} should return a dict {{(a, b): new_id}}, got {type(got).__name__}")
    for pair, new_id in got.items():
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(i, int) for i in (*pair, new_id))):
            fail(f"{call} should map pairs of ids (a, b) to new ids (ints), got {pair!r}: {new_id!r}")
    expected, hf_vocab = hf_trainer_oracle(text, vocab_size, order="bytes")
    if list(got.items()) == list(expected.items()):
        vocab = vocab_oracle(got)
        if vocab != hf_vocab:  # cannot differ when the merges agree; checked all the same, as the hidden tests do
            fail(f"{call}: the vocabulary of your merges differs from Hugging Face's")
        return
    if list(got.values()) != list(range(256, 256 + len(got))):
        fail(f"{call}: the new ids should be 256, 257, ... in the order the merges were learned (the dict's order), "
             f"got {list(got.values())[:8]}")
    mine, theirs = list(got), list(expected)
    k = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    if k == len(theirs):
        if len(theirs) == vocab_size - 256:
            fail(f"{call} returned {len(mine)} merges, expected {len(theirs)}: the vocabulary is the 256 bytes plus the "
                 "merges, so vocab_size - 256 merges")
        fail(f"{call} returned {len(mine)} merges, expected {len(theirs)}: after those, no chunk has two tokens left, no "
             "pair to merge: training stops there, below vocab_size")
    if k == len(mine):
        left = _recount(_hf_chunks(text), list(expected.items())[:k])
        if left and max(left.values()) == 1 and len(mine) != vocab_size - 257:  # one short: more likely an off-by-one
            fail(f"{call} returned {len(mine)} merges, expected {len(theirs)}: you stopped when the most frequent pair "
                 f"occurs only once ({len(left)} pairs left, each once, e.g. {theirs[k]}, merge {k}). A pair that occurs "
                 "once is still merged, as Hugging Face's trainer does: stop only when no pair is left or the vocabulary "
                 "has vocab_size tokens")
        fail(f"{call} returned {len(mine)} merges, expected {len(theirs)}: the vocabulary is the 256 bytes plus "
             "vocab_size - 256 merges (fewer only when no pair is left)")
    chunks = _hf_chunks(text)
    before = list(expected.items())[:k]
    vocab = vocab_oracle(dict(before))
    counts = _recount(chunks, before)
    yours, right = mine[k], theirs[k]

    def show(pair):
        return f"{pair} ({vocab[pair[0]]!r} + {vocab[pair[1]]!r})" if all(i in vocab for i in pair) else str(pair)

    agree, after = ("", "in the text") if k == 0 else (f" merges 0..{k - 1} agree;", f"once merges 0..{k - 1} are applied")
    head = f"{call}:{agree} merge {k} (new id {256 + k}) is yours {show(yours)}, expected {show(right)}"
    unknown = [i for i in yours if i not in vocab]
    if unknown or (not text.isascii() and counts.get(yours, 0) == 0 and max(yours) < 256 and chr(yours[0]) + chr(yours[1]) in text):
        fail(f"{head}: the ids of a chunk start as its UTF-8 bytes (chunk.encode('utf-8'), 0..255), not its characters "
             + (f"(id {unknown[0]} is neither a byte nor a merge learned before)" if unknown else f"({chr(yours[0]) + chr(yours[1])!r})"))
    if counts.get(yours, 0) == counts[right]:
        fail(f"{head}: both occur {counts[right]} times, the most, a tie; a tie goes to the smallest pair (a, b), "
             f"compared as tuples ({min(yours, right)} < {max(yours, right)}), not to the pair counted first or last"
             + (", nor to the pair whose bytes sort first (a merged token's id is its rank, not its bytes)"
                if max(*yours, *right) >= 256 else ""))
    if counts.get(yours, 0) == 0:
        token = vocab[yours[0]] + vocab[yours[1]] if not unknown else b""
        if not any(token in chunk for chunk in chunks):
            fail(f"{head}, whose bytes {token!r} are in no chunk of pretokenize(text): count and merge pairs inside each "
                 "chunk, never across a chunk boundary")
        fail(f"{head}, which no longer occurs {after}: count the pairs again (or update the counts) after each merge")
    why = f"{head}: yours occurs {counts.get(yours, 0)} times {after}, the expected {counts[right]}"
    if _most(_recount(chunks, before, overlaps=False), yours):
        fail(f"{why}. Count a pair at every position, as count_pairs does: a run 'aaa' holds (97, 97) twice, even "
             "though a merge can take it only once")
    if _most(_recount(chunks, before, weighted=False), yours):
        fail(f"{why}. A chunk counts as often as it occurs in the text: a word repeated 4 times adds its pairs 4 times")
    fail(f"{why}, the most")


def check_train_bpe(train_bpe) -> None:
    """Visible checks for chapter 09, exercise 2: merge for merge against Hugging Face's trainer (bytes in our order)
    on ties, a run of one byte, non-ASCII text, repeated words, pairs exhausted, a paragraph; the ValueError."""
    compare_training(train_bpe, "low lower newest widest", 262)  # ties from the first merge on
    compare_training(train_bpe, "zzzz abab", 258)  # a run of one byte: overlapping pairs
    compare_training(train_bpe, "日本語 日本 ñoño", 260)  # multi-byte characters
    compare_training(train_bpe, "ok\nok\nok\nok\nso son sons", 258)  # a repeated word
    compare_training(train_bpe, "abab", 1000)  # no pair left after 2 merges
    compare_training(train_bpe, "abab", 256)  # no merge at all
    from ..data import default_corpus

    compare_training(train_bpe, default_corpus()[:3000], 320)
    try:
        got = train_bpe("abc", 255)
    except NotImplementedError:
        raise
    except ValueError as error:
        if "vocab_size" not in str(error):
            fail(f"train_bpe('abc', 255) raised ValueError({str(error)!r}): name the argument, vocab_size, and its range")
    except Exception as error:  # noqa: BLE001 - any other error is the learner's, named
        fail(f"train_bpe('abc', 255) raised {type(error).__name__}, expected ValueError: vocab_size must be at least 256")
    else:
        fail(f"train_bpe('abc', 255) returned {got!r}, expected ValueError: vocab_size must be at least 256, the byte tokens")
    passed("train_bpe")


def check_bpe_encode(bpe_encode) -> None:
    """Visible checks for chapter 09, exercise 3: bytes, rank order, chunk boundaries, Hugging Face parity."""
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
    """Visible checks for chapter 09, exercise 4: bytes joined, then decoded; characters split over tokens."""
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
