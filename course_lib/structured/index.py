"""Chapter 15: the token index (Willard & Louf), the per-step mask, one request's constraint, decoding under it."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..decoding import beam_search
from ..gpt import extend, greedy_choice, sample_choice
from ..validation import is_count
from .automaton import MAX_STATES, ByteDFA, regex_dfa


def token_index(dfa: ByteDFA, token_bytes: list) -> list:
    """Willard & Louf's index: a list with one dict per DFA state, {token id: the state its bytes lead to}, holding
    exactly the tokens whose bytes walk from that state to a live state. token_bytes[i] is token i's bytes (bytes,
    possibly part of a character's UTF-8 encoding); an empty token is never allowed."""
    index = []
    for state in range(dfa.num_states):
        allowed = {}
        for token, data in enumerate(token_bytes):
            end = dfa.walk(state, data) if data else None
            if end is not None:
                allowed[token] = end
        index.append(allowed)
    return index


def constrained_mask(logits: torch.Tensor, allowed: dict, accepting: bool, eos_token_id: int | None) -> torch.Tensor:
    """logits (V,) -> (V,): the same logits where a token is allowed, -inf elsewhere. Allowed: the keys of `allowed`
    (one state's entry of the token index) and, only when the state is accepting, eos_token_id (if not None). Writes
    into neither logits nor allowed (a row shared by every request in that state)."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    if accepting and eos_token_id is not None:
        keep[eos_token_id] = True
    return logits.masked_fill(~keep, float("-inf"))


@dataclass
class TokenIndex:
    """A pattern compiled once for one vocabulary and shared by every request that uses it: the DFA, the token index
    (built by ``token_index``, the course's or one given in its place), the vocabulary's EOS id (None: a model
    without one, whose constrained output ends when the state is accepting and allows no token) and its size (the
    number of token ids: an engine checks it against its model's)."""
    dfa: ByteDFA
    next: list
    eos_token_id: int | None
    vocab_size: int | None = None

    @classmethod
    def build(cls, pattern: str, token_bytes: list, eos_token_id: int | None = None, *, token_index=token_index,
              max_states: int = MAX_STATES, max_walks: int | None = None):
        """max_states: ``regex_dfa``'s bound on the pattern's automaton (ValueError beyond it); max_walks: None, or
        the most DFA states x tokens the index may cost (it walks each token from each state, and may hold an entry
        for each: ValueError beyond it, before any walk)."""
        if eos_token_id is not None and not 0 <= eos_token_id < len(token_bytes):
            raise ValueError(f"eos_token_id must be in [0, {len(token_bytes) - 1}] or None, got {eos_token_id}")
        if eos_token_id is not None and token_bytes[eos_token_id]:
            token_bytes = list(token_bytes)
            token_bytes[eos_token_id] = b""  # EOS is never text
        dfa = regex_dfa(pattern, max_states=max_states)
        if max_walks is not None and dfa.num_states * len(token_bytes) > max_walks:
            raise ValueError(f"its token index needs {dfa.num_states} DFA states x {len(token_bytes)} tokens = "
                             f"{dfa.num_states * len(token_bytes)} walks, more than {max_walks}")
        return cls(dfa, token_index(dfa, token_bytes), eos_token_id, len(token_bytes))

    def completable(self) -> "TokenIndex":
        """This index less the tokens that lead to a state from which no sequence of the vocabulary's tokens reaches
        an accepting state (a live state of the byte DFA may need bytes no token spells: a character the vocabulary
        lacks). ValueError when the start state is such a state: no string of the pattern can be written in this
        vocabulary. What a server uses: a request's mask is then never empty before its output is complete."""
        done = set(self.dfa.accepting)
        into: list = [set() for _ in self.next]  # the reversed token transitions
        for state, row in enumerate(self.next):
            for end in row.values():
                into[end].add(state)
        todo = list(done)
        while todo:
            for state in into[todo.pop()] - done:
                done.add(state)
                todo.append(state)
        if self.dfa.start not in done:
            raise ValueError("no string of the pattern can be written with this vocabulary's tokens (it needs a "
                             "character no token spells)")
        rows = [{token: end for token, end in row.items() if end in done} for row in self.next]
        return TokenIndex(self.dfa, rows, self.eos_token_id, self.vocab_size)


def vocabulary_bytes(tokenizer) -> list:
    """Each token id's bytes for a course tokenizer: a CharTokenizer's characters in UTF-8, a BPETokenizer's byte
    strings (``token_bytes`` of ``TokenIndex.build``)."""
    if hasattr(tokenizer, "chars"):
        return [c.encode() for c in tokenizer.chars]
    return [tokenizer.vocab[i] for i in range(tokenizer.vocab_size)]


class IndexCache:
    """Compiled patterns for one vocabulary, the most recently used `size` kept (a bounded LRU: a server meets the
    same schema again and again, and must not hold every pattern it was ever sent). ``get(pattern)``: the
    ``completable`` TokenIndex of the pattern, built on the first request (ValueError as ``TokenIndex.build`` and
    ``completable`` raise it, with states beyond max_states or walks beyond max_walks); thread-safe (a server compiles on worker threads: a
    thread that asks for a pattern another is building waits for that build, so each pattern is built once).

    token_bytes: each token id's bytes, or a function that returns them, called on the first ``get`` (a server
    reads its vocabulary only when a constrained request comes). max_entries: None, or the most token entries (the
    rows' sizes summed) the kept indexes may hold together: the least recently used go first, down to the newest
    (an index of a long pattern over a large vocabulary holds millions, each over a hundred bytes)."""

    def __init__(self, token_bytes, eos_token_id: int | None = None, *, size: int = 64,
                 max_states: int = MAX_STATES, max_walks: int | None = None, max_entries: int | None = None):
        if not is_count(size) or size < 1:
            raise ValueError(f"size must be an integer >= 1 (patterns kept), got {size!r}")
        if max_entries is not None and (not is_count(max_entries) or max_entries < 1):
            raise ValueError(f"max_entries must be None or an integer >= 1, got {max_entries!r}")
        self.token_bytes = token_bytes if callable(token_bytes) else list(token_bytes)
        self.eos_token_id, self.size, self.max_states = eos_token_id, size, max_states
        self.max_walks, self.max_entries = max_walks, max_entries
        self.entries: OrderedDict = OrderedDict()
        self.sizes: dict = {}  # pattern -> its index's token entries
        self.builds = 0  # patterns compiled (a cache hit compiles nothing)
        self.lock = threading.Lock()
        self.building: dict = {}  # pattern -> an Event set when the thread building it is done

    def cached(self, pattern: str) -> TokenIndex | None:
        """The pattern's index if it is kept (it becomes the most recently used), else None: never builds, never
        waits for a build (an event loop may call it)."""
        with self.lock:
            if pattern in self.entries:
                self.entries.move_to_end(pattern)
                return self.entries[pattern]
        return None

    def get(self, pattern: str) -> TokenIndex:
        while True:
            with self.lock:
                if callable(self.token_bytes):
                    self.token_bytes = list(self.token_bytes())
                if pattern in self.entries:
                    self.entries.move_to_end(pattern)
                    return self.entries[pattern]
                building = self.building.get(pattern)
                if building is None:
                    self.building[pattern] = threading.Event()
                    break
            building.wait()  # another thread builds it: take its index (or, if it failed, try again)
        try:
            index = TokenIndex.build(pattern, self.token_bytes, self.eos_token_id, max_states=self.max_states,
                                     max_walks=self.max_walks).completable()
            with self.lock:
                self.builds += 1
                self.entries[pattern], self.sizes[pattern] = index, sum(map(len, index.next))
                while len(self.entries) > self.size or len(self.entries) > 1 and self.max_entries is not None \
                        and sum(self.sizes.values()) > self.max_entries:
                    self.sizes.pop(self.entries.popitem(last=False)[0])
            return index
        finally:
            with self.lock:
                self.building.pop(pattern).set()


@dataclass
class Constraint:
    """One request's constraint: the shared index and this request's DFA state (what an engine holds per request).
    ``mask(logits)`` masks one row (V,); ``advance(token)`` moves the state (ValueError for a token the mask forbids);
    ``finished``: EOS was taken, or the state is accepting and allows no further token."""
    index: TokenIndex
    state: int = 0
    eos_taken: bool = field(default=False)

    def mask(self, logits: torch.Tensor, *, constrained_mask=constrained_mask) -> torch.Tensor:
        return constrained_mask(logits, self.index.next[self.state], self.state in self.index.dfa.accepting,
                                self.index.eos_token_id)

    def advance(self, token: int) -> None:
        token = int(token)
        if token == self.index.eos_token_id and self.state in self.index.dfa.accepting:
            self.eos_taken = True
        elif token in self.index.next[self.state]:
            self.state = self.index.next[self.state][token]
        else:
            raise ValueError(f"token {token} is not allowed in state {self.state}")

    @property
    def finished(self) -> bool:
        return self.eos_taken or (self.state in self.index.dfa.accepting and not self.index.next[self.state])


@torch.no_grad()
def constrained_generate(model, idx: torch.Tensor, max_new_tokens: int, constraint: Constraint, *,
                         greedy: bool = False, temperature: float = 1.0, generator: torch.Generator | None = None,
                         constrained_mask=constrained_mask) -> torch.Tensor:
    """Extend one row idx (1, T) under `constraint` (advanced in place), at most max_new_tokens tokens, through the
    library's one loop (``gpt.extend``): each step's logits masked by ``constrained_mask`` (the course's or the
    learner's), then the argmax (greedy) or a draw from softmax(masked / temperature). Stops early once the
    constraint is finished (EOS taken, or an accepting state that allows nothing more); the EOS token, if taken, is
    the last token. Returns (1, T + n). A constraint that allows no token in a non-accepting state cannot happen:
    its states are live."""
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise ValueError(f"idx must have shape (1, T), got {tuple(idx.shape)}")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0 (or greedy=True), got {temperature}")
    if constraint.finished:
        return idx

    def next_logits(tokens, new):
        logits = model(tokens[:, -model.config.block_size:])[0][0, -1]
        return constraint.mask(logits, constrained_mask=constrained_mask)[None]

    def choose(logits):
        token = greedy_choice(logits) if greedy else sample_choice(logits / temperature, generator)
        constraint.advance(int(token))
        return token

    return extend(idx, max_new_tokens, next_logits, choose, done=lambda tokens: constraint.finished)


def grammar_processor(index: TokenIndex, prompt_len: int, max_len: int, *, constrained_mask=constrained_mask):
    """The logits processor of beam search within the language (``decoding.beam_search``'s ``logits_processor``):
    (beams' tokens (N, t), log-probs (N, V)) -> (N, V), each row masked by ``constrained_mask`` for the automaton state
    its tokens after the first prompt_len lead to. At the last step a string can take (t + 1 == max_len) only EOS is
    allowed, in an accepting state: a string ends there or not at all. A beam whose tokens the language does not allow
    (a dead beam, kept at -inf when fewer extensions than beams remain; one that took EOS) gets -inf everywhere."""
    def process(tokens: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        last = tokens.shape[1] + 1 == max_len
        rows = []
        for generated, row in zip(tokens[:, prompt_len:].tolist(), log_probs):
            state = index.dfa.start
            for token in generated:  # EOS is in no state's entry (its bytes are empty): a string that took it is over
                state = None if state is None else index.next[state].get(token)
            if state is None:
                rows.append(torch.full_like(row, float("-inf")))
            else:
                allowed = {} if last else index.next[state]
                rows.append(constrained_mask(row, allowed, state in index.dfa.accepting, index.eos_token_id))
        return torch.stack(rows)
    return process


def constrained_beam_search(model, idx: torch.Tensor, max_new_tokens: int, index: TokenIndex, num_beams: int, *,
                            constrained_mask=constrained_mask) -> tuple:
    """Beam search within the language: chapter 06's ``beam_search`` whose log-probs pass through
    ``grammar_processor``, each beam masked for its own automaton state. One row idx (1, T) -> (the best finished
    string's row (1, T + n), EOS last, its log-probability under the model, a float).

    A beam's score is the model's own log-probability of its tokens (the log-softmax of the unmasked logits, then
    masked): the search looks for the string of the language the model finds most likely, not the masked sampler's.
    Chapter 06's rules with length_penalty 0: the extensions of all beams are ranked together; one that takes EOS
    (allowed only in an accepting state) becomes a hypothesis if it ranks among the first num_beams (Hugging Face's
    rule), the num_beams best others run on; the search stops once it holds num_beams hypotheses and no running beam
    scores above the worst of them (a log-probability only falls as a string grows), or after max_new_tokens, the
    last of which can only be EOS; the best hypothesis is the result.
    num_beams = 1 is greedy constrained decoding (with the EOS it takes at the end, where ``constrained_generate``
    stops before an EOS that is the only token left); beams enough for every prefix of a finite language find its most
    likely string, EOS included. T + max_new_tokens must fit in the model's block_size (a KV cache of that length).
    ValueError for num_beams < 1, an index without an EOS id (a string ends by taking it), T + max_new_tokens beyond
    the block size, or when no beam finished a string within max_new_tokens (none fits, or the beams dropped every
    prefix of those that do: more beams may find one)."""
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise ValueError(f"idx must have shape (1, T), got {tuple(idx.shape)}")
    if index.eos_token_id is None:
        raise ValueError("index.eos_token_id is None: beam search within the language ends a string by taking EOS; "
                         "build the index with the vocabulary's EOS id")
    if idx.shape[1] + max_new_tokens > model.config.block_size:
        raise ValueError(f"the prompt's length + max_new_tokens must be <= block_size = {model.config.block_size}, "
                         f"got {idx.shape[1]} + {max_new_tokens}")
    process = grammar_processor(index, idx.shape[1], idx.shape[1] + max_new_tokens, constrained_mask=constrained_mask)
    out, scores = beam_search(model, idx, max_new_tokens, num_beams, length_penalty=0.0,
                              eos_token_id=index.eos_token_id, logits_processor=process)
    if scores[0] == float("-inf"):
        raise ValueError(f"no string of the language finished within max_new_tokens = {max_new_tokens} on "
                         f"num_beams = {num_beams} beams: none fits, or the beams dropped the prefixes of those that "
                         "do (more beams may find one)")
    return out, scores[0].item()
