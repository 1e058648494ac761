"""Chapter 15 (structured decoding): the ground truth that needs no automaton.

A pattern's language L is a set of strings; what a model emits is bytes, so the language the mask must respect is
UTF8(L), and a token (bytes, possibly ending inside a character, possibly starting with a continuation byte) is
allowed after a prefix (bytes) exactly when prefix + token is a prefix of UTF8(s) for some s in L. Decided here with
the ``regex`` package's partial matching, never with course_lib.structured:

* prefix + token must be valid UTF-8 except for an incomplete character at its end (anything else begins no
  encoding at all);
* its complete part c must partially match: ``regex.fullmatch(pattern, c, partial=True)`` (c is in L or can be
  extended into a string of L);
* with an incomplete tail r, some character x whose encoding begins with r must keep c + x a partial match. The
  characters that begin with r form one code-point interval; every set the pattern can test (a literal, a class, ``.``,
  ASCII ``\\d \\w \\s``) is constant between the code points written in the pattern, so trying the interval's ends and
  each non-ASCII code point of the pattern, written or as a \\x, \\u or \\U escape, with its neighbours, decides it.

EOS is allowed after a prefix exactly when the prefix is complete UTF-8 and fully in L.

The visible checks hand the learner's ``token_index`` the course's DFA (the exercise's input, not what it checks) and
name each state by the shortest bytes that reach it (``state_prefixes``); every verdict on allowed tokens, and on
where a token lands (a state that behaves as prefix + token: the same tokens and EOS allowed after it), is the
``regex`` package's.
Patterns are compiled with ``regex.ASCII`` (``\\d``, ``\\w``, ``\\s`` over ASCII, as the course's regex subset reads them).
"""
from __future__ import annotations

import codecs
import numbers
from functools import lru_cache

import regex
import torch

from ..structured import regex_dfa
from .core import call_learner, fail, passed

__all__ = ["regex_allows", "regex_allows_eos", "check_token_index", "check_constrained_mask", "state_prefixes",
           "CHECK_VOCAB"]


@lru_cache(maxsize=256)
def _compiled(pattern: str):
    return regex.compile(pattern, regex.ASCII)


def _split_utf8(data: bytes):
    """(complete text, incomplete tail bytes), or None when data is not a prefix of any valid UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    return text, decoder.getstate()[0]


def _interval_ends(tail: bytes) -> list:
    """The lowest and the highest character whose UTF-8 begins with `tail` (1-3 bytes of an incomplete character).
    After most lead bytes any continuation byte may follow; after E0, ED, F0 and F4 the second byte's range is
    narrower (no overlong forms, no surrogates, nothing past U+10FFFF): the first valid one is found by trying."""
    length = 2 if tail[0] < 0xE0 else 3 if tail[0] < 0xF0 else 4
    ends = []
    for fill, seconds in ((0x80, range(0x80, 0xC0)), (0xBF, range(0xBF, 0x7F, -1))):
        for second in (seconds if len(tail) == 1 else [None]):
            probe = tail + (bytes([second]) if second is not None else b"")
            try:
                ends.append((probe + bytes([fill] * (length - len(probe)))).decode())
                break
            except UnicodeDecodeError:
                continue
    return ends


def _candidates(pattern: str, tail: bytes):
    """Characters whose UTF-8 begins with `tail` that decide every test the pattern can make: the interval's two ends
    and each non-ASCII character of the pattern, written or escaped (\\xHH, \\uHHHH, \\UHHHHHHHH), and its two
    neighbours, where they begin with `tail`."""
    escaped = regex.findall(r"\\x([0-9a-fA-F]{2})|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})", pattern)
    written = [ord(ch) for ch in pattern] + [int("".join(h), 16) for h in escaped]
    points = {p + d for p in written if p > 0x7F for d in (-1, 0, 1)}
    near = [chr(p) for p in sorted(points) if 0 <= p <= 0x10FFFF and not 0xD800 <= p <= 0xDFFF]
    return _interval_ends(tail) + [ch for ch in near if ch.encode().startswith(tail)]


def regex_allows(pattern: str, prefix: bytes, token: bytes) -> bool:
    """Whether prefix + token (bytes) can still be completed into the UTF-8 of a string the pattern fully matches."""
    if not token:
        return False
    split = _split_utf8(prefix + token)
    if split is None:
        return False
    text, tail = split
    compiled = _compiled(pattern)
    if not tail:
        return compiled.fullmatch(text, partial=True) is not None
    return any(compiled.fullmatch(text + ch, partial=True) is not None for ch in _candidates(pattern, tail))


def regex_allows_eos(pattern: str, prefix: bytes) -> bool:
    """Whether the prefix (bytes) is complete UTF-8 and its text is fully matched by the pattern."""
    split = _split_utf8(prefix)
    return split is not None and not split[1] and _compiled(pattern).fullmatch(split[0]) is not None


# ----------------------------------------------------------------------------------------------------
# the visible checks

# a small vocabulary of bytes: letters, words, tokens that cross a literal boundary, a character split over two
# tokens (b"caf\xc3" + b"\xa9 "), a lone lead and a lone continuation byte, and the empty token
CHECK_VOCAB = [b"a", b"b", b"c", b"e", b"f", b" ", b"!", b"-", b"ab", b"ca", b"caf", b"cafe", b" b", b"a b", b"e ",
               b"\xc3\xa9", b"caf\xc3", b"\xa9 ", b"\xa9", b"\xc3", b" ab", b"bc!", b"\xc3\xa9 a", b""]
CHECK_PATTERNS = [r"a( b)?", r"(café|cafe) [a-c]{1,3}!?", r"(ab|a-b)c?"]


def state_prefixes(dfa) -> dict:
    """{state: the shortest byte string that walks the DFA from its start to it} (breadth first, lowest byte first):
    a string that names each state, so that a state's behaviour can be asked of the ground truth."""
    prefixes, todo = {dfa.start: b""}, [dfa.start]
    for state in todo:
        for byte, nxt in sorted(dfa.transitions[state].items()):
            if nxt not in prefixes:
                prefixes[nxt] = prefixes[state] + bytes([byte])
                todo.append(nxt)
    return prefixes


def _behaviour(pattern: str, prefix: bytes, probes) -> tuple:
    """What the ground truth allows after prefix: each probe token's verdict, and EOS's."""
    return tuple(regex_allows(pattern, prefix, t) for t in probes) + (regex_allows_eos(pattern, prefix),)


def _show(token: bytes) -> str:
    return repr(token)


def check_token_index(token_index) -> None:
    """Your token_index against the partial-match ground truth (course_lib.checks.ch15), on the patterns
    CHECK_PATTERNS and the byte vocabulary CHECK_VOCAB: in every state exactly the tokens that can still lead to a
    string of the language, each landing in a state that behaves as the prefix and the token together."""
    for pattern in CHECK_PATTERNS:
        dfa = regex_dfa(pattern)
        index = call_learner(lambda: token_index(dfa, list(CHECK_VOCAB)), f"token_index(regex_dfa({pattern!r}), vocab)",
                             "token_bytes[i] is token i's bytes; a byte missing from dfa.transitions[state] leads "
                             "nowhere: no string of the language goes that way, and dfa.walk returns None",
                             (RuntimeError, TypeError, KeyError, AttributeError,
                                                                    UnicodeDecodeError, IndexError))
        rows = [r for r in index if not isinstance(r, dict)] if isinstance(index, list) else []
        if isinstance(index, list) and len(index) == dfa.num_states and rows:
            fail(f"token_index must return one dict per state, {{token id: the state its bytes land in}}; a row is a "
                 f"{type(rows[0]).__name__}: make each row a dict from token id to where the token lands (the next step "
                 f"starts there)")
        if not isinstance(index, list) or len(index) != dfa.num_states:
            fail(f"token_index must return a list of dfa.num_states = {dfa.num_states} dicts (one per state), "
                 f"got {type(index).__name__}" + (f" of length {len(index)}" if isinstance(index, (list, tuple)) else ""))
        keys = [k for row in index for k in row if not isinstance(k, numbers.Integral) or isinstance(k, bool)
                or not 0 <= k < len(CHECK_VOCAB)]
        if keys:
            fail(f"token_index(regex_dfa({pattern!r}), vocab): a row has the key {keys[0]!r}, not a token id; key each "
                 f"row by the token's id, an int in [0, {len(CHECK_VOCAB) - 1}] (its index in token_bytes), not its bytes")
        for state, prefix in state_prefixes(dfa).items():
            where = f"pattern {pattern!r}, state {state} (reached by {prefix!r})"
            truth = {t for t, data in enumerate(CHECK_VOCAB) if regex_allows(pattern, prefix, data)}
            got = set(index[state])
            if any(not CHECK_VOCAB[t] for t in got):
                fail(f"{where}: the empty token is allowed; a token with no bytes is never allowed (it would not move)")
            for t in sorted(got - truth):
                token = CHECK_VOCAB[t]
                if regex_allows(pattern, prefix, token[:1]):
                    fail(f"{where}: token {_show(token)} is allowed, but only its first byte leads on; "
                         f"{prefix + token!r} begins no string of the language: walk ALL of a token's bytes")
                fail(f"{where}: token {_show(token)} is allowed, but {prefix + token!r} begins no string of the language")
            for t in sorted(truth - got):
                token = CHECK_VOCAB[t]
                try:
                    token.decode()
                except UnicodeDecodeError:
                    fail(f"{where}: token {_show(token)} is missing: its bytes are part of a character (the UTF-8 of é "
                         f"is b'\\xc3\\xa9'), and {prefix + token!r} can still be completed: build the index over "
                         f"bytes, not characters")
                fail(f"{where}: token {_show(token)} is missing: {prefix + token!r} can still be completed into a "
                     f"string of the language")
            for t in sorted(got & truth):
                token, landing = CHECK_VOCAB[t], index[state][t]
                if not isinstance(landing, numbers.Integral) or isinstance(landing, bool) or not 0 <= landing < dfa.num_states:
                    fail(f"{where}: token {_show(token)} lands in {landing!r}, not a state (an int in [0, {dfa.num_states - 1}])")
                if _behaviour(pattern, state_prefixes(dfa)[landing], CHECK_VOCAB) != _behaviour(pattern, prefix + token, CHECK_VOCAB):
                    if len(token) > 1 and landing == dfa.walk(state, token[:1]):
                        fail(f"{where}: token {_show(token)} lands where its first byte does; the state must advance over "
                             f"all {len(token)} bytes")
                    fail(f"{where}: token {_show(token)} lands in state {landing}, which does not behave as "
                         f"{prefix + token!r} (another token or EOS is allowed in one and not the other)")
    passed("token_index")


def check_constrained_mask(constrained_mask) -> None:
    """Your constrained_mask on random logits: the allowed tokens keep their logits, every other token gets -inf, EOS
    is kept only in an accepting state (and ignored when eos_token_id is None), an empty row too, the logits and the
    row given are not modified, and nothing is kept between calls."""
    g = torch.Generator().manual_seed(1500)
    logits = torch.randn(12, generator=g) * 3
    allowed = {1: 4, 3: 0, 7: 2}
    first = []  # one call, then another, then the first again: the same arguments must give the same mask
    for accepting, eos in ((False, None), (True, 11), (False, None)):
        row = dict(allowed)
        name = f"constrained_mask(logits, {allowed}, accepting={accepting}, eos_token_id={eos})"
        first.append(call_learner(lambda: constrained_mask(logits.clone(), row, accepting, eos), name, "",
                                  (RuntimeError, TypeError, IndexError)))
        if row != allowed:
            fail(f"{name} changed the dict `allowed` it was given to {row}: it is a row of the token index, shared by "
                 f"every request in that state; read it, never write it")
    if isinstance(first[0], torch.Tensor) and isinstance(first[2], torch.Tensor) and not torch.equal(first[0], first[2]):
        fail("constrained_mask gave a different mask for the same arguments after another call (EOS of an accepting "
             "state kept?): something is kept between calls, and one request's mask leaks into the next; build "
             "each mask afresh")
    cases = [(allowed, a, e) for a in (False, True) for e in (None, 11, 3)] + [({}, True, 11), ({}, True, None), ({}, False, 3)]
    for row, accepting, eos in cases:  # an empty row last: an accepting state where nothing but EOS may follow
        given = logits.clone()
        name = f"constrained_mask(logits, {row}, accepting={accepting}, eos_token_id={eos})"
        out = call_learner(lambda: constrained_mask(given, row, accepting, eos), name,
                           "" if row else "an empty row: the state allows no token, only EOS if it is accepting",
                           (RuntimeError, TypeError, IndexError))
        if not torch.equal(given, logits):
            fail(f"{name} changed the logits it was given; return a masked copy (a caller may still need them)")
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            fail(f"{name} must return a tensor of shape {tuple(logits.shape)}, got "
                 + (f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__))
        keep = set(row) | ({eos} if accepting and eos is not None else set())
        if eos is None and accepting and len(keep) < 12 and torch.equal(out, logits):
            fail(f"{name}: every token kept its logit; with eos_token_id None no token is EOS, and a tensor indexed "
                 f"with None is all of it (keep[None] = True keeps every token): allow EOS only when eos_token_id "
                 f"is not None")
        for t in range(12):
            if t == eos and t in keep and t not in row and out[t] != logits[t]:
                fail(f"{name}: EOS (token {t}) must keep its logit {logits[t]:.4f} in an accepting state, got "
                     f"{out[t]:.4f}: the text so far is a whole string of the language, so the model may stop here")
            if t in keep and out[t] != logits[t]:
                fail(f"{name}: token {t} is allowed and must keep its logit {logits[t]:.4f}, got {out[t]:.4f} "
                     f"(the mask only removes tokens; the softmax renormalises)")
            if t not in keep and out[t] != float("-inf"):
                if t == eos and not accepting:
                    fail(f"{name}: EOS is allowed in a state that is not accepting; the text so far is not in the "
                         f"language, so EOS must wait for an accepting state")
                if torch.isfinite(out[t]) and out[t] < -1e3:
                    fail(f"{name}: token {t} gets {out[t]:.3g}, not -inf: a finite logit still has a probability "
                         f"that is not exactly 0")
                fail(f"{name}: token {t} is not allowed and must get -inf, got {out[t]:.4f}")
    passed("constrained_mask")
