"""A request, its sampling settings and its result; the checks a request passes on arrival; a request inside the engine
(vLLM's ``request.py`` and ``sampling_params.py``, nano-vllm's ``engine/sequence.py`` and ``sampling_params.py``).
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ..decoding import check_settings, process_logits
from ..structured import Constraint, TokenIndex
from ..validation import is_count
from .block_pool import PagedKVCache


@dataclass
class Request:
    """One user's request: a prompt (token ids), how many tokens to generate, when it arrives.

    arrival: the engine step at which it arrives (a logical clock: step 0 is the first). sampling: None
    for greedy, else chapter 06's processor settings (``process_logits``'s keyword arguments, e.g.
    ``dict(temperature=0.8, top_k=20)``; ``SAMPLING`` lists them and their ranges), drawn with a
    ``torch.Generator`` seeded with ``seed`` (other versions of the processor functions go to ``Engine.run``, by the
    plug-in rule). ``validate`` checks every field on arrival.
    The request generates max_new_tokens tokens (no end-of-sequence token here), unless it is constrained.

    constraint: None, or a ``structured.TokenIndex`` (a regex, or a JSON schema as ``structured.schema_regex`` writes
    it, compiled for the model's vocabulary; one index is shared by every request with that pattern): each of its
    sequences holds its own automaton state (``Sequence.constraint``; with n > 1 each choice its own), its tokens
    are those the language allows (``sampler.constrain``, before the processors), its EOS only in accepting states,
    and it finishes early when the language is complete: EOS taken, or an accepting state that allows no token.

    n: how many sequences to generate from the prompt (parallel sampling, OpenAI's ``n``): the prompt is prefilled
    once and its blocks shared. Sequence i is named ``sample_names(request)[i]`` (the request's name for i = 0, then
    ``NAME/1`` ...) and draws from a generator seeded with ``sample_seed(seed, i)`` = (seed + i) mod 2**64: it gets
    the tokens that a request with n = 1 and that seed gets alone. logprobs: None, or k >= 0: each generated token's
    log-probability and the k most likely tokens' (``Result.logprobs``, ``sampler.token_logprobs`` says from which
    distribution).
    """

    name: str
    prompt: list
    max_new_tokens: int
    arrival: int = 0
    sampling: dict | None = None
    seed: int = 0
    n: int = 1
    logprobs: int | None = None
    constraint: TokenIndex | None = None


@dataclass
class Result:
    """What happened to one request: its generated tokens, or the error that rejected or failed it; when, in steps and seconds.

    error is None exactly when the request finished: all max_new_tokens tokens (finish_reason "length"), or a
    constrained request's language complete (finish_reason "stop", see ``Request.constraint``). Otherwise it names
    the request and says why: rejected on arrival (no tokens) or failed in a step (the tokens generated before it
    failed; finish_step None). See ``Engine.run``."""

    name: str
    tokens: list = field(default_factory=list)
    error: str | None = None
    arrival_step: int = 0
    first_token_step: int | None = None
    finish_step: int | None = None
    arrival_time: float = 0.0  # seconds since the start of the run when its arrival step began
    token_times: list = field(default_factory=list)  # seconds since the start of the run, one per token
    preemptions: int = 0
    admissions: list = field(default_factory=list)  # per admission (the first, then one per resume after a preemption):
    # (its tokens then, those of them found in the prefix cache)
    logprobs: list = field(default_factory=list)  # a request with logprobs = k: per token, (its log-probability,
    # [(token, log-probability)] of the k most likely, most likely first); see sampler.token_logprobs
    finish_reason: str | None = None  # a finished request's: "length" or "stop" (its constraint's language complete)

    @property
    def ttft(self) -> float:
        """Time to first token, seconds: from the start of its arrival step to its first token."""
        return self.token_times[0] - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds (None for a single token)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def is_real_number(value) -> bool:
    """A real number (int, float, numpy scalar) that is not a bool (NaN and infinities pass here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: the sampling settings a request may carry, ``process_logits``'s keywords that are not functions, and their defaults
#: (a setting whose default is None may be None); each setting's range is checked by its processor
#: (``decoding.check_settings``), not here
SAMPLING = {name: p.default for name, p in inspect.signature(process_logits).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and not callable(p.default)}
SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes: [-2**63, 2**64)


def sample_seed(seed: int, i: int) -> int:
    """The seed of sequence i of a request seeded with `seed`: (seed + i) mod 2**64 (torch.Generator.manual_seed
    reads a negative seed modulo 2**64 too, so i = 0 keeps the request's own stream)."""
    return (seed + i) % 2 ** 64


def sample_names(request: Request, most: int | None = None) -> list:
    """The names of a request's n sequences: its own for the first, ``NAME/i`` for sequence i >= 1. A request whose n
    is not an integer in [1, most] (most None: no bound) gets its own name only: it is rejected (an engine's pool of
    N blocks holds at most N sequences), and a huge n makes no huge list."""
    n = request.n
    if not is_count(n) or (most is not None and n > most):
        return [request.name]
    return [request.name] + [f"{request.name}/{i}" for i in range(1, n)]


def blocks_for(prompt_len: int, total: int, n: int, block_size: int) -> int:
    """Blocks that n sequences of `total` tokens from one prompt of prompt_len tokens hold at most, all running: the
    prompt's full blocks once (shared), every other block once per sequence (the prompt's last partial block is
    copied on write)."""
    shared = prompt_len // block_size if n > 1 else 0
    return shared + n * (math.ceil(total / block_size) - shared)


def arrival_error(request: Request) -> str | None:
    if not is_count(request.arrival) or request.arrival < 0:
        return f"request {request.name}: arrival must be an integer >= 0 (an engine step), got {request.arrival!r}"
    return None


def validate(request: Request, context: int, num_blocks: int | None = None, block_size: int | None = None, *,
             vocab_size: int | None = None, max_num_seqs: int | None = None) -> None:
    """Raise ValueError, naming the request, the argument and its allowed range, if `request` cannot be served.

    Checked: arrival (an integer >= 0); prompt (a non-empty list or tuple of integer token ids, each in
    [0, vocab_size) when vocab_size is given); max_new_tokens (an integer >= 1); prompt + max_new_tokens within
    the model's context length `context`; its blocks within a pool of num_blocks blocks of block_size tokens (when
    given, with n sequences running at once: ``blocks_for``); n (an integer >= 1, <= max_num_seqs when given);
    logprobs (None or an integer in [0, vocab_size], or >= 0 without vocab_size); sampling (None or a dict of the
    settings in ``SAMPLING``, each a finite number (or None where its default is), in the range its processor checks: ``decoding.check_settings``);
    constraint (None or a ``structured.TokenIndex`` built for a vocabulary of vocab_size tokens, when given); seed
    (an integer that ``torch.Generator.manual_seed`` takes). Everything a request carries is checked here, once, on arrival: the
    engine's steps check nothing per token. See ``Engine.run``.
    """
    name, prompt = request.name, request.prompt
    arrival = arrival_error(request)
    if arrival:
        raise ValueError(arrival)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"request {name}: prompt must be a list of token ids, got {type(prompt).__name__}")
    if len(prompt) < 1:
        raise ValueError(f"request {name}: prompt must hold at least 1 token, got an empty prompt")
    for i, token in enumerate(prompt):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0 \
                or (vocab_size is not None and token >= vocab_size):
            allowed = "integers >= 0" if vocab_size is None else f"integers in [0, vocab_size = {vocab_size})"
            raise ValueError(f"request {name}: prompt token ids must be {allowed}, got {token!r} at position {i}")
    if not is_count(request.max_new_tokens) or request.max_new_tokens < 1:
        raise ValueError(f"request {name}: max_new_tokens must be an integer >= 1, got {request.max_new_tokens!r}")
    total = len(prompt) + request.max_new_tokens
    if total > context:
        raise ValueError(f"request {name}: prompt length + max_new_tokens must be <= the model's context length, "
                         f"context = {context}, got {len(prompt)} + {request.max_new_tokens}")
    error = n_error(request.n, max_num_seqs)
    if error:
        raise ValueError(f"request {name}: {error}")
    if num_blocks is not None:
        need = blocks_for(len(prompt), total, request.n, block_size)
        if need > num_blocks:
            raise ValueError(f"request {name}: num_blocks = {num_blocks} is too small: this request needs "
                             f"{need} blocks of {block_size} tokens"
                             + (f" for its n = {request.n} sequences" if request.n > 1 else ""))
    error = logprobs_error(request.logprobs, vocab_size, "vocab_size")
    if error:
        raise ValueError(f"request {name}: {error}")
    if request.sampling is not None:
        if not isinstance(request.sampling, Mapping):
            raise ValueError(f"request {name}: sampling must be None (greedy) or a dict of settings, "
                             f"got {type(request.sampling).__name__}")
        for key, value in request.sampling.items():
            if key not in SAMPLING:
                raise ValueError(f"request {name}: sampling has no setting {key!r}; the settings are "
                                 f"{', '.join(SAMPLING)}")
            if not (value is None and SAMPLING[key] is None) and not (is_real_number(value) and math.isfinite(value)):
                allowed = "None or a finite number" if SAMPLING[key] is None else "a finite number"
                raise ValueError(f"request {name}: sampling {key} must be {allowed}, got {value!r}")
            try:
                check_settings(vocab_size or 1, **{key: value})
            except ValueError as error:
                raise ValueError(f"request {name}: sampling {key}: {error}") from None
    if request.constraint is not None and (not isinstance(request.constraint, TokenIndex) or (
            vocab_size is not None and request.constraint.vocab_size != vocab_size)):
        found = request.constraint.vocab_size if isinstance(request.constraint, TokenIndex) else \
            type(request.constraint).__name__
        raise ValueError(f"request {name}: constraint must be None or a structured.TokenIndex built for the model's "
                         f"vocabulary of {vocab_size} tokens, got {found}")
    if not is_count(request.seed) or not SEED_RANGE[0] <= request.seed < SEED_RANGE[1]:
        raise ValueError(f"request {name}: seed must be an integer in [-2**63, 2**64), got {request.seed!r}")


def n_error(n, max_num_seqs: int | None = None) -> str | None:
    """Why `n` (sequences to generate from one prompt) is not an integer >= 1 (and <= max_num_seqs when given), or
    None: ``validate``'s check of ``Request.n``, and the server's."""
    if not is_count(n) or n < 1 or (max_num_seqs is not None and n > max_num_seqs):
        cap = "" if max_num_seqs is None else f" and <= max_num_seqs = {max_num_seqs} (they run at once)"
        return f"n must be an integer >= 1{cap} (sequences to generate), got {n!r}"
    return None


def logprobs_error(k, most: int | None = None, most_name: str = "") -> str | None:
    """Why `k` (the top log-probabilities returned per token) is not None or an integer in [0, most] (>= 0 when most
    is None), or None: ``validate``'s check of ``Request.logprobs``, and the server's. most_name names the bound."""
    if k is not None and (not is_count(k) or k < 0 or (most is not None and k > most)):
        allowed = "an integer >= 0" if most is None else f"an integer in [0, {most_name} = {most}]"
        return f"logprobs must be None or {allowed} (the top tokens returned per token), got {k!r}"
    return None


def pending_requests(requests: list, most_n: int | None = None) -> tuple:
    """({name: Result}, the requests to serve sorted by arrival): a Result for each of a request's ``sample_names``
    (with `most`: most_n). A request whose arrival is not an integer >= 0 gets its error at once (it has no arrival
    step to wait for). Names must be unique (results are keyed by them)."""
    results = {}
    for r in requests:
        for name in sample_names(r, most_n):
            if name in results:
                raise ValueError(f"request names must be unique (the results are keyed by name, a request with n > 1 "
                                 f"takes NAME/1 ...): {name!r} appears twice")
            results[name] = Result(name, arrival_step=r.arrival)
    timed = []
    for r in requests:
        error = arrival_error(r)
        if error:
            results[r.name].error = error
        else:
            timed.append(r)
    return results, sorted(timed, key=lambda r: r.arrival)  # stable: equal arrivals keep their order


class Sequence:
    """A request inside the engine: its tokens so far, how many are cached, its block table.

    A request with n > 1 is one sequence (its first, ``name`` the request's) until its prompt is computed; it holds
    ``forks``, the Results of the others, which ``fork`` then makes into sequences sharing its blocks."""

    def __init__(self, request: Request, result: Result, cache: PagedKVCache, forks: list = (), index: int = 0):
        self.request, self.result, self.cache = request, result, cache
        self.name, self.index = result.name, index
        self.tokens = list(request.prompt)
        self.prompt_len = len(request.prompt)
        self.n_cached = 0
        self.blocks: list = []  # the block table
        self.hit: list = []  # blocks of a cached prefix found while waiting (no reference taken yet)
        self.generator = torch.Generator().manual_seed(sample_seed(request.seed, index))
        self.forks = list(forks)  # (index, Result) of the sequences still to fork from this one's prompt
        self.shared_tail = False  # a forked sequence: its last block may be shared (copied before it is written)
        self.constraint = None if request.constraint is None else Constraint(request.constraint)  # its own state

    def fork(self) -> list:
        """The sequences of ``forks``, made now (the prompt computed): each shares every block (one more reference),
        with its own Result, generator and constraint state; the last block, if partly filled, is copied by the first
        that writes it."""
        children = []
        for index, result in self.forks:
            child = Sequence(self.request, result, self.cache, index=index)
            child.tokens, child.n_cached, child.blocks = list(self.tokens), self.n_cached, list(self.blocks)
            if self.constraint is not None:  # its own automaton state, from this one's (never shared)
                child.constraint = Constraint(self.constraint.index, self.constraint.state)
            for block in self.blocks:
                self.cache.share(block)
            child.shared_tail = True
            children.append(child)
        self.forks, self.shared_tail = [], True
        return children

    def tail_copy_needed(self) -> bool:
        """The next token goes into a partly filled block another sequence holds: it must be copied first."""
        return (self.shared_tail and bool(self.blocks) and self.n_cached % self.cache.block_size != 0
                and self.cache.refs[self.blocks[-1]] > 1)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def find_prefix(self, share: bool) -> None:
        """While waiting: find the cached blocks of its prefix (references are taken on admission), start after them.

        The last token is always computed (its logits give the next token), so only blocks within the first
        n_tokens - 1 tokens are looked up: when every block of the tokens is cached, the last one is computed
        again into a fresh block (vLLM does the same), and no sequence ever writes into a block another holds."""
        self.hit = self.cache.lookup(self.tokens[:-1]) if share else []
        self.n_cached = len(self.hit) * self.cache.block_size

    def blocks_needed(self, n: int) -> int:
        """Blocks taken from the free list to cache n more tokens: new ones, and (waiting) cached ones now free.

        Two waiting sequences that found the same free block both count it, so admission may stop a step early
        (never take more blocks than are free)."""
        S = self.cache.block_size
        table = self.blocks or self.hit  # a waiting sequence's table will be its cached prefix
        reused = 0 if self.blocks else sum(1 for b in self.hit if self.cache.refs[b] == 0)  # on the free list
        copied = self.shared_tail and self.tail_copy_needed()  # copy on write (a forked sequence only)
        return max(0, math.ceil((self.n_cached + n) / S) - len(table)) + reused + copied

    def blocks_freed(self) -> int:
        """Blocks only this sequence holds (reference count 1): they go back to the free list if it is preempted.

        A block it shares only with other sequences preempted in the same step is freed too but not counted
        here, so the scheduler may then preempt more than it needs (never less)."""
        return sum(1 for b in self.blocks if self.cache.refs[b] == 1)

