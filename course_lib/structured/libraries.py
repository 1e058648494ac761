"""Chapter 15: xgrammar and outlines-core asked the same question as the token index: after these tokens, which
tokens may come next? One vocabulary of bytes, EOS appended as its last id (an empty token)."""
from __future__ import annotations

import outlines_core
import xgrammar


class Libraries:
    """Both libraries set up for one byte vocabulary (token_bytes[i]: token i's bytes); EOS is id len(token_bytes).

    ``xgrammar(pattern, ids)`` and ``outlines(pattern, ids)``: the set of token ids each allows after the tokens
    `ids` (EOS included as ``self.eos``), or None where the library refuses the pattern or a token of `ids`."""

    def __init__(self, token_bytes: list):
        self.eos = len(token_bytes)
        info = xgrammar.TokenizerInfo(list(token_bytes) + [b""], vocab_type=xgrammar.VocabType.RAW,
                                      vocab_size=self.eos + 1, stop_token_ids=[self.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        ids: dict = {}
        for t, data in enumerate(token_bytes):
            ids.setdefault(data, []).append(t)
        self.vocabulary = outlines_core.Vocabulary(self.eos, ids)
        self.grammars: dict = {}  # pattern -> xgrammar's compiled grammar, or outlines-core's index (None: refused)
        self.indexes: dict = {}

    def xgrammar(self, pattern: str, ids) -> set | None:
        if pattern not in self.grammars:
            try:
                self.grammars[pattern] = self.compiler.compile_regex(pattern)
            except RuntimeError:  # xgrammar's parse error
                self.grammars[pattern] = None
        if self.grammars[pattern] is None:
            return None
        matcher = xgrammar.GrammarMatcher(self.grammars[pattern])
        if not all(matcher.accept_token(int(t)) for t in ids):
            return None
        bitmask = xgrammar.allocate_token_bitmask(1, self.eos + 1)
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        return {t for t in range(self.eos + 1) if (words[t // 32] >> (t % 32)) & 1}

    def outlines(self, pattern: str, ids) -> set | None:
        if pattern not in self.indexes:
            try:
                self.indexes[pattern] = outlines_core.Index(pattern, self.vocabulary)
            except ValueError:
                self.indexes[pattern] = None
        index = self.indexes[pattern]
        if index is None:
            return None
        state = index.get_initial_state()
        for t in ids:
            state = index.get_next_state(state, int(t))
            if state is None:
                return None
        return set(index.get_allowed_tokens(state))
