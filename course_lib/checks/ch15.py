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
  each non-ASCII code point of the pattern's text, with its neighbours, decides it (the held patterns write every
  non-ASCII character literally, not as an escape).

EOS is allowed after a prefix exactly when the prefix is complete UTF-8 and fully in L.
Patterns are compiled with ``regex.ASCII`` (``\\d``, ``\\w``, ``\\s`` over ASCII, as the course's regex subset reads them).
"""
from __future__ import annotations

import codecs
from functools import lru_cache

import regex

__all__ = ["regex_allows", "regex_allows_eos"]


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


def _candidates(pattern: str, tail: bytes):
    """Code points whose UTF-8 begins with `tail` (1-3 bytes of an incomplete character) that decide every test the
    pattern can make: the interval's ends and each non-ASCII character of the pattern's text, with its neighbours."""
    length = 2 if tail[0] < 0xE0 else 3 if tail[0] < 0xF0 else 4
    lo = (tail + bytes([0x80] * (length - len(tail)))).decode("utf-8", errors="ignore")
    hi = (tail + bytes([0xBF] * (length - len(tail)))).decode("utf-8", errors="ignore")
    points = {ord(ch) + d for ch in pattern if ord(ch) > 0x7F for d in (-1, 0, 1)}
    for end in (lo, hi):  # an interval's end that is itself a valid character (0x80 / 0xBF fill always is, but not
        if len(end) == 1:  # after E0 / ED / F0 / F4, whose second byte's range is narrower: then scan inwards)
            points.add(ord(end))
    for point in sorted(points):
        if 0xD800 <= point <= 0xDFFF or not 0 <= point <= 0x10FFFF:
            continue
        if chr(point).encode().startswith(tail):
            yield chr(point)
    # the narrower second-byte ranges: scan the first valid continuation from either side
    for second in list(range(0x80, 0xC0)) + list(range(0xBF, 0x7F, -1)):
        if len(tail) != 1:
            break
        probe = tail + bytes([second] + [0x80] * (length - 2))
        try:
            yield probe.decode("utf-8")
            break
        except UnicodeDecodeError:
            continue


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
