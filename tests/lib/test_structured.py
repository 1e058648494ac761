"""course_lib.structured against ground truth that needs no automaton: the ``regex`` package (full and partial
matching, string by string, ``course_lib.checks.ch15``), brute-force UTF-8 encoding, ``json`` and ``jsonschema``;
then side by side with xgrammar and outlines-core, where they differ, the ground truth decides."""
from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
import regex
import torch
import xgrammar

from course_lib import assets, structured
from course_lib.structured import automaton
from course_lib.structured.libraries import Libraries
from course_lib.checks.ch15 import regex_allows, regex_allows_eos
from course_lib.structured import Constraint, TokenIndex, constrained_mask, regex_dfa, schema_regex, token_index

# held patterns, each with strings of its language whose every byte prefix is a prefix to test (ends inside a
# character included): anchors, classes, alternation, bounded and unbounded repeats, optional tails, UTF-8 outside
# ASCII, literals that BPE tokens cross
PATTERNS = {
    r"a( b)?": ["a b"],
    r"a(-b)?": ["a-b"],
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?": ["Abc", "Hello World"],
    r"^\d{3}-\d{4}$": ["555-1234"],
    r"(cat|car|dog)s?": ["cats", "dog"],
    r"x*y+z?": ["xxyyz", "y"],
    r"café|naïve( ça)?": ["café", "naïve ça"],
    r"[^\n]{0,5}é": ["abé", "ééé"],
    r"the (quick|lazy) .+": ["the quick fox", "the lazy dög"],
    r"(ab){2,}c?": ["ababc", "ababab"],
    r"[α-ω]+ ?[0-9]*": ["αβγ 12"],
    r"\w+@\w+\.(com|org)": ["me@here.org"],
    r"(\+|-)?(0|[1-9]\d*)(\.\d+)?": ["-12.50", "0"],
    r"(the|then|there) (and|an)": ["there an", "the and"],
    r"“[^”]{1,6}”—…": ["“Ünïcø”—…"],
    r"[😀-😂]{1,2}!|.🙂": ["😀😂!", "x🙂", "😂🙂"],
}


def bpe_vocab() -> list:
    tokenizer = assets.tokenizer("bpe-gpt")
    return [tokenizer.vocab[i] for i in range(tokenizer.vocab_size)]


def char_vocab() -> list:
    return [ch.encode() for ch in assets.tokenizer("char-gpt").chars]


VOCABS = {"bpe-gpt": bpe_vocab(), "char-gpt": char_vocab()}


def prefixes(pattern: str):
    for example in PATTERNS[pattern]:
        assert regex.fullmatch(pattern, example, regex.ASCII), (pattern, example)
        data = example.encode()
        yield from (data[:k] for k in range(len(data) + 1))


def disagreements(pattern: str, vocab: list, build=token_index) -> list:
    """(prefix, tokens allowed but wrong, tokens right but not allowed, EOS wrong) wherever the index disagrees
    with the ground truth, over every byte prefix of the pattern's examples."""
    dfa = regex_dfa(pattern)
    index = build(dfa, vocab)
    found = []
    for prefix in prefixes(pattern):
        state = dfa.walk(dfa.start, prefix)
        assert state is not None, (pattern, prefix)
        truth = {t for t, data in enumerate(vocab) if regex_allows(pattern, prefix, data)}
        mine = set(index[state])
        # where each allowed token lands: the state its bytes reach, checked by walking the bytes again
        for t in mine & truth:
            assert index[state][t] == dfa.walk(dfa.start, prefix + vocab[t]), (pattern, prefix, vocab[t])
        eos_wrong = (state in dfa.accepting) != regex_allows_eos(pattern, prefix)
        if mine != truth or eos_wrong:
            found.append((prefix, sorted(vocab[t] for t in mine - truth), sorted(vocab[t] for t in truth - mine), eos_wrong))
    return found


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_token_index_is_the_partial_match_ground_truth(pattern, vocab):
    assert disagreements(pattern, VOCABS[vocab]) == []


@pytest.mark.parametrize("tail,ends", [(b"\xc3", "\u00c0\u00ff"), (b"\xe0", "\u0800\u0fff"), (b"\xed", "\ud000\ud7ff"),
                                       (b"\xf0", "\U00010000\U0003ffff"), (b"\xf4", "\U00100000\U0010ffff"),
                                       (b"\xf0\x9f", "\U0001f000\U0001ffff"), (b"\xe2\x80", "\u2000\u203f")])
def test_the_ground_truth_knows_which_characters_begin_with_an_incomplete_tail(tail, ends):
    """By brute force over every code point: the lowest and highest character whose UTF-8 begins with the tail."""
    from course_lib.checks.ch15 import _interval_ends

    found = [chr(p) for p in range(0x110000) if not 0xD800 <= p <= 0xDFFF and chr(p).encode().startswith(tail)]
    assert [found[0], found[-1]] == list(ends) == _interval_ends(tail)


@pytest.mark.parametrize("pattern", [r"\xe9", r"[\xc5-\xc6]x", r"\xe9a", r"[\u4e00-\u4e01]", r"\U0001f600"])
def test_the_ground_truth_reads_non_ascii_characters_written_as_escapes(pattern):
    """A lead byte is allowed exactly when some character it begins is in the language: decided by trying every
    character that begins with it (brute force over the 2- and 3-byte interval), never by the pattern's text."""
    for tail in (b"\xc3", b"\xc4", b"\xe4", b"\xe4\xb8", b"\xf0\x9f\x98", b"\xc3\x85"[:1]):
        lo, hi = (0x80, 0x7FF) if tail[0] < 0xE0 else (0x800, 0xFFFF) if tail[0] < 0xF0 else (0x10000, 0x10FFFF)
        full = [chr(c) for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF and chr(c).encode().startswith(tail)]
        truth = any(regex.fullmatch(pattern, ch, partial=True) for ch in full)
        assert regex_allows(pattern, b"", tail) == truth, (pattern, tail)


def test_the_held_prefixes_end_inside_characters_and_bpe_tokens_cross_literal_boundaries():
    """The held set tests what it claims: prefixes that end inside a multi-byte character, and BPE tokens allowed
    somewhere that hold bytes of two literals (they run past the end of a word of the pattern)."""
    inside = [p for pattern in PATTERNS for p in prefixes(pattern) if _incomplete(p)]
    assert len(inside) >= 5
    vocab = VOCABS["bpe-gpt"]
    crossing = [data for data in vocab if data.startswith(b" a") and len(data) > 2 and  # the space, then the 2nd group
                regex_allows(r"(the|then|there) (and|an)", b"the", data)]
    assert b" an" in crossing and b" and" in crossing, crossing


def _incomplete(data: bytes) -> bool:
    try:
        data.decode()
        return False
    except UnicodeDecodeError:
        return True


# the planted bugs, each caught by the comparison above


def index_first_byte_only(dfa, vocab):
    """A token accepted when its first byte walks to a live state."""
    return [{t: dfa.walk(s, data) or s for t, data in enumerate(vocab) if data and dfa.walk(s, data[:1]) is not None}
            for s in range(dfa.num_states)]


def index_state_not_advanced_on_multibyte(dfa, vocab):
    """The state a multi-byte token leads to is that of its first byte."""
    index = token_index(dfa, vocab)
    return [{t: dfa.walk(s, vocab[t][:1]) for t in row} for s, row in enumerate(index)]


def index_over_characters(dfa, vocab):
    """The index over characters: a token's text (bytes decoded, a broken character replaced) is walked, so a token
    that ends inside a character is never allowed, or is allowed as U+FFFD."""
    texts = [data.decode("utf-8", errors="replace").encode() for data in vocab]
    return token_index(dfa, texts)


@pytest.mark.parametrize("planted", [index_first_byte_only, index_state_not_advanced_on_multibyte, index_over_characters])
def test_each_planted_index_bug_is_caught_by_the_ground_truth(planted):
    vocab = VOCABS["bpe-gpt"]
    with pytest.raises(AssertionError):
        for pattern in PATTERNS:
            assert disagreements(pattern, vocab, planted) == []


def test_the_mask_keeps_exactly_the_allowed_tokens_and_eos_only_in_accepting_states():
    vocab = VOCABS["bpe-gpt"] + [b""]
    eos = len(vocab) - 1
    index = TokenIndex.build(r"a( b)?", vocab, eos)
    logits = torch.randn(len(vocab), generator=torch.Generator().manual_seed(0))
    for prefix in (b"", b"a", b"a ", b"a b"):
        state = index.dfa.walk(0, prefix)
        masked = Constraint(index, state).mask(logits)
        kept = set(torch.isfinite(masked).nonzero().flatten().tolist())
        truth = {t for t in range(eos) if regex_allows(r"a( b)?", prefix, vocab[t])}
        assert kept == truth | ({eos} if regex_allows_eos(r"a( b)?", prefix) else set()), prefix
        assert torch.equal(masked[list(kept)], logits[list(kept)])


def test_eos_in_a_non_accepting_state_is_a_planted_bug_the_mask_test_catches():
    def eos_always(logits, allowed, accepting, eos_token_id):
        return constrained_mask(logits, allowed, True, eos_token_id)

    vocab = VOCABS["bpe-gpt"] + [b""]
    index = TokenIndex.build(r"a( b)?", vocab, len(vocab) - 1)
    masked = Constraint(index, 0).mask(torch.zeros(len(vocab)), constrained_mask=eos_always)
    assert torch.isfinite(masked[-1]) and not regex_allows_eos(r"a( b)?", b"")


def test_constraint_advances_refuses_forbidden_tokens_and_finishes():
    vocab = VOCABS["bpe-gpt"]
    c = Constraint(TokenIndex.build(r"ab", vocab))
    with pytest.raises(ValueError, match="not allowed"):
        c.advance(vocab.index(b"b"))
    c.advance(vocab.index(b"a"))
    assert not c.finished
    c.advance(vocab.index(b"b"))
    assert c.finished


# the automaton itself


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_dfa_matches_and_stays_live_exactly_as_regex_says_on_random_strings(pattern):
    rng = random.Random(pattern)
    alphabet = sorted(set("".join(PATTERNS[pattern])) | set("ab -\né\x00"))
    dfa = regex_dfa(pattern)
    compiled = regex.compile(pattern, regex.ASCII)
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        assert dfa.matches(text) == (compiled.fullmatch(text) is not None), (pattern, text)
        live = dfa.walk(dfa.start, text.encode()) is not None
        assert live == (compiled.fullmatch(text, partial=True) is not None), (pattern, text)


@pytest.mark.parametrize("lo,hi", [(0, 0x7F), (0x70, 0x90), (0x7F0, 0x810), (0xD7F0, 0xE010), (0xFFF0, 0x10010),
                                   (0x10FFF0, 0x10FFFF), (0xE9, 0xE9), (0x3B1, 0x3C9), (0x80, 0x7FF)])
def test_utf8_ranges_cover_exactly_the_encodings_of_the_interval(lo, hi):
    sequences = [seq for a, b in automaton._normalise([(lo, hi)]) for seq in automaton.utf8_ranges(a, b)]
    covered = set()
    for seq in sequences:
        todo = [b""]
        for a, b in seq:
            todo = [t + bytes([x]) for t in todo for x in range(a, b + 1)]
        covered |= set(todo)
    expected = {chr(c).encode() for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF}
    assert covered == expected


@pytest.mark.parametrize("pattern,where", [("a(b", "missing )"), ("a{3,1}", "n < m"), ("a|*", "nothing to repeat"),
                                           ("a^b", "very start"), (r"\p{L}", "unsupported escape"),
                                           ("(?=a)", "only (?:"), ("[b-a]", "bad range"), ("a[^\\x00-\\U0010ffff]", "unsupported escape")])
def test_a_pattern_outside_the_subset_is_a_value_error_naming_the_pattern(pattern, where):
    with pytest.raises(ValueError, match="pattern .*" + re.escape(where)):
        regex_dfa(pattern)


@pytest.mark.parametrize("pattern,where", [("a{1000000}", "over 10000"), ("a{0,100000}", "over 10000"),
                                           ("(a{1000}){1000}", "more than 100000 NFA states"),
                                           ("(a|b)*a(a|b){20}", "DFA has more than 100000 states"),
                                           ("(" * 2000 + ")" * 2000, "nested deeper than 100"),
                                           ("a*+a", "possessive"), ("a?+", "possessive"), ("x{2}{3}", "multiple repeat")])
def test_a_pattern_too_large_or_repeated_twice_is_a_value_error_not_a_hang(pattern, where):
    """A bound, a nesting or a subset construction past the limits is refused (it hung or hit RecursionError); a
    second quantifier is refused too (Python reads a*+ as possessive: a*+a matches nothing, not aa)."""
    assert pattern[:3] != "a*+" or regex.fullmatch(pattern, "aa") is None
    with pytest.raises(ValueError, match="pattern .*" + re.escape(where)):
        regex_dfa(pattern)


def test_few_dfa_states_of_many_nfa_states_each_are_refused_by_their_work_not_built_for_minutes():
    """a?{k}a{k} has 2k+1 DFA states, each a subset of up to k NFA states: its subset construction does about k**2
    steps (k = 5,000, within every state bound, took a minute and gigabytes); past WORK_PER_STATE x max_states it
    is a ValueError, and a pattern of the same states with small subsets still builds."""
    k = 500
    start = time.perf_counter()
    with pytest.raises(ValueError, match="pattern .*subset construction takes more than 512000 steps"):
        regex_dfa("a?" * k + "a" * k, max_states=2000)  # 1,001 DFA states: the state bound alone lets it through
    assert time.perf_counter() - start < 30
    assert regex_dfa("a" * 1500, max_states=2000).num_states == 1501


def test_an_error_shows_a_long_pattern_cut_in_the_middle():
    """A server answers a bad pattern with this message: a 1 MB pattern must not come back whole."""
    pattern = "a" * 100_000 + "("
    with pytest.raises(ValueError, match="missing \\)") as caught:
        regex_dfa(pattern)
    assert len(str(caught.value)) < 500 and "(100001 characters)" in str(caught.value)


def test_a_long_literal_pattern_builds_in_linear_time():
    """Liveness is found backwards from the accepting states in one pass (a pass per state hung on long literals)."""
    start = time.perf_counter()
    dfa = regex_dfa("a" * 20000)
    assert dfa.num_states == 20001 and dfa.matches("a" * 20000) and not dfa.matches("a" * 19999)
    assert time.perf_counter() - start < 30


# xgrammar and outlines-core, side by side with the ground truth

EOS = len(VOCABS["bpe-gpt"])


@pytest.fixture(scope="module")
def libraries():
    return Libraries(VOCABS["bpe-gpt"])


@pytest.mark.parametrize("pattern", ["a(?=b)", "[", r"(a)\1"])
def test_a_pattern_a_library_refuses_is_none_for_both(pattern, libraries):
    """Both adapters answer None for a pattern their library cannot parse (xgrammar raised its RuntimeError)."""
    assert libraries.xgrammar(pattern, []) is None and libraries.outlines(pattern, []) is None


def library_sets(pattern, libraries):
    """{(library, prefix): allowed token ids (EOS as EOS)} after each token prefix of each example fed as its BPE
    tokens and as its single bytes (None where the library refuses the pattern or a token), and whether outlines-core
    refuses the pattern."""
    tokenizer = assets.tokenizer("bpe-gpt")
    found: dict = {}
    for example in PATTERNS[pattern]:
        for ids in (tokenizer.encode(example), list(example.encode())):
            for k in range(len(ids) + 1):
                prefix = b"".join(VOCABS["bpe-gpt"][t] for t in ids[:k])
                found["xgrammar", prefix] = libraries.xgrammar(pattern, ids[:k])
                found["outlines-core", prefix] = libraries.outlines(pattern, ids[:k])
    return found, libraries.outlines(pattern, []) is None


def truth_set(pattern, prefix):
    vocab = VOCABS["bpe-gpt"]
    return {t for t, data in enumerate(vocab) if regex_allows(pattern, prefix, data)} | (
        {EOS} if regex_allows_eos(pattern, prefix) else set())


def test_xgrammar_and_outlines_core_against_the_ground_truth(libraries):
    """Every difference, classified: xgrammar agrees but where its ``.`` also takes a newline (Python's does not);
    outlines-core refuses anchors, reads ``\\w`` as Unicode (the ground truth here is ASCII), and from an accepting
    state offers only tokens that end in an accepting state (it misses continuations), a bug by the ground truth."""
    vocab = VOCABS["bpe-gpt"]
    kinds: dict = {}
    for pattern in PATTERNS:
        dfa = regex_dfa(pattern)
        found, refused = library_sets(pattern, libraries)
        if refused:
            kinds.setdefault("outlines-core refuses anchors", []).append(pattern)
            assert pattern.startswith("^")
        for (library, prefix), allowed in found.items():
            if allowed is None:  # outlines-core refused a token earlier on this walk: a missed continuation, counted there
                assert library == "outlines-core", (pattern, prefix)
                continue
            truth = truth_set(pattern, prefix)
            extra, missing = allowed - truth, truth - allowed
            if not extra and not missing:
                continue
            if library == "xgrammar":
                assert not missing and all(b"\n" in vocab[t] for t in extra) and "." in pattern, (pattern, prefix)
                kinds.setdefault("xgrammar: . takes a newline", []).append(pattern)
            elif extra:
                assert not missing and r"\w" in pattern and all(vocab[t][0] >= 0x80 for t in extra), (pattern, prefix)
                kinds.setdefault(r"outlines-core: \w over Unicode", []).append(pattern)
            else:
                state = dfa.walk(0, prefix)
                assert state in dfa.accepting, (pattern, prefix)
                assert all(dfa.walk(state, vocab[t]) not in dfa.accepting for t in missing), (pattern, prefix)
                kinds.setdefault("outlines-core: continuations missed in accepting states", []).append((pattern, prefix))
    space, dash = vocab.index(b" "), vocab.index(b"-")
    misses = kinds["outlines-core: continuations missed in accepting states"]
    assert (r"a( b)?", b"a") in misses and (r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?", b"Abc") in misses
    found, _ = library_sets(r"a(-b)?", libraries)
    assert found["outlines-core", b"a"] == {EOS} and dash in truth_set(r"a(-b)?", b"a")
    found, _ = library_sets(r"a( b)?", libraries)
    assert space in found["xgrammar", b"a"] and space not in found["outlines-core", b"a"]
    assert set(kinds) == {"outlines-core refuses anchors", "xgrammar: . takes a newline",
                          r"outlines-core: \w over Unicode", "outlines-core: continuations missed in accepting states"}


# JSON schemas

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                      "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blü"]},
                                      "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}, "none": {"type": "null"}}},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                  "code": {"type": "string", "maxLength": 2}}},
     "maxItems": 2},
    {"type": "object", "title": "optional and nested", "properties": {
        "a": {"type": "object", "properties": {"b": {"enum": [[1, 2], {"x": None}, "é"]}}, "required": ["b"]},
        "c": {"type": "array", "items": {"type": "boolean"}, "minItems": 2}}, "additionalProperties": False},
]


def random_member(dfa, rng) -> str:
    """A random string of the DFA's language: a random walk over live bytes, stopping at random in accepting states."""
    state, out = dfa.start, b""
    while not (state in dfa.accepting and (not dfa.transitions[state] or rng.random() < 0.3)):
        byte = rng.choice(sorted(dfa.transitions[state]))
        out += bytes([byte])
        state = dfa.transitions[state][byte]
    return out.decode()


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_every_string_of_a_schema_regex_parses_and_validates_and_xgrammar_accepts_it_but_minus_zero_and_escapes(
        k, libraries):
    """json.loads and jsonschema accept every sampled string; xgrammar's JSON grammar (compact separators) accepts
    them all but those with an integer -0 or a backslash escape in a string, which JSON and the validator accept."""
    schema, rng = SCHEMAS[k], random.Random(k)
    dfa = regex_dfa(schema_regex(schema))
    grammar = libraries.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    refused = []
    for _ in range(60):
        text = random_member(dfa, rng)
        jsonschema.validate(json.loads(text), schema)
        matcher = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
        if not (matcher.accept_string(text) and matcher.is_terminated()):
            refused.append(text)
            assert re.search(r"[:\[,]-0[,\]}]", text) or "\\" in text, text
    assert len(refused) < 60


@pytest.mark.parametrize("k,instance", [(0, {"name": "", "age": 3}), (0, {"name": "abcdefghi", "age": 3}),
                                        (0, {"name": "x"}), (0, {"name": "x", "age": 1.5}),
                                        (1, {"colour": "blue", "tags": [1], "ok": True, "none": None}),
                                        (1, {"colour": "red", "tags": [], "ok": True, "none": None}),
                                        (1, {"colour": "red", "tags": [1, 2, 3, 4], "ok": True, "none": None}),
                                        (2, [{"id": 1, "code": "abc"}]), (2, [{"id": 1, "code": ""}] * 3)])
def test_an_instance_the_validator_rejects_is_not_in_the_schema_regex(k, instance):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, SCHEMAS[k])
    assert not regex_dfa(schema_regex(SCHEMAS[k])).matches(json.dumps(instance, separators=(",", ":"), ensure_ascii=False))


def test_xgrammar_refuses_minus_zero_and_escapes_that_json_and_the_validator_accept(libraries):
    grammar = libraries.compiler.compile_json_schema(json.dumps(SCHEMAS[0]), any_whitespace=False, separators=(",", ":"))
    for text in ('{"name":"a","age":-0}', '{"name":"\\u00e9","age":1}', '{"name":"\\\\","age":1}'):
        jsonschema.validate(json.loads(text), SCHEMAS[0])
        assert regex_dfa(schema_regex(SCHEMAS[0])).matches(text)
        matcher = xgrammar.GrammarMatcher(grammar, terminate_without_stop_token=True)
        assert not matcher.accept_string(text), text


@pytest.mark.parametrize("k,instance", [(0, {"name": "Bø\"\\", "age": -40}), (0, {"name": "😀", "age": 0}), (1, {"colour": "blü", "tags": [0, -1, 7],
                                                                             "ok": False, "none": None}), (2, [])])
def test_a_valid_compact_instance_is_in_the_schema_regex(k, instance):
    jsonschema.validate(instance, SCHEMAS[k])
    assert regex_dfa(schema_regex(SCHEMAS[k])).matches(json.dumps(instance, separators=(",", ":"), ensure_ascii=False))


@pytest.mark.parametrize("schema,what", [({"$ref": "#"}, "recursion"), ({"type": "number"}, "not in this subset"),
                                         ({"type": "integer", "minimum": 0}, "'minimum'"),
                                         ({"type": "string", "pattern": "a+"}, "'pattern'"),
                                         ({"type": "string", "format": "email"}, "'format'"),
                                         ({"type": "string", "maxLength": 2, "minLength": 3}, "minLength <= maxLength"),
                                         ({"type": "array", "items": {"type": "null"}, "uniqueItems": True}, "'uniqueItems'"),
                                         ({"type": "object", "properties": {}, "required": ["a"]}, "'a' is not in properties"),
                                         ({"enum": [1], "type": "string"}, "no other keyword"), ([], "dict"),
                                         ({"enum": []}, "non-empty list"), ({"enum": "ab"}, "non-empty list"),
                                         ({"type": ["string", "null"]}, "not in this subset"),
                                         ({"type": "string", "maxLength": True}, "must be integers"),
                                         ({"type": "object", "properties": {"a": {"type": "null"}}, "required": "a"},
                                          "required a list")])
def test_a_schema_outside_the_subset_is_a_value_error_saying_why(schema, what):
    with pytest.raises(ValueError, match=what):
        schema_regex(schema)


def test_nested_arrays_whose_regex_doubles_per_level_are_refused_not_built():
    """An array writes its item's regex twice (item, then (,item){m,n}): arrays nested d deep write one of about
    2**d copies (40 deep took every gigabyte of the machine). Past MAX_REGEX_CHARS it is a ValueError, found as the
    regex grows; 5 deep is fine, and so is an object of many properties under the bound."""
    def nested(depth):
        schema = {"type": "integer"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema, "maxItems": 1}
        return schema

    assert regex.fullmatch(schema_regex(nested(5)), "[[[[[7]]]]]")
    for depth in (18, 40, 400):
        start = time.perf_counter()
        with pytest.raises(ValueError, match="over 1000000 characters"):
            schema_regex(nested(depth))
        assert time.perf_counter() - start < 5
    wide = {"type": "object", "properties": {f"p{i}": nested(10) for i in range(200)}}  # 200 parts, each ~40 KB
    with pytest.raises(ValueError, match="over 1000000 characters"):
        schema_regex(wide)


# decoding under a constraint


@pytest.mark.parametrize("greedy", [True, False])
def test_constrained_generation_with_the_bpe_model_gives_a_string_of_the_language(greedy):
    model, tokenizer = assets.load("bpe-gpt"), assets.tokenizer("bpe-gpt")
    pattern = r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?"
    prompt = torch.tensor([tokenizer.encode("The name is ")])
    constraint = Constraint(TokenIndex.build(pattern, VOCABS["bpe-gpt"]))
    out = structured.constrained_generate(model, prompt, 40, constraint, greedy=greedy,
                                          generator=torch.Generator().manual_seed(1))
    text = tokenizer.decode(out[0, prompt.shape[1]:].tolist())
    assert constraint.finished and regex.fullmatch(pattern, text), text


# stop strings: the course has one implementation, the server's stop_cut; here it meets the BPE model's tokens


STOP_CASES = [("a café, then more", "é,"), ("naïve “quotes” end", "” e"), ("price: 5 € only", "€"), ("the end. The", "d. T")]


def check_stop_cut_on_split_bpe_tokens(stop_cut, text: str, stop: str) -> None:
    """The text arrives as bpe-gpt tokens, each multi-byte character split into its single bytes (tokens the model
    can emit): after each token the released text is a prefix of the text before the stop, has no U+FFFD and does
    not end with a proper prefix of the stop; at the end it is exactly the text before the stop."""
    tokenizer = assets.tokenizer("bpe-gpt")
    ids = [t for token in tokenizer.encode(text) for t in
           (list(tokenizer.vocab[token]) if max(tokenizer.vocab[token]) >= 0x80 else [token])]  # byte ids 0..255
    assert tokenizer.decode(ids) == text
    assert text.isascii() or any(tokenizer.vocab[t][0] >= 0xC0 for t in ids)  # a character split after its first byte
    before = text[:text.index(stop)]
    sent, stopped, data = 0, False, b""
    for t in ids:
        data += tokenizer.vocab[t]
        sent, stopped = stop_cut(data.decode("utf-8", errors="replace"), [stop], sent)
        released = data.decode("utf-8", errors="replace")[:sent]
        assert before.startswith(released) and "\ufffd" not in released, (released, stop)
        assert stopped or not any(released.endswith(stop[:k]) for k in range(1, len(stop))), (released, stop)
        if stopped:
            break
    assert stopped and released == before


@pytest.mark.parametrize("text,stop", STOP_CASES)
def test_stop_cut_on_bpe_tokens_that_split_characters_never_releases_a_stop_prefix_or_half_a_character(text, stop):
    from course_lib.server import stop_cut

    check_stop_cut_on_split_bpe_tokens(stop_cut, text, stop)


def stop_cut_sends_all_before_a_stop(text, stops, start=0):
    """Planted: the text up to a complete stop, and all of it while none is complete (a stop's prefix, U+FFFD too)."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (first, True) if first >= 0 else (len(text), False)


def stop_cut_sends_the_replacement_character(text, stops, start=0):
    """Planted: holds back a stop's prefix, but not a character whose bytes have not all arrived (U+FFFD)."""
    from course_lib.server import _stop_prefix

    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return first, True
    return len(text) - max(_stop_prefix(text, s, 0) for s in stops), False


@pytest.mark.parametrize("planted,fails", [(stop_cut_sends_all_before_a_stop, {0, 1, 2, 3}),
                                          (stop_cut_sends_the_replacement_character, {0, 1, 2})])  # 3: ASCII alone
def test_each_planted_stop_cut_fails_the_check_where_it_should(planted, fails):
    failed = set()
    for k, (text, stop) in enumerate(STOP_CASES):
        try:
            check_stop_cut_on_split_bpe_tokens(planted, text, stop)
        except AssertionError:
            failed.add(k)
    assert failed == fails


# ---------------------------------------------------------------------------------------------------- beam search
# within the grammar, against brute force: every string of a finite language, its probability under the model (then
# EOS) computed by one full forward pass per prefix


def tiny_model(seed: int, vocab_size: int = 4):
    from course_lib.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape) * 0.5)  # distributions far from uniform
    return model


@torch.no_grad()
def language_logprobs(model, start: torch.Tensor, index: TokenIndex) -> dict:
    """{tokens of each string of the (finite) language, EOS last: the model's log-probability of them}."""
    out = {}

    def walk(seq, state, logp):
        probs = torch.log_softmax(model(torch.cat([start, torch.tensor([seq], dtype=torch.long)], 1))[0][0, -1]
                                  .double(), -1)
        if state in index.dfa.accepting:
            out[tuple(seq) + (index.eos_token_id,)] = logp + probs[index.eos_token_id].item()
        for token, after in index.next[state].items():
            walk(seq + [token], after, logp + probs[token].item())

    walk([], 0, 0.0)
    return out


LETTERS = [b"a", b"b", b"c", b""]  # EOS last


@pytest.mark.parametrize("seed", [22, 1, 2, 3])
@pytest.mark.parametrize("pattern", [r"ab{0,2}|c(a|b)", r"(a|bc)(a|b)?c?", r"c{1,3}|ba"])
def test_beam_search_within_the_grammar_is_greedy_with_one_beam_and_the_best_string_with_enough(seed, pattern):
    from course_lib.structured import constrained_beam_search, constrained_generate

    model, start = tiny_model(seed), torch.tensor([[2, 0, 1]])
    index = TokenIndex.build(pattern, LETTERS, 3)
    truth = language_logprobs(model, start, index)
    greedy = constrained_generate(model, start, 6, Constraint(index), greedy=True)[0, 3:].tolist()
    one, score = constrained_beam_search(model, start, 6, index, 1)
    assert one[0, 3:].tolist() == (greedy if greedy[-1:] == [3] else greedy + [3])  # the EOS greedy stops before
    assert score == pytest.approx(truth[tuple(one[0, 3:].tolist())], abs=1e-5)  # batched beams, rows alone: float32
    out, score = constrained_beam_search(model, start, 6, index, len(truth))  # every prefix fits
    best = max(truth, key=truth.get)
    assert tuple(out[0, 3:].tolist()) == best and score == pytest.approx(truth[best], abs=1e-5)


def test_beam_search_finds_the_best_string_greedy_misses_only_with_enough_beams():
    """Chapter 15's case (seed 22): greedy takes "ca", 720 times less likely than "a"; two beams keep "c" and "a"
    but "a" then EOS ranks third among their extensions (Hugging Face's rule drops it); three find it."""
    from course_lib.structured import constrained_beam_search

    model, start = tiny_model(22), torch.tensor([[2, 0, 1]])
    index = TokenIndex.build(r"ab{0,2}|c(a|b)", LETTERS, 3)
    truth = language_logprobs(model, start, index)
    found = [tuple(constrained_beam_search(model, start, 5, index, k)[0][0, 3:].tolist()) for k in (1, 2, 3)]
    assert found == [(2, 0, 3), (2, 1, 3), (0, 3)] and max(truth, key=truth.get) == (0, 3)
    with pytest.raises(ValueError, match="num_beams must be an integer >= 1"):
        constrained_beam_search(model, start, 5, index, 0)
    with pytest.raises(ValueError, match="no string of the language finished within max_new_tokens = 1"):
        constrained_beam_search(model, start, 1, TokenIndex.build("abc", LETTERS, 3), 2)


@torch.no_grad()
def string_logprob(model, start: torch.Tensor, tokens: list) -> float:
    """The model's log-probability of tokens after start, one full forward pass per prefix, in float64."""
    total = 0.0
    for i, token in enumerate(tokens):
        logits = model(torch.cat([start, torch.tensor([tokens[:i]], dtype=torch.long)], 1))[0][0, -1]
        total += torch.log_softmax(logits.double(), -1)[token].item()
    return total


@pytest.mark.parametrize("budget", [2, 4, 6])
def test_beam_search_within_the_grammar_ends_its_string_within_the_budget_as_chapter_06_ends_at_max_length(budget):
    """Chapter 06's beam search ends every beam at max_new_tokens; within a grammar a string ends only by EOS, so the
    last step allows EOS alone (where the state accepts). Seed 0 under a+b?: greedy takes 'a' again and again (EOS
    never ranks first), so one beam ends with as many a's as the budget leaves room for, then EOS, scored as brute
    force scores it; the old beam search of its own let the last step rank EOS below the a's and found no string."""
    from course_lib.structured import constrained_beam_search, constrained_generate

    model, start = tiny_model(0), torch.tensor([[2, 0, 1]])
    index = TokenIndex.build(r"a+b?", LETTERS, 3)
    greedy = constrained_generate(model, start, budget - 1, Constraint(index), greedy=True)[0, 3:].tolist()
    assert greedy == [0] * (budget - 1)  # no EOS: the case
    out, score = constrained_beam_search(model, start, budget, index, 1)
    assert out[0, 3:].tolist() == greedy + [3]
    assert score == pytest.approx(string_logprob(model, start, greedy + [3]), abs=1e-5)


def test_beam_search_within_the_grammar_refuses_what_chapter_06_beam_search_cannot_do():
    from course_lib.structured import constrained_beam_search

    model, start = tiny_model(0), torch.tensor([[2, 0, 1]])
    with pytest.raises(ValueError, match="index.eos_token_id is None"):
        constrained_beam_search(model, start, 4, TokenIndex.build(r"a+b?", LETTERS, None), 2)
    with pytest.raises(ValueError, match="max_new_tokens must be <= block_size = 16, got 3 \\+ 14"):
        constrained_beam_search(model, start, 14, TokenIndex.build(r"a+b?", LETTERS, 3), 2)


def test_beam_search_within_the_grammar_that_finds_no_string_does_not_say_there_is_none():
    """Seed 7 under b+c, 3 tokens: the one beam takes b twice (c ranks below it), and the last step allows only EOS,
    which "bb" cannot take; "bc" fits the budget and three beams find it. The error names the beams, not the language
    (the old message said no string of the language finished, as if none fit)."""
    from course_lib.structured import constrained_beam_search

    model, start, index = tiny_model(7), torch.tensor([[2, 0, 1]]), TokenIndex.build(r"b+c", LETTERS, 3)
    assert (1, 2, 3) in language_logprobs(model, start, TokenIndex.build(r"bc", LETTERS, 3))  # a string that fits
    with pytest.raises(ValueError, match="within max_new_tokens = 3 on num_beams = 1 beams: none fits, or the beams "
                                         "dropped the prefixes of those that do"):
        constrained_beam_search(model, start, 3, index, 1)
    assert constrained_beam_search(model, start, 3, index, 3)[0][0, 3:].tolist() == [1, 2, 3]
