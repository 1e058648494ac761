"""Chapter 15: a regular expression -> a byte DFA (the subset in ``course_lib.structured``'s docstring).

Character sets are code-point ranges; ``utf8_ranges`` turns one into the byte-range sequences of its UTF-8 encodings;
Thompson's construction gives a byte NFA, the subset construction a byte DFA, pruned to its live states.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..validation import is_count

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20))
ESCAPED = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
MAX_REPEAT = 10_000     # the largest m or n of a bound {m,n}
MAX_DEPTH = 100         # the deepest nesting of groups
MAX_STATES = 100_000    # the most NFA states, and the most DFA states, a pattern may need
WORK_PER_STATE = 256    # the subset construction's steps allowed per state of max_states (see regex_dfa)


# ----------------------------------------------------------------------------------------------------
# character sets as code-point ranges, and their UTF-8 byte sequences


def _normalise(ranges) -> tuple:
    """Sorted, merged, surrogate-free code-point ranges ((lo, hi), ...), both ends included."""
    cut = []
    for lo, hi in ranges:
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a <= b:
                cut.append((a, b))
    merged: list = []
    for lo, hi in sorted(cut):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _complement(ranges) -> tuple:
    out, nxt = [], 0
    for lo, hi in _normalise(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return _normalise(out)


def utf8_ranges(lo: int, hi: int) -> list:
    """The UTF-8 encodings of the code points lo..hi (no surrogates) as byte-range sequences: a list of
    [(b0lo, b0hi), (b1lo, b1hi), ...], each sequence matching exactly the encodings of one sub-range (the split of
    Rust's regex-syntax: first by encoded length, then until every byte position is a full range or one value)."""
    out, stack = [], [(lo, hi)]
    while stack:
        s, e = stack.pop()
        for boundary in (0x7F, 0x7FF, 0xFFFF):
            if s <= boundary < e:
                stack += [(boundary + 1, e), (s, boundary)]
                break
        else:
            for i in (1, 2, 3):
                m = (1 << (6 * i)) - 1
                if s & ~m != e & ~m:
                    if s & m:
                        stack += [((s | m) + 1, e), (s, s | m)]
                        break
                    if e & m != m:
                        stack += [(e & ~m, e), (s, (e & ~m) - 1)]
                        break
            else:
                a, b = chr(s).encode(), chr(e).encode()
                out.append(list(zip(a, b)))
    return out


def shown(pattern: str, width: int = 200) -> str:
    """The pattern as an error message shows it: its repr, cut in the middle beyond `width` characters (a server's
    answer to a 1 MB pattern must not be 1 MB)."""
    text = repr(pattern)
    return text if len(text) <= width else f"{text[:width // 2]}...{text[-width // 2:]} ({len(pattern)} characters)"


# ----------------------------------------------------------------------------------------------------
# the parser: pattern -> syntax tree ("set", ranges) | ("cat", [...]) | ("alt", [...]) | ("rep", node, m, n or None)


class _Parser:
    def __init__(self, pattern: str):
        self.p, self.i, self.depth = pattern, 0, 0

    def fail(self, what: str):
        raise ValueError(f"pattern {shown(self.p)}: {what} at position {self.i} (see course_lib.structured for the subset)")

    def peek(self):
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self):
        ch = self.peek()
        if ch is None:
            self.fail("unexpected end")
        self.i += 1
        return ch

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alt()
        if self.peek() == "$" and self.i == len(self.p) - 1:
            self.i += 1
        if self.i != len(self.p):
            self.fail(f"unexpected {self.peek()!r}")
        return node

    def alt(self):
        branches = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def cat(self):
        items = []
        while self.peek() not in (None, "|", ")") and not (self.peek() == "$" and self.i == len(self.p) - 1):
            items.append(self.repeat())
        return ("cat", items)

    def repeat(self):
        node = self.atom()
        if self.peek() in ("?", "*", "+", "{"):
            ch = self.take()
            if ch == "?":
                node = ("rep", node, 0, 1)
            elif ch == "*":
                node = ("rep", node, 0, None)
            elif ch == "+":
                node = ("rep", node, 1, None)
            else:
                found = re.match(r"(\d+)(,(\d*))?\}", self.p[self.i:])
                if not found:
                    self.fail("a bound must read {m}, {m,} or {m,n}")
                self.i += found.end()
                m = int(found[1])
                n = m if found[2] is None else (int(found[3]) if found[3] else None)
                if max(m, n or 0) > MAX_REPEAT:
                    self.fail(f"bound {{{found[0][:-1]}}} is over {MAX_REPEAT} (each repeat is a copy in the automaton)")
                if n is not None and n < m:
                    self.fail(f"bound {{{m},{n}}} has n < m")
                node = ("rep", node, m, n)
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
            if self.peek() in ("?", "*", "+", "{"):  # a*+ is possessive in Python: another language
                self.fail("multiple repeat (a possessive quantifier such as *+ is not supported)")
        return node

    def atom(self):
        ch = self.take()
        if ch == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                self.fail(f"groups nested deeper than {MAX_DEPTH}")
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.fail("only (?:...) groups are supported")
            node = self.alt()
            if self.peek() != ")":
                self.fail("missing )")
            self.i += 1
            self.depth -= 1
            return node
        if ch == "[":
            return ("set", self.charclass())
        if ch == ".":
            return ("set", _complement([(10, 10)]))
        if ch == "\\":
            return ("set", self.escape())
        if ch in "*+?{)|":
            self.fail(f"nothing to repeat or unbalanced {ch!r}")
        if ch in "^$":
            self.fail(f"{ch!r} is supported only at the very start (^) or end ($)")
        return ("set", ((ord(ch), ord(ch)),))

    def escape(self) -> tuple:
        ch = self.take()
        classes = {"d": DIGIT, "w": WORD, "s": SPACE}
        if ch.lower() in classes:
            ranges = classes[ch.lower()]
            return _normalise(ranges) if ch.islower() else _complement(ranges)
        if ch in ESCAPED:
            return ((ord(ESCAPED[ch]),) * 2,)
        if ch == "x":
            digits = self.p[self.i:self.i + 2]
            if not re.fullmatch("[0-9a-fA-F]{2}", digits):
                self.fail("\\x needs two hex digits")
            self.i += 2
            return ((int(digits, 16),) * 2,)
        if ch.isalnum():
            self.fail(f"unsupported escape \\{ch}")
        return ((ord(ch), ord(ch)),)

    def charclass(self) -> tuple:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges, first = [], True
        while first or self.peek() != "]":
            first = False
            ch = self.take()
            if ch == "\\":
                low = self.escape()
                if len(low) != 1 or low[0][0] != low[0][1]:
                    ranges += low
                    continue
                lo = low[0][0]
            else:
                lo = ord(ch)
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                end = self.take()
                hi = self.escape()[0][0] if end == "\\" else ord(end)
                if hi < lo:
                    self.fail(f"bad range {chr(lo)}-{chr(hi)}")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        self.i += 1
        return _complement(ranges) if negate else _normalise(ranges)


# ----------------------------------------------------------------------------------------------------
# Thompson's NFA over bytes, the subset construction, the live DFA


class _NFA:
    def __init__(self, max_states: int = MAX_STATES):
        self.edges: list = []  # state -> [(lo, hi, target)]
        self.eps: list = []    # state -> [target]
        self.max_states = max_states

    def new(self) -> int:
        if len(self.edges) == self.max_states:
            raise ValueError(f"it needs more than {self.max_states} NFA states (bounds multiply: (a{{100}}){{100}} "
                             f"is 10,000 copies of a)")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, node, start: int) -> int:
        """Add node's fragment from `start`; return its end state."""
        kind = node[0]
        if kind == "set":
            end = self.new()
            for lo, hi in node[1]:
                for seq in utf8_ranges(lo, hi):
                    state = start
                    for k, (a, b) in enumerate(seq):
                        nxt = end if k == len(seq) - 1 else self.new()
                        self.edges[state].append((a, b, nxt))
                        state = nxt
            return end
        if kind == "cat":
            for item in node[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.new()
            for branch in node[1]:
                s = self.new()
                self.eps[start].append(s)
                self.eps[self.build(branch, s)].append(end)
            return end
        _, sub, m, n = node
        for _ in range(m):
            start = self.build(sub, start)
        if n is None:
            loop = self.new()
            self.eps[start].append(loop)
            self.eps[self.build(sub, loop)].append(loop)
            return loop
        end = self.new()
        for _ in range(n - m):
            self.eps[start].append(end)
            start = self.build(sub, start)
        self.eps[start].append(end)
        return end

    def closure(self, states) -> frozenset:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


@dataclass(frozen=True)
class ByteDFA:
    """A DFA over bytes with only live states: transitions[s] = {byte: next state}; a byte missing from it leads to
    the dead state (no string of the language begins that way). States are 0..n-1, start 0."""
    transitions: tuple
    accepting: frozenset
    start: int = 0

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def walk(self, state: int, data: bytes) -> int | None:
        """The state after reading `data` from `state`, or None (dead)."""
        for byte in data:
            state = self.transitions[state].get(byte)
            if state is None:
                return None
        return state

    def matches(self, text: str | bytes) -> bool:
        """Whether the whole text (str: its UTF-8 bytes) is in the language."""
        end = self.walk(self.start, text.encode() if isinstance(text, str) else text)
        return end is not None and end in self.accepting


def regex_dfa(pattern: str, *, max_states: int = MAX_STATES) -> ByteDFA:
    """The live byte DFA of `pattern` (the subset in the module docstring): a string's UTF-8 bytes walk it to an
    accepting state exactly when the pattern fully matches the string. ValueError naming the position otherwise;
    a pattern whose language is empty is a ValueError too, and so is one that needs more than max_states NFA or DFA
    states, or more than WORK_PER_STATE x max_states steps of the subset construction (a step: one byte of an NFA
    edge of a DFA state's subset, or one NFA state of a closure; few DFA states of many NFA states each cost time
    and memory quadratic in the pattern). A server sets a smaller bound: its token index costs states x vocabulary
    walks."""
    if not isinstance(pattern, str):
        raise ValueError(f"pattern must be a str, got {type(pattern).__name__}")
    if not is_count(max_states) or max_states < 1:
        raise ValueError(f"max_states must be an integer >= 1, got {max_states!r}")
    tree = _Parser(pattern).parse()
    nfa = _NFA(max_states)
    nfa_start = nfa.new()
    try:
        nfa_end = nfa.build(tree, nfa_start)
    except ValueError as error:
        raise ValueError(f"pattern {shown(pattern)}: {error}") from None
    first = nfa.closure([nfa_start])
    ids, subsets, moves = {first: 0}, [first], []
    work, budget = 0, WORK_PER_STATE * max_states  # few states can still hold many NFA states each: a?{k}a{k}
    while len(moves) < len(subsets):
        targets: dict = {}
        for s in subsets[len(moves)]:
            for lo, hi, t in nfa.edges[s]:
                work += hi - lo + 1
                for byte in range(lo, hi + 1):
                    targets.setdefault(byte, set()).add(t)
        move = {}
        for byte, ts in targets.items():
            subset = nfa.closure(ts)
            work += len(subset)
            if work > budget:
                raise ValueError(f"pattern {shown(pattern)}: its subset construction takes more than {budget} steps "
                                 f"({WORK_PER_STATE} per state of max_states = {max_states}: its DFA states each hold "
                                 f"many NFA states, as for a?{{1000}}a{{1000}})")
            if subset not in ids:
                if len(subsets) == max_states:
                    raise ValueError(f"pattern {shown(pattern)}: its DFA has more than {max_states} states (the subset "
                                     f"construction can grow exponentially, as for (a|b)*a(a|b){{20}})")
                ids[subset] = len(subsets)
                subsets.append(subset)
            move[byte] = ids[subset]
        moves.append(move)
    accepting = {i for i, subset in enumerate(subsets) if nfa_end in subset}
    into: list = [set() for _ in subsets]  # the reversed transitions: live states found backwards from the accepting
    for i, move in enumerate(moves):
        for t in move.values():
            into[t].add(i)
    live, todo = set(accepting), list(accepting)
    while todo:
        for i in into[todo.pop()] - live:
            live.add(i)
            todo.append(i)
    if 0 not in live:
        raise ValueError(f"pattern {shown(pattern)} matches no string")
    order = sorted(live)  # 0 stays the start
    renumber = {old: new for new, old in enumerate(order)}
    transitions = tuple({b: renumber[t] for b, t in sorted(moves[old].items()) if t in live} for old in order)
    return ByteDFA(transitions, frozenset(renumber[a] for a in accepting))
