"""Chapter 15: structured decoding, output that must match a regular expression or a JSON schema.

The route, written out here rather than taken from a library: a small regex parser (the subset below) gives a syntax
tree; each character set becomes the UTF-8 byte sequences of its code points (``utf8_ranges``); Thompson's
construction gives a byte NFA and the subset construction a byte DFA (``regex_dfa``), pruned to its live states (those
from which an accepting state can still be reached). Over bytes, because a BPE token is bytes and may end inside a
character (Outlines builds on ``interegular``'s character automaton and then rewrites it to bytes; xgrammar keeps a
byte-level pushdown automaton). Then Willard & Louf's token index (``token_index``): for every live state, the tokens
whose bytes walk to a live state, and where they land; and the per-step mask (``constrained_mask``).

Regex subset (the language is the pattern's full match, as Outlines and xgrammar read it): literals (any Unicode
character), ``.`` (any character but newline), classes ``[...]`` and ``[^...]`` with ranges, escapes ``\\d \\w \\s``
(ASCII, as Python's ``re.ASCII`` reads them) and their negations, escaped punctuation, ``\\n \\t \\r \\f \\v`` and ``\\xHH``, groups
``(...)`` and ``(?:...)``, alternation ``|``, quantifiers ``? * + {m} {m,} {m,n}`` (a lazy ``?`` after one is accepted:
it does not change the language), ``^`` at the very start and ``$`` at the very end. Anything else is a ValueError
naming the pattern and the position, as is a second quantifier (Python reads ``a*+`` as possessive), a bound over
10,000, groups nested deeper than 100, or a pattern that needs more than 100,000 NFA or DFA states (or
more than 256 steps of the subset construction per state of that bound: ``regex_dfa``).

One request's constraint is its own small object (``Constraint``: the shared ``TokenIndex`` and this request's DFA
state), so that an engine can hold one automaton state per request and share one index between requests.
"""
from .automaton import ByteDFA, regex_dfa, utf8_ranges
from .index import (Constraint, IndexCache, TokenIndex, constrained_beam_search, constrained_generate, constrained_mask,
                    token_index, vocabulary_bytes)
from .schema import JSON_INTEGER, JSON_STRING_CHAR, schema_regex

__all__ = ["ByteDFA", "regex_dfa", "utf8_ranges", "Constraint", "IndexCache", "TokenIndex", "constrained_beam_search",
           "constrained_generate",
           "constrained_mask", "token_index", "vocabulary_bytes", "JSON_INTEGER", "JSON_STRING_CHAR", "schema_regex"]
