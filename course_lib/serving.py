"""Serving many users at once, chapter 12: continuous batching and a paged KV cache.

Requests arrive at different times and want different numbers of tokens. ``static_batching`` runs
them the simple way (chapter 05's left-padded batch, a cache preallocated for the batch's longest
prompt plus its longest output in every row, the batch waits for its longest member). ``Engine`` runs
them the way serving engines do (Orca's iteration-level scheduling, Yu et al. 2022; vLLM's
PagedAttention, Kwon et al. 2023; chunked prefill under a token budget as in Sarathi and Sarathi-Serve,
Agrawal et al. 2023 and 2024, and vLLM):

* **continuous batching**: at every step requests join and leave the running batch; the prompt of a
  new request is prefilled in chunks beside the decode steps of the others, under a token budget;
* **a paged KV cache**: one pool of fixed-size blocks per layer, a block table per sequence, a free
  list; attention reads keys and values through the block table;
* **a prefix cache** (vLLM's automatic prefix caching): a full block is known by the hash of its tokens
  and its prefix's hash; a sequence whose tokens start the same way shares it (a reference count) instead
  of computing it; a block nobody holds stays cached on the free list and is evicted, least recently
  used first, only when a fresh block is needed, so later requests and preempted ones resuming find it;
* **preemption**: when the pool is full, the most recently admitted running sequence gives its blocks
  back and is recomputed later (vLLM's default); it keeps the tokens it generated;
* **a cap on running sequences** (``max_num_seqs``, vLLM's name; none by default): the engine admits no
  more once that many run;
* **per-request sampling**: each request carries its own chapter 06 processors and its own
  ``torch.Generator``, so its random stream does not depend on the batch it ran in (its logits may,
  by float rounding: the tests check that its tokens do not, on their models and traces).

Shapes: L layers, H heads, Dh head size, C = H * Dh, N blocks in the pool, S block size (slots per
block), V vocabulary. The pool of one layer holds keys (N, S, H, Dh) and values (N, S, H, Dh); slot
``b * S + o`` is offset o of block b.

The ``Trace`` of a run counts, per step, the tokens through the forward pass and those in prompt chunks
(the cost of shared prefixes, recompute and prefill interference, in tokens), beside each step's seconds.
``static_batching`` reserves each batch's cache from the requests' true output lengths (an oracle) or the
model's context per row (``reserve="context"``). ``serving_stats`` measures what a run gave its users (throughput,
time to first token, time per output token, in steps and seconds); ``load_sweep`` runs systems over traces (the
request-rate and token-budget sweeps of chapter 12 and ``course bench serve``).

``slot_mapping``, ``paged_attention`` and ``schedule_step`` are the reference solutions of
chapter 12's exercises (``tests/grading/test_solution_drift.py`` keeps them equal to the notebook's).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import random
import statistics
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from .decoding import process_logits
from .gpt import gpt_layers
from .kv_cache import KVCache, cached_forward
from .validation import check_positive, is_count

# ----------------------------------------------------------------------------------------------------
# the three exercises


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where the tokens at `positions` live in the pool: flat slots (T,) int64.

    block_table (n,) int64: the blocks of one sequence, in order (block_table[i] holds positions
    i * block_size .. (i + 1) * block_size - 1); positions (T,) int64, each in [0, n * block_size). A slot is an
    index into the pool's token rows, viewed as (num_blocks * block_size, ...): block b's rows are
    b * block_size .. (b + 1) * block_size - 1. The tests use scattered tables, block_size 1, a block
    larger than the sequence and no positions at all.
    """
    block = block_table[positions // block_size]  # (T,): which block of the pool
    offset = positions % block_size  # (T,): where inside it
    return block * block_size + offset


def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> torch.Tensor:
    """One decode step of attention for B sequences whose keys and values live in a paged pool: (B, H, Dh).

    q (B, H, Dh): the query of each sequence's newest token; key_pool, value_pool (N, S, H, Dh);
    block_tables (B, M) int64: row b lists sequence b's blocks in order (entries past its last block
    are padding: any valid block index); context_lens (B,) int64: sequence b attends to its positions
    0 .. context_lens[b] - 1 (its newest token's key included), read through its block table. Slots
    past context_lens[b] (the rest of a partly filled block, and padding blocks) are never attended to.
    Scaled by 1 / sqrt(Dh). Returns the same dtype as q.
    """
    B, H, Dh = q.shape
    M, S = block_tables.shape[1], key_pool.shape[1]
    blocks = block_tables.reshape(-1)  # (B * M,): every sequence's blocks, in order
    keys = key_pool.index_select(0, blocks).view(B, M * S, H, Dh)  # row b: its positions 0 .. M * S - 1
    values = value_pool.index_select(0, blocks).view(B, M * S, H, Dh)
    valid = torch.arange(M * S, device=q.device)[None, :] < context_lens[:, None]  # (B, M * S)
    return F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=valid[:, None, None, :])[:, :, 0]  # (B, H, Dh)


def schedule_step(running: list, waiting: list, num_free_blocks: int, token_budget: int):
    """One step of the scheduler: which sequences run, with how many tokens, and which are preempted.

    Inputs: running, the running sequences, oldest admission first; waiting, the waiting ones, first come
    first; num_free_blocks, int >= 0; token_budget, int >= 1. A sequence has ``n_tokens`` and ``n_cached``
    (ints, n_cached < n_tokens), ``blocks_needed(n)`` and ``blocks_freed()`` (ints).
    Returns (scheduled, preempted): scheduled, a list of (sequence, n) pairs, the running sequences first,
    then the waiting ones, each in the order of its list; preempted, a list of running sequences in the
    order they were preempted. The policy that decides them is chapter 12's, section 3.
    Invariants: 1 <= n <= n_tokens - n_cached for every pair; the n sum to at most token_budget; the
    blocks_needed(n) of the pairs sum to at most num_free_blocks plus the blocks_freed() of the preempted;
    no sequence is both scheduled and preempted; a waiting sequence is scheduled only if nothing was
    preempted and every waiting sequence before it was scheduled. Neither list is changed (the engine moves
    the sequences itself). Raises nothing: the engine passes only valid sequences.
    Hidden tests (hand-made sequences, ``checks.fake_sequence``): which sequences are preempted and in what
    order, when blocks run out (the freed count is blocks_freed(), a sequence that cannot fit preempts
    itself, no admission after a preemption); the budget capping running and waiting sequences alike, a
    prefill continuing with its next chunk, a waiting sequence with tokens already cached.
    """
    scheduled, preempted = [], []
    budget, free = token_budget, num_free_blocks
    candidates = list(running)  # the running sequences not yet scheduled or preempted
    while candidates and budget > 0:
        seq = candidates.pop(0)
        n = min(seq.n_tokens - seq.n_cached, budget)
        need = seq.blocks_needed(n)
        while need > free and candidates:
            victim = candidates.pop()  # the most recently admitted one
            preempted.append(victim)
            free += victim.blocks_freed()
        if need > free:  # nobody else left to preempt: seq itself goes
            preempted.append(seq)
            break
        scheduled.append((seq, n))
        budget -= n
        free -= need
    if not preempted:
        for seq in waiting:
            if budget <= 0:
                break
            n = min(seq.n_tokens - seq.n_cached, budget)
            need = seq.blocks_needed(n)
            if need > free:
                break
            scheduled.append((seq, n))
            budget -= n
            free -= need
    return scheduled, preempted


# ----------------------------------------------------------------------------------------------------
# requests and their results


@dataclass
class Request:
    """One user's request: a prompt (token ids), how many tokens to generate, when it arrives.

    arrival: the engine step at which it arrives (a logical clock: step 0 is the first). sampling: None
    for greedy, else chapter 06's processor settings (``process_logits``'s keyword arguments, e.g.
    ``dict(temperature=0.8, top_k=20)``, and other versions of its processor functions by name, e.g.
    ``top_k_filter=my_top_k_filter``; ``SAMPLING`` lists them and their ranges), drawn with a
    ``torch.Generator`` seeded with ``seed``. ``validate`` checks every field on arrival.
    The request always generates max_new_tokens tokens (no end-of-sequence token here).
    """

    name: str
    prompt: list
    max_new_tokens: int
    arrival: int = 0
    sampling: dict | None = None
    seed: int = 0


@dataclass
class Result:
    """What happened to one request: its generated tokens, or the error that rejected or failed it; when, in steps and seconds.

    error is None exactly when the request finished (all max_new_tokens tokens). Otherwise it names the request and
    says why: rejected on arrival (no tokens) or failed in a step (the tokens generated before it failed; finish_step
    None). See ``Engine``."""

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


def _number(value) -> bool:
    """A real number (int, float, numpy scalar) that is not a bool; NaN passes here and fails every range below."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: the sampling settings a request may carry (``process_logits``'s keyword arguments): a check and its range in words
SAMPLING = {
    "temperature": (lambda v: _number(v) and 0 <= v < math.inf, "a finite number >= 0 (0 means greedy)"),
    "top_k": (lambda v: v is None or (is_count(v) and v >= 0), "None or an integer >= 0 (0 and None disable it)"),
    "top_p": (lambda v: v is None or (_number(v) and 0 < v <= 1), "None or a number in (0, 1]"),
    "min_p": (lambda v: v is None or (_number(v) and 0 <= v <= 1), "None or a number in [0, 1]"),
    "repetition_penalty": (lambda v: v is None or (_number(v) and 0 < v < math.inf),
                           "None or a finite number > 0 (1 means no penalty)"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    **{name: (callable, f"a function (the course's decoding.{name} by default)") for name in (
        "apply_repetition_penalty", "apply_frequency_presence_penalty", "apply_temperature", "top_k_filter",
        "top_p_filter", "min_p_filter")},
}
SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes: [-2**63, 2**64)


def _arrival_error(request: Request) -> str | None:
    if not is_count(request.arrival) or request.arrival < 0:
        return f"request {request.name}: arrival must be an integer >= 0 (an engine step), got {request.arrival!r}"
    return None


def validate(request: Request, context: int, num_blocks: int | None = None, block_size: int | None = None, *,
             vocab_size: int | None = None) -> None:
    """Raise ValueError, naming the request, the argument and its allowed range, if `request` cannot be served.

    Checked: arrival (an integer >= 0); prompt (a non-empty list or tuple of integer token ids, each in
    [0, vocab_size) when vocab_size is given); max_new_tokens (an integer >= 1); prompt + max_new_tokens within
    the model's context length `context`; its blocks within a pool of num_blocks blocks of block_size tokens (when
    given); sampling (None or a dict of the settings in ``SAMPLING``, each in its range); seed (an integer that
    ``torch.Generator.manual_seed`` takes). Everything a request carries is checked here, once, on arrival: the
    engine's steps check nothing per token. See ``Engine``.
    """
    name, prompt = request.name, request.prompt
    arrival = _arrival_error(request)
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
    if num_blocks is not None:
        need = math.ceil(total / block_size)
        if need > num_blocks:
            raise ValueError(f"request {name}: num_blocks = {num_blocks} is too small: this request needs "
                             f"{need} blocks of {block_size} tokens")
    if request.sampling is not None:
        if not isinstance(request.sampling, Mapping):
            raise ValueError(f"request {name}: sampling must be None (greedy) or a dict of settings, "
                             f"got {type(request.sampling).__name__}")
        for key, value in request.sampling.items():
            if key not in SAMPLING:
                raise ValueError(f"request {name}: sampling has no setting {key!r}; the settings are "
                                 f"{', '.join(SAMPLING)}")
            check, allowed = SAMPLING[key]
            if not check(value):
                raise ValueError(f"request {name}: sampling {key} must be {allowed}, got {value!r}")
    if not is_count(request.seed) or not SEED_RANGE[0] <= request.seed < SEED_RANGE[1]:
        raise ValueError(f"request {name}: seed must be an integer in [-2**63, 2**64), got {request.seed!r}")


def _choose(logits: torch.Tensor, greedy: int, tokens: list, prompt_len: int, sampling: dict | None, generator) -> int:
    """The next token from one row of logits (V,): `greedy` (the row's argmax, ``_argmaxes``) when sampling is None,
    else a draw after chapter 06's processors."""
    if sampling is None:
        return greedy
    ids = torch.tensor([tokens])
    scores = process_logits(logits[None].float(), ids, ids[:, prompt_len:], **sampling)
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def _argmaxes(logits: torch.Tensor) -> list:
    """The argmax of every row of logits (n, V), in one operation: n ints (the greedy requests' tokens of a step)."""
    return logits.argmax(-1).tolist()


# ----------------------------------------------------------------------------------------------------
# the paged cache


def block_hashes(tokens: list, block_size: int) -> list:
    """The hash of every full block of `tokens`, in order: block i's is hash((block i - 1's hash, its tokens)).

    Block 0's parent is None. So a block's hash stands for its tokens and every token before them (vLLM's
    automatic prefix caching keys its blocks the same way). Python's hash of a tuple of ints is not
    collision-free: ``PagedKVCache.lookup`` compares the tokens too, so a collision can only miss, never hit."""
    hashes, parent = [], None
    for end in range(block_size, len(tokens) + 1, block_size):
        parent = hash((parent, tuple(tokens[end - block_size:end])))
        hashes.append(parent)
    return hashes


class PagedKVCache:
    """Keys and values of every layer in one pool of blocks: storage (L, 2, N, S, H, Dh).

    The pool is shared by all sequences. ``allocate()`` takes a block from the free list (reference count 1),
    ``share(b)`` adds a reference, ``release(b)`` drops one and puts the block at the end of the free list at
    zero. Automatic prefix caching, as vLLM's: a full block is remembered by its hash (``block_hashes``: its
    tokens and its prefix's hash) with ``register``, and found by ``lookup``. A released block **stays**
    remembered while it sits on the free list: a later request with the same prefix, or a preempted one
    resuming, still finds it, and ``share`` takes it back off the list. The free list is kept least recently
    freed first; ``allocate`` takes its first block and, if that block is remembered, forgets it (an eviction,
    counted in ``evictions``): freed blocks are evicted least recently used first, and only when a fresh block
    is needed.
    """

    def __init__(self, n_layer: int, n_head: int, head_dim: int, num_blocks: int, block_size: int, *,
                 dtype=torch.float32):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            check_positive(name, value)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.storage = torch.zeros(n_layer, 2, num_blocks, block_size, n_head, head_dim, dtype=dtype)
        #: per layer, views of its pool made once: (its slots (2, N * S, H * Dh), key pool, value pool (N, S, H, Dh))
        self.layers = [(pool.view(2, -1, n_head * head_dim), pool[0], pool[1]) for pool in self.storage]
        self.free = OrderedDict.fromkeys(range(num_blocks))  # the free list, least recently freed first
        self.refs = [0] * num_blocks  # reference counts
        self.cached: dict = {}  # block hash -> the block remembered under it
        self.hash_of: dict = {}  # block -> (its hash, its parent's hash, its tokens): what it was remembered as
        self.evictions = 0  # remembered free blocks forgotten to be reused

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> "PagedKVCache":
        c = model.config
        return cls(c.n_layer, c.n_head, c.n_embd // c.n_head, num_blocks, block_size,
                   dtype=model.transformer.wte.weight.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in all layers, keys and values."""
        return self.storage[:, :, 0].numel() * self.storage.element_size()

    def allocate(self) -> int:
        """A fresh block (reference count 1): the least recently freed, evicted from the prefix cache if remembered."""
        if not self.free:
            raise RuntimeError("the pool has no free block (the scheduler should have preempted)")
        block, _ = self.free.popitem(last=False)
        remembered = self.hash_of.pop(block, None)
        if remembered is not None:
            del self.cached[remembered[0]]
            self.evictions += 1
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more reference; a remembered block found on the free list leaves it."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One reference less; at zero the block goes to the end of the free list, still remembered."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def release_all(self, blocks: list) -> None:
        """Release a sequence's blocks, its last block first: a prefix outlives the blocks after it (as in vLLM)."""
        for block in reversed(blocks):
            self.release(block)

    def register(self, tokens: tuple, block: int) -> None:
        """Remember that `block` holds the last block_size of `tokens` (all of them computed, in order).

        A block already remembered, or a hash already taken (the same prefix computed twice), is left as it is."""
        S = self.block_size
        hashes = block_hashes(tokens, S)
        if block in self.hash_of or hashes[-1] in self.cached:
            return
        parent = hashes[-2] if len(hashes) > 1 else None
        self.cached[hashes[-1]] = block
        self.hash_of[block] = (hashes[-1], parent, tuple(tokens[-S:]))

    def lookup(self, tokens: list) -> list:
        """The remembered blocks that hold the longest run of full blocks at the start of `tokens` (in use or free)."""
        blocks, parent, S = [], None, self.block_size
        for i, h in enumerate(block_hashes(tokens, S)):
            block = self.cached.get(h)
            if block is None or self.hash_of[block] != (h, parent, tuple(tokens[i * S:(i + 1) * S])):
                break
            blocks.append(block)
            parent = h
        return blocks


class Sequence:
    """A request inside the engine: its tokens so far, how many are cached, its block table."""

    def __init__(self, request: Request, result: Result, cache: PagedKVCache):
        self.request, self.result, self.cache = request, result, cache
        self.tokens = list(request.prompt)
        self.prompt_len = len(request.prompt)
        self.n_cached = 0
        self.blocks: list = []  # the block table
        self.hit: list = []  # blocks of a cached prefix found while waiting (no reference taken yet)
        self.generator = torch.Generator().manual_seed(request.seed)

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
        return max(0, math.ceil((self.n_cached + n) / S) - len(table)) + reused

    def blocks_freed(self) -> int:
        """Blocks only this sequence holds (reference count 1): they go back to the free list if it is preempted.

        A block it shares only with other sequences preempted in the same step is freed too but not counted
        here, so the scheduler may then preempt more than it needs (never less)."""
        return sum(1 for b in self.blocks if self.cache.refs[b] == 1)


# ----------------------------------------------------------------------------------------------------
# one forward pass over the scheduled chunks of many sequences


@dataclass
class _Layout:
    """Where every token of a forward pass over many chunks goes, worked out once per pass (not per layer).

    Shapes: n chunks, N tokens in all; B_d chunks of one token (decodes), M_d the longest block table among
    them; P longer chunks (prefill), T_p the longest of them, K_p the most keys one of them reads (its start +
    its length). The prefill fields are None when every chunk is one token (a decode-only step)."""

    ids: torch.Tensor  # (N,) int64: the tokens, chunk after chunk
    positions: torch.Tensor  # (N,) int64: their positions in their sequences
    slots: torch.Tensor  # (N,) int64: the pool slot each new key and value goes into
    last: torch.Tensor  # (n,) int64: the row of each chunk's last token
    decode_rows: torch.Tensor  # (B_d,) int64: the rows of the one-token chunks
    decode_tables: torch.Tensor  # (B_d, M_d) int64: their block tables, padded with valid blocks (the next tables')
    decode_lens: torch.Tensor  # (B_d,) int64: the tokens each attends to (its start + 1)
    prefill_rows: torch.Tensor | None = None  # (P, T_p) int64: the rows of each longer chunk's queries (padding: its last)
    prefill_real: torch.Tensor | None = None  # (P, T_p) bool: a query of the chunk (not padding)
    prefill_slots: torch.Tensor | None = None  # (P, K_p) int64: its keys' slots, positions 0 .. start + length - 1, padding
    prefill_allowed: torch.Tensor | None = None  # (P, 1, T_p, K_p) bool: query i of a chunk at start s sees 0 .. s + i


def _int64(values) -> torch.Tensor:
    """Integers (a NumPy array or a list) as an int64 tensor: through NumPy, several times cheaper than ``torch.tensor``
    on a list, which matters in a step whose tensors are small."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def _joined(rows: list) -> np.ndarray:
    """Lists of ints or 1-D int64 tensors, end to end: one int64 array (no tensor made per row)."""
    return np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])


def _layout(chunks: list, S: int, slot_mapping=slot_mapping) -> _Layout:
    """The `_Layout` of a forward pass over `chunks` ((block_table, start, tokens), as ``paged_forward`` takes them).

    The block tables laid end to end are one long table, in which position p of a chunk whose table begins at
    block o is position o * S + p: so one call of slot_mapping gives the slots of every new token, and one more those
    of every prefill chunk's keys, whatever the number of chunks; the decodes' tables, padded, are one gather from
    it. The index arithmetic is vectorised in NumPy (as vLLM prepares its inputs): a fixed number of operations
    per pass, none per sequence."""
    long_table = _joined([t for t, _, _ in chunks])  # every block table, end to end
    table = torch.from_numpy(long_table)
    starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
    lengths = np.array([len(tokens) for _, _, tokens in chunks], dtype=np.int64)
    widths = np.array([len(t) for t, _, _ in chunks], dtype=np.int64)
    offsets = np.cumsum(widths) - widths  # where each chunk's table begins in the long one, in blocks
    ends = np.cumsum(lengths)  # one past each chunk's last row
    first = ends - lengths  # each chunk's first row
    chunk = np.repeat(np.arange(len(chunks)), lengths)  # (N,): the chunk of each token
    positions = starts[chunk] + np.arange(ends[-1]) - first[chunk]
    decode, prefill = np.flatnonzero(lengths == 1), np.flatnonzero(lengths > 1)
    M_d = int(widths[decode].max(initial=0))
    gather = np.minimum(offsets[decode, None] + np.arange(M_d), len(table) - 1)  # (B_d, M_d); padding: the next tables'
    layout = _Layout(ids=torch.from_numpy(_joined([tokens for _, _, tokens in chunks])), positions=_int64(positions),
                     slots=slot_mapping(table, _int64(offsets[chunk] * S + positions), S), last=_int64(ends - 1),
                     decode_rows=_int64(first[decode]), decode_tables=_int64(long_table[gather]),
                     decode_lens=_int64(starts[decode] + 1))
    if len(prefill):
        t, k = np.arange(lengths[prefill].max()), np.arange((starts + lengths)[prefill].max())
        start, length = starts[prefill, None], lengths[prefill, None]
        keys = np.minimum(k[None, :], start + length - 1)  # (P, K_p): padding repeats the last key
        layout.prefill_rows = _int64(first[prefill, None] + np.minimum(t[None, :], length - 1))
        layout.prefill_real = torch.from_numpy(t[None, :] < length)
        layout.prefill_slots = slot_mapping(table, _int64(offsets[prefill, None] * S + keys).flatten(), S).view(keys.shape)
        layout.prefill_allowed = torch.from_numpy(k[None, None, :] <= (start + t[None, :])[:, :, None])[:, None]
    return layout


def _prefill_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Attention of every prefill chunk's queries against its cached keys, the chunks padded into one batch: (P, T_p, H, Dh).

    q (N, H, Dh): every token's query; key_pool, value_pool (N_blocks, S, H, Dh). Chunk p's query i (at position
    start + i) attends to its positions 0 .. start + i, gathered through its block table (``layout.prefill_slots``)."""
    H, Dh = q.shape[1:]
    keys = key_pool.view(-1, H, Dh)[layout.prefill_slots].transpose(1, 2)  # (P, H, K_p, Dh)
    values = value_pool.view(-1, H, Dh)[layout.prefill_slots].transpose(1, 2)  # (P, H, K_p, Dh)
    queries = q[layout.prefill_rows].transpose(1, 2)  # (P, H, T_p, Dh)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.prefill_allowed).transpose(1, 2)


#: Multiply-adds of one layer's linear products in a pass (tokens x 12 C^2) below which the pass runs on one thread.
#: Intra-op threads pay only when an operation's work outweighs waking and joining them; a decode step of a small
#: model is hundreds of operations of microseconds, and each parallel one waits for every thread, on a busy machine
#: for a descheduled thread's time slice (measured here: the course model's engine 25 times slower at 2 threads
#: than at 1 on a loaded 2-core machine). Above it (GPT-2 small's width from 3 tokens) ``ThreadChoice`` measures.
ONE_THREAD_WORK = 2 ** 24


@dataclass
class _Probe:
    """One probe of ``ThreadChoice``: the thread count it chose for passes of its rows, and what it cost."""

    rows: int
    threads: int
    seconds: float  # what the whole probe took, both counts' calls
    credit: float = 0.0  # seconds the model's passes have taken since
    fastest: dict = field(default_factory=dict)  # rows -> the fewest seconds per token of a pass it decided, since
    slow: int = 0  # the passes in a row it decided that were slow (see ThreadChoice's stall)


class ThreadChoice:
    """Whether one thread or the caller's n runs a model's passes faster, measured on a probe now and again.

    Which is faster depends on the pass's size and on the machine's load, which changes: on a machine shared with
    other work every parallel operation waits for a descheduled thread (measured on a 2-core machine with both
    cores kept busy: GPT-2 small's passes 3 to 4 times slower at 2 threads than at 1), while on a quiet one the
    second core pays (1.6 times faster). A pass on the slower count costs too much to try, so ``pick`` times a
    probe instead (``probe()``: one block of the model on the pass's rows, its tokens rounded up to a power of
    two), at each count in turn, up to ``calls`` times: n threads win a call if they beat one thread's by
    ``margin``. n threads are chosen if they win more than half of the calls, one thread otherwise; the probe
    stops as soon as that is decided.

    A pass of more rows gains more from a second thread than one of fewer, so a probe speaks for other sizes too:
    one that chose one thread holds for passes of as many rows or fewer, one that chose n for as many or more
    (the nearest in rows speaks); a pass probes only when no fresh probe speaks for it. Two things make probes
    stale:

    * time: once the model's passes have taken ``explore`` times what a probe took, it is stale (so probing costs
      about 1 / explore of the time, and a machine that has become quiet is noticed);
    * a stall: ``stall_passes`` passes in a row on n threads, each more than ``stall`` times slower per token than
      the fastest pass of its rows that the same probe decided, mean that load has come: every probe of the model
      that chose n is stale. (Passes are compared with passes, not with the probe: a pass also reads its
      sequences' cached keys and values and runs the LM head, which a block on its rows does not; and with more
      than one, as one pass of a different mix of prompt chunks and decodes, or one burst, can be that slow.)

    The probes that speak for a pass always agree (a probe is made only where none speaks); the nearest in rows
    decides it, and its passes are the ones compared.

    Probes are kept per model and caller's thread count (``pick``'s `model`, `n`).
    """

    def __init__(self, explore: float = 20.0, calls: int = 5, margin: float = 1.2, stall: float = 2.0,
                 stall_passes: int = 2):
        self.explore, self.calls, self.margin, self.stall, self.stall_passes = explore, calls, margin, stall, stall_passes
        self.probes: dict = {}  # (model, n) -> {rows: its latest _Probe}

    def pick(self, model: tuple, rows: int, n: int, probe) -> _Probe:
        """The probe that decides a pass of `rows` rows of `model` (its ``threads``: 1 or n), probed now if need be."""
        kept = self.probes.setdefault((model, n), {})
        speaks = [p for p in kept.values() if p.credit < self.explore * p.seconds
                  and (p.rows == rows or (p.rows > rows and p.threads == 1) or (p.rows < rows and p.threads > 1))]
        if speaks:
            return min(speaks, key=lambda p: abs(math.log2(p.rows / rows)))
        start, wins = time.perf_counter(), 0
        for calls in range(1, self.calls + 1):
            seconds = {}
            for threads in (1, n):
                with _threads(threads):
                    begin = time.perf_counter()
                    probe()
                    seconds[threads] = time.perf_counter() - begin
            wins += seconds[n] * self.margin < seconds[1]
            if 2 * wins > self.calls or 2 * (calls - wins) >= self.calls:
                break
        kept[rows] = _Probe(rows, n if 2 * wins > self.calls else 1, time.perf_counter() - start)
        return kept[rows]

    def record(self, model: tuple, n: int, decided_by: _Probe, rows: int, tokens: int, seconds: float) -> None:
        """A pass of `model` (caller's count n) of `tokens` tokens (`rows`: rounded up to a power of two) took
        `seconds` on the thread count `decided_by` chose."""
        kept = self.probes.get((model, n), {})
        for p in kept.values():
            p.credit += seconds
        if decided_by.threads > 1:
            per_token, fastest = seconds / tokens, decided_by.fastest.get(rows, math.inf)
            decided_by.slow = decided_by.slow + 1 if per_token > self.stall * fastest else 0
            if decided_by.slow >= self.stall_passes:
                for p in kept.values():
                    if p.threads > 1:
                        p.credit = math.inf
            decided_by.fastest[rows] = min(fastest, per_token)


THREADS = ThreadChoice()  # the process's measurements (``paged_forward``'s)


@contextmanager
def _threads(n: int):
    """Run the block with n torch threads (at most the caller's), then restore the caller's count."""
    previous = torch.get_num_threads()
    if n < previous:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n < previous:
            torch.set_num_threads(previous)


@torch.inference_mode()
def paged_forward(model, cache: PagedKVCache, chunks: list, *, paged_attention=paged_attention,
                  slot_mapping=slot_mapping) -> torch.Tensor:
    """Run a course_lib.gpt.GPT over the chunks of several sequences at once; logits of each chunk's last token.

    chunks: list of (block_table (n,) int64, start, tokens (T,) int64), each table and tokens a tensor or a list of
    ints: tokens at positions start..start+T-1, their blocks already allocated. Every token goes through the linear
    layers in one (sum T, C) matrix. In each layer, the new keys and values go to their slots in one copy; attention
    reads each sequence's keys and values through its block table: one ``paged_attention`` for all the
    chunks of one token (decodes), their block tables padded into one tensor, and one masked attention for all the
    longer chunks (prefill), padded into one batch. The slots come from slot_mapping, called twice per pass whatever the
    number of chunks (``_layout``). A pass whose linear work is small runs on one thread (``ONE_THREAD_WORK``); a
    larger one on one thread or the caller's, whichever ``THREADS`` measures faster now. Returns (len(chunks), V).
    paged_attention and slot_mapping: the functions run for paged attention and the slot mapping (the learner's, say),
    with the contracts of the course's ``paged_attention`` and ``slot_mapping``.
    """
    tokens = sum(len(t) for _, _, t in chunks)
    n = torch.get_num_threads()
    if n == 1 or tokens * 12 * model.config.n_embd ** 2 < ONE_THREAD_WORK:  # per layer
        with _threads(1):
            return _paged_forward(model, cache, chunks, paged_attention, slot_mapping)
    rows = 1 << (tokens - 1).bit_length()
    shape = (model.config.n_embd, model.config.n_layer)
    probe = partial(model.transformer.h[0], torch.zeros(1, rows, model.config.n_embd))  # one block on the pass's rows
    decided_by = THREADS.pick(shape, rows, n, probe)
    start = time.perf_counter()
    with _threads(decided_by.threads):
        logits = _paged_forward(model, cache, chunks, paged_attention, slot_mapping)
    THREADS.record(shape, n, decided_by, rows, tokens, time.perf_counter() - start)
    return logits


def _paged_forward(model, cache: PagedKVCache, chunks: list, paged_attention, slot_mapping) -> torch.Tensor:
    """``paged_forward``'s pass, on the threads it chose."""
    tr, S = model.transformer, cache.block_size
    layout = _layout(chunks, S, slot_mapping)
    x = tr.wte(layout.ids) + tr.wpe(layout.positions)  # (N, C)
    N, C = x.shape

    def attend(layer, attn, h):  # every chunk's attention in block `layer`, through the block tables
        H = attn.n_head
        qkv = attn.c_attn(h)  # (N, 3C): queries, keys, values
        q = qkv[:, :C].view(N, H, C // H)
        slots, key_pool, value_pool = cache.layers[layer]  # views of the layer's pool
        slots.index_copy_(1, layout.slots, qkv[:, C:].view(N, 2, C).transpose(0, 1))  # the new keys, values: their slots
        if layout.prefill_rows is None:  # a decode-only step: every row is a decode, in order
            y = paged_attention(q, key_pool, value_pool, layout.decode_tables, layout.decode_lens)
        else:
            y = torch.empty_like(q)
            if len(layout.decode_rows):
                y[layout.decode_rows] = paged_attention(q[layout.decode_rows], key_pool, value_pool, layout.decode_tables,
                                                  layout.decode_lens)
            chunked = _prefill_attention(q, key_pool, value_pool, layout)  # (P, T_p, H, Dh), padding included
            y[layout.prefill_rows[layout.prefill_real]] = chunked[layout.prefill_real]
        return attn.c_proj(y.reshape(N, C))

    return model.lm_head(gpt_layers(model, x, attend)[layout.last])  # (len(chunks), V): each chunk's last token


# ----------------------------------------------------------------------------------------------------
# the engine


def _start(requests: list) -> tuple:
    """({name: Result}, the requests to serve sorted by arrival). A request whose arrival is not an integer >= 0
    gets its error at once (it has no arrival step to wait for). Names must be unique (results are keyed by them)."""
    results = {}
    for r in requests:
        if r.name in results:
            raise ValueError(f"request names must be unique (the results are keyed by name): {r.name!r} appears twice")
        results[r.name] = Result(r.name, arrival_step=r.arrival)
    timed = []
    for r in requests:
        error = _arrival_error(r)
        if error:
            results[r.name].error = error
        else:
            timed.append(r)
    return results, sorted(timed, key=lambda r: r.arrival)  # stable: equal arrivals keep their order


@dataclass
class Trace:
    """What a run did, step by step: for the pictures and the memory accounting."""

    states: list = field(default_factory=list)  # per step: {request name: state}
    allocated: list = field(default_factory=list)  # per step: KV bytes allocated
    used: list = field(default_factory=list)  # per step: KV bytes holding a cached token
    batch: list = field(default_factory=list)  # per step: sequences in the forward pass
    computed: list = field(default_factory=list)  # per step: tokens through the forward pass (padding included)
    prefill: list = field(default_factory=list)  # per step: those of them in prompt chunks (a recompute's included)
    step_seconds: list = field(default_factory=list)  # per step: seconds from its start to its end (machine-dependent)
    clock: list = field(default_factory=list)  # per step: its number (steps with nothing to run are skipped, not listed)
    seconds: float = 0.0
    steps: int = 0
    evictions: int = 0  # cached free blocks the engine forgot to reuse them (prefix caching)


@dataclass
class StepOutput:
    """What one ``Engine.step`` did: the token each request got, and the requests that left the engine."""

    tokens: dict = field(default_factory=dict)  # request name -> the token it got in this step (one at most)
    finished: list = field(default_factory=list)  # names of the requests that left: all their tokens, or failed


class Engine:
    """Continuous batching over a paged KV cache, for a course_lib.gpt.GPT.

    num_blocks: blocks in the pool; block_size: token slots per block (>= 1); token_budget: most tokens
    computed per step, prefill chunks and decode tokens together (>= 1); max_num_seqs (vLLM's name): most
    sequences running at once (admitted and not finished, prefilling or decoding; >= 1), None for no cap: the
    scheduler is shown only the first max_num_seqs - len(running) waiting sequences, so it admits no more. ``run(requests)`` serves a list of
    ``Request``s (their names unique) and returns ({name: Result}, Trace): one Result per request, each
    request failing alone. A Result whose ``error`` is None finished: its ``tokens`` are all max_new_tokens of
    them. Otherwise ``error`` says why (the request's name first) and the other requests are served as if it
    had not come:

    * rejected on arrival (``validate``): an empty prompt, a token id outside [0, vocab_size), prompt +
      max_new_tokens beyond the model's context, more blocks than the pool has, a sampling setting or seed
      out of its range. No tokens, no blocks taken.
    * failed in a step: an exception raised while computing this request (its chunk of the forward pass, or
      choosing its token: a sampling processor, say). ``error`` reads "request NAME: failed at step S: the
      exception"; ``tokens`` keeps the tokens it generated before (finish_step stays None); its blocks go back
      to the pool. When the step's batched forward pass raises, each chunk runs again alone: those that
      raise alone fail their requests, the others continue with the logits of their alone pass. A batched
      pass that raises while every chunk alone succeeds is the engine's error, not a request's: it is raised.

    Online, as a server runs it (``course_lib.server``): ``add_request(request)`` whenever one comes (it joins the
    running batch at the next step), ``step()`` (one scheduler step and forward pass; it returns each request's new
    token and those that left), ``abort(name)`` (a client that went away: its blocks go back). ``run`` is ``reset``
    and a loop over them. ``results``, ``waiting``, ``running``, ``cache``, ``trace`` and ``clock`` (the next step's
    number) are the engine's state.

    ``run`` and ``step`` raise (RuntimeError) only for the engine's own faults, which would otherwise hang or corrupt
    every request: a step that makes no progress (nothing scheduled, nothing preempted: with this scheduler
    that happens only when blocks leak or a replacement scheduler stalls; the message counts the free,
    held and leaked blocks), a scheduler that schedules more blocks than are free, or the batched pass above.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 8, token_budget: int = 64, *,
                 share_prefixes: bool = True, max_num_seqs: int | None = None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("token_budget", token_budget)):
            check_positive(name, value)
        if max_num_seqs is not None and (not is_count(max_num_seqs) or max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be None (no cap) or an integer >= 1 (most sequences running at once), "
                             f"got {max_num_seqs!r}")
        self.model = model.eval()
        self.num_blocks, self.block_size, self.token_budget = num_blocks, block_size, token_budget
        self.share_prefixes, self.max_num_seqs = share_prefixes, max_num_seqs
        self.reset()

    def reset(self, *, schedule_step=schedule_step, paged_attention=paged_attention, slot_mapping=slot_mapping) -> None:
        """Start afresh: an empty pool, no requests, step 0, an empty ``trace``, the clock at 0 seconds.

        schedule_step, paged_attention, slot_mapping: the functions the steps run on (the learner's, say)."""
        self.schedule_step, self.paged_attention, self.slot_mapping = schedule_step, paged_attention, slot_mapping
        self.cache = PagedKVCache.for_model(self.model, self.num_blocks, self.block_size)
        self.results: dict = {}  # name -> Result: every request added since the reset
        self.waiting: list = []  # arrived, not running (new or preempted), first come first
        self.running: list = []  # admitted, oldest admission first
        self.trace = Trace()
        self.clock = 0  # the next step's number (a logical clock: a run jumps over steps where nothing happens)
        self.start_time = time.perf_counter()

    def run(self, requests: list, *, schedule_step=schedule_step, paged_attention=paged_attention,
            slot_mapping=slot_mapping) -> tuple:
        """Serve `requests`; returns ({name: Result}, Trace). schedule_step, paged_attention, slot_mapping: the
        functions it runs on.

        Offline serving of a trace: a fresh ``reset``, then each request arrives (``add_request``'s way) at its
        arrival step, and ``step`` runs until every request has left."""
        results, pending = _start(requests)
        self.reset(schedule_step=schedule_step, paged_attention=paged_attention, slot_mapping=slot_mapping)
        self.results = results
        while pending or self.waiting or self.running:
            now = time.perf_counter() - self.start_time
            while pending and pending[0].arrival <= self.clock:
                self._arrive(pending.pop(0), now)
            if not self.waiting and not self.running:
                if pending:
                    self.clock = pending[0].arrival  # nothing to do until then (the steps between change nothing)
                continue
            self.step()
        self.trace.seconds, self.trace.steps = time.perf_counter() - self.start_time, self.clock
        return self.results, self.trace

    def add_request(self, request: Request) -> Result:
        """Online serving: `request` arrives now and joins at the next ``step`` (its ``arrival`` becomes that step).

        Returns its ``Result``, which the steps fill in; if ``validate`` rejects it, its error is set at once and it
        never runs. Its name must differ from every request added since the last ``reset`` (ValueError)."""
        if request.name in self.results:
            raise ValueError(f"request names must be unique (the results are keyed by name): {request.name!r} was "
                             f"already added")
        request = dataclasses.replace(request, arrival=self.clock)
        self.results[request.name] = Result(request.name, arrival_step=self.clock)
        self._arrive(request, time.perf_counter() - self.start_time)
        return self.results[request.name]

    def abort(self, name: str) -> bool:
        """Online serving: request `name` leaves now (its client went away, or it met a stop string).

        Its blocks go back to the pool; its Result keeps the tokens generated so far and its error says it was
        aborted. Returns True, or False if it had already left the engine (finished, failed or rejected).
        ValueError if no request of that name was added since the last ``reset``."""
        if name not in self.results:
            raise ValueError(f"name must be a request added since the last reset, got {name!r}")
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request.name == name:
                    seq.result.error = f"request {name}: aborted at step {self.clock}"
                    self.cache.release_all(seq.blocks)  # a waiting sequence's cached prefix (seq.hit) holds no reference yet
                    seq.blocks = []
                    queue.remove(seq)
                    return True
        return False

    def _arrive(self, request: Request, now: float) -> None:
        """`request` (its Result in self.results) arrives at `now` seconds: it waits, or its Result gets validate's error."""
        result = self.results[request.name]
        result.arrival_time = now
        try:
            validate(request, self.model.config.block_size, self.num_blocks, self.block_size,
                     vocab_size=self.model.config.vocab_size)
        except ValueError as error:
            result.error = str(error)
            return
        self.waiting.append(Sequence(request, result, self.cache))

    def step(self) -> StepOutput:
        """One step of the scheduler and one forward pass over the chunks it scheduled.

        Returns a ``StepOutput``: the token each request got in this step, and the requests that left the engine
        (all their tokens, or failed: their Result's error says why). With no request waiting or running it does
        nothing (the clock stays). Raises RuntimeError for the engine's own faults (see ``Engine``)."""
        cache, waiting, running, trace, step = self.cache, self.waiting, self.running, self.trace, self.clock
        schedule_step, paged_attention, slot_mapping = self.schedule_step, self.paged_attention, self.slot_mapping
        start_time = self.start_time
        S = self.block_size
        output = StepOutput()
        if not waiting and not running:
            return output
        step_start = time.perf_counter() - start_time
        for seq in waiting:
            seq.find_prefix(self.share_prefixes)
        admissible = waiting if self.max_num_seqs is None else waiting[:max(0, self.max_num_seqs - len(running))]
        scheduled, preempted = schedule_step(running, admissible, len(cache.free), self.token_budget)
        if not scheduled and not preempted:
            raise RuntimeError(self._no_progress(cache, running, waiting, step))
        for seq in preempted:  # give the blocks back (still cached); recompute later, keeping the tokens generated
            cache.release_all(seq.blocks)
            seq.blocks, seq.n_cached = [], 0
            seq.result.preemptions += 1
            running.remove(seq)
        waiting = sorted(preempted, key=lambda s: s.request.arrival) + waiting
        self.waiting = waiting
        for seq, _ in scheduled:  # admitted: take the cached prefix first (before any allocation can evict it)
            if seq in waiting:
                waiting.remove(seq)
                running.append(seq)
                for b in seq.hit:
                    cache.share(b)
                seq.blocks, seq.hit = seq.hit, []
                seq.result.admissions.append((seq.n_tokens, seq.n_cached))
        chunks, prefill_tokens = [], 0
        for seq, n in scheduled:
            self._make_room(cache, seq, n)
            if not (n == 1 and seq.prompt_len <= seq.n_cached == seq.n_tokens - 1):  # not a decode: a prompt chunk
                prefill_tokens += n
            chunks.append((seq.blocks, seq.n_cached, seq.tokens[seq.n_cached:seq.n_cached + n]))
        failed = {}  # index in scheduled -> the exception its chunk raised alone
        if chunks:
            try:
                logits = paged_forward(self.model, cache, chunks, paged_attention=paged_attention,
                                       slot_mapping=slot_mapping)
            except Exception as error:  # noqa: BLE001 - whose error is it? each chunk again, alone
                logits, failed = self._forward_alone(cache, chunks, error, step, paged_attention, slot_mapping)
            with _threads(1):  # a small operation: on the caller's threads it would wait for each (see ONE_THREAD_WORK)
                greedy = _argmaxes(logits)
        now = time.perf_counter() - start_time
        states = {s.request.name: "waiting" for s in waiting}
        for i, (seq, n) in enumerate(scheduled):
            states[seq.request.name] = "decode" if seq.n_cached >= seq.prompt_len else "prefill"
            if i in failed:
                self._fail(cache, seq, running, step, failed[i])
                output.finished.append(seq.request.name)
                continue
            seq.n_cached += n
            self._register_full_blocks(cache, seq, seq.n_cached - n)
            if seq.n_cached == seq.n_tokens:  # the chunk reached the end: a new token
                try:
                    token = _choose(logits[i], greedy[i], seq.tokens, seq.prompt_len, seq.request.sampling, seq.generator)
                except Exception as error:  # noqa: BLE001 - this request's sampling: it fails alone
                    self._fail(cache, seq, running, step, error)
                    output.finished.append(seq.request.name)
                    continue
                seq.tokens.append(token)
                seq.result.tokens.append(token)
                seq.result.token_times.append(now)
                output.tokens[seq.request.name] = token
                if seq.result.first_token_step is None:
                    seq.result.first_token_step = step
                if len(seq.result.tokens) == seq.request.max_new_tokens:
                    seq.result.finish_step = step
                    cache.release_all(seq.blocks)
                    seq.blocks = []
                    running.remove(seq)
                    output.finished.append(seq.request.name)
        for seq in running:  # running but not scheduled (the token budget ran out): ready, waiting its turn
            states.setdefault(seq.request.name, "waiting")
        for seq in preempted:
            states[seq.request.name] = "preempted"
        trace.states.append(states)
        held = cache.num_blocks - len(cache.free)
        trace.allocated.append(held * cache.block_bytes)
        trace.used.append(self._used_slots(cache, running) * cache.block_bytes // S)
        trace.batch.append(len(scheduled))
        trace.computed.append(sum(n for _, n in scheduled))
        trace.prefill.append(prefill_tokens)
        trace.step_seconds.append(time.perf_counter() - start_time - step_start)
        trace.clock.append(step)
        trace.evictions = cache.evictions
        self.clock += 1
        return output

    def _forward_alone(self, cache: PagedKVCache, chunks: list, error: Exception, step: int, paged_attention,
                      slot_mapping):
        """The batched pass raised `error`: run each chunk alone. Returns (logits, {chunk index: its exception}).

        A chunk's keys and values go to its own blocks (no sequence writes a block another holds), so
        what the failed batched pass wrote is rewritten here or freed with a failed request's blocks."""
        rows, failed = [], {}
        for i, chunk in enumerate(chunks):
            try:
                rows.append(paged_forward(self.model, cache, [chunk], paged_attention=paged_attention,
                                          slot_mapping=slot_mapping)[0])
            except Exception as alone:  # noqa: BLE001 - this chunk's own error
                failed[i] = alone
                rows.append(torch.zeros(self.model.config.vocab_size))  # never read: its request fails
        if not failed:
            raise RuntimeError(f"step {step}: the batched forward pass over {len(chunks)} chunks raised, but every "
                               f"chunk alone succeeded: an engine error, not a request's") from error
        return torch.stack(rows), failed

    @staticmethod
    def _fail(cache: PagedKVCache, seq: Sequence, running: list, step: int, error: Exception) -> None:
        """Record `error` on the request's Result and give its blocks back; it leaves the engine."""
        seq.result.error = f"request {seq.request.name}: failed at step {step}: {type(error).__name__}: {error}"
        cache.release_all(seq.blocks)
        seq.blocks = []
        running.remove(seq)

    def _no_progress(self, cache: PagedKVCache, running: list, waiting: list, step: int) -> str:
        """Why a step scheduled and preempted nothing: the blocks free, held by requests and held by none (leaked)."""
        held = {b for seq in running for b in seq.blocks}
        leaked = sorted(set(range(cache.num_blocks)) - set(cache.free) - held)
        lines = [f"the engine made no progress at step {step}: the scheduler scheduled nothing and preempted nothing "
                 f"({len(running)} running, {len(waiting)} waiting); {len(cache.free)} of {cache.num_blocks} blocks "
                 f"are free, {len(held)} held by running requests, {len(leaked)} held by no request"]
        if waiting:
            seq = waiting[0]
            n = min(seq.n_tokens - seq.n_cached, self.token_budget)
            lines.append(f"the first waiting request, {seq.request.name}, needs {seq.blocks_needed(n)} blocks for its "
                         f"next {n} tokens")
        if leaked:
            lines.append(f"blocks leaked (not on the free list, in no running request's block table): {leaked[:12]}"
                         f"{' ...' if len(leaked) > 12 else ''}")
        else:
            lines.append("no block leaked: the scheduler returned nothing although it could schedule")
        return "; ".join(lines)

    @staticmethod
    def _make_room(cache: PagedKVCache, seq: Sequence, n: int) -> None:
        """Fresh blocks for positions n_cached .. n_cached + n - 1 (never a block another sequence holds: see find_prefix)."""
        while len(seq.blocks) * cache.block_size < seq.n_cached + n:
            seq.blocks.append(cache.allocate())

    @staticmethod
    def _register_full_blocks(cache: PagedKVCache, seq: Sequence, before: int) -> None:
        """Remember every block this step filled (for the prefix cache)."""
        S = cache.block_size
        for i in range(before // S, seq.n_cached // S):
            cache.register(tuple(seq.tokens[:(i + 1) * S]), seq.blocks[i])

    @staticmethod
    def _used_slots(cache: PagedKVCache, running: list) -> int:
        """Slots holding a cached token, each shared block counted once: the running sequences' cached tokens, less a
        block's S slots for each reference to a block beyond its first (only full blocks are shared, found by prefix;
        every table holds just the blocks its n_cached fill)."""
        tables = [seq.blocks for seq in running]
        shared = sum(map(len, tables)) - len(set(itertools.chain.from_iterable(tables)))  # references beyond the first
        return sum(seq.n_cached for seq in running) - cache.block_size * shared



# ----------------------------------------------------------------------------------------------------
# the baseline: static batching


@torch.inference_mode()
def static_batching(model, requests: list, max_batch_size: int = 8, *, reserve: str = "oracle") -> tuple:
    """Serve `requests` in static batches: chapter 05's left-padded batch, one at a time.

    At each step with no batch running, the requests that have arrived (first come, first served, at most
    max_batch_size) form a batch: prompts left-padded to the longest, a ``KVCache`` preallocated in every row
    for `reserve`, one prefill step, then one decode step per token until the row with the most tokens to
    generate is done; a row that is done idles until then. reserve: "oracle" (default) sizes the rows for the
    longest prompt plus the longest output of the batch, read from the requests' true max_new_tokens (as
    ``generate_cached`` does; a server cannot know them in advance: the vLLM paper's "Orca (Oracle)");
    "context" reserves the model's context length in every row, the most a request may hold ("Orca (Max)"),
    or the longest prompt plus the longest output if left padding makes that longer. The tokens are the same
    either way; only the memory differs. Returns ({name: Result}, Trace) like ``Engine.run``: a request is
    rejected on arrival by the same ``validate``, and a request whose sampling raises fails alone (its row
    idles); an error in the batch's forward pass is raised.
    """
    check_positive("max_batch_size", max_batch_size)
    if reserve not in ("oracle", "context"):
        raise ValueError(f'reserve must be "oracle" (the batch\'s longest prompt + longest output) or "context" '
                         f"(the model's context length per row), got {reserve!r}")
    model.eval()
    context, vocab = model.config.block_size, model.config.vocab_size
    results, pending = _start(requests)
    arrived, trace = [], Trace()
    start_time = time.perf_counter()
    step = 0
    while pending or arrived:
        now = time.perf_counter() - start_time
        while pending and pending[0].arrival <= step:
            request = pending.pop(0)
            results[request.name].arrival_time = now
            try:
                validate(request, context, vocab_size=vocab)
                arrived.append(request)
            except ValueError as error:
                results[request.name].error = str(error)
        if not arrived:
            step += 1
            continue
        batch, arrived = arrived[:max_batch_size], arrived[max_batch_size:]
        B, width = len(batch), max(len(r.prompt) for r in batch)
        longest = max(r.max_new_tokens for r in batch)
        idx = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)  # 1: a real token; grows by a column per step
        for row, r in enumerate(batch):
            idx[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        capacity = width + longest if reserve == "oracle" else max(context, width + longest)
        cache = KVCache.for_model(model, B, capacity)  # every row: the longest prompt + the longest output, or the context
        generators = [torch.Generator().manual_seed(r.seed) for r in batch]
        tokens = [list(r.prompt) for r in batch]
        failed = set()  # rows whose request failed: they idle like finished rows
        new = idx
        for t in range(longest):
            step_start = time.perf_counter() - start_time
            states = {r.name: "waiting" for r in arrived}
            for r in pending:
                if r.arrival <= step:
                    states[r.name] = "waiting"
            logits = cached_forward(model, new, cache, mask)[:, -1]
            greedy = _argmaxes(logits)
            now = time.perf_counter() - start_time
            column = torch.zeros(B, 1, dtype=torch.long)
            for row, r in enumerate(batch):
                done = len(tokens[row]) - len(r.prompt) >= r.max_new_tokens or row in failed
                states[r.name] = "idle" if done else ("prefill" if t == 0 else "decode")
                if done:
                    continue
                try:
                    token = _choose(logits[row], greedy[row], tokens[row], len(r.prompt), r.sampling, generators[row])
                except Exception as error:  # noqa: BLE001 - this request's sampling: it fails alone, its row idles
                    results[r.name].error = f"request {r.name}: failed at step {step}: {type(error).__name__}: {error}"
                    failed.add(row)
                    continue
                tokens[row].append(token)
                column[row, 0] = token
                result = results[r.name]
                result.tokens.append(token)
                result.token_times.append(now)
                if result.first_token_step is None:
                    result.first_token_step = step
                if len(result.tokens) == r.max_new_tokens:
                    result.finish_step = step
            new = column
            busy = [len(tk) - len(r.prompt) < r.max_new_tokens and row not in failed
                    for row, (tk, r) in enumerate(zip(tokens, batch))]
            mask = torch.cat([mask, torch.tensor(busy, dtype=torch.long)[:, None]], dim=1)  # an idle row feeds padding
            trace.states.append(states)
            trace.allocated.append(cache.nbytes)
            per_token = cache.nbytes // (B * cache.capacity)
            # tokens cached: all but the one just sampled (fed next step), as the engine counts n_cached
            trace.used.append(per_token * sum(len(tk) - 1 for tk in tokens))
            trace.batch.append(B)
            trace.computed.append(B * (width if t == 0 else 1))  # every row, padding and idle rows included
            trace.prefill.append(B * width if t == 0 else 0)
            trace.step_seconds.append(time.perf_counter() - start_time - step_start)
            trace.clock.append(step)
            step += 1
            while pending and pending[0].arrival <= step:  # arrivals during the batch wait for the next one
                request = pending.pop(0)
                results[request.name].arrival_time = time.perf_counter() - start_time
                try:
                    validate(request, context, vocab_size=vocab)
                    arrived.append(request)
                except ValueError as error:
                    results[request.name].error = str(error)
    trace.seconds, trace.steps = time.perf_counter() - start_time, step
    return results, trace


# ----------------------------------------------------------------------------------------------------
# a request trace


def make_trace(n_requests: int, seed: int = 0, *, context: int = 128, mean_gap: float = 1.0,
               prompt_range: tuple = (4, 48), output_median: float = 12.0, output_sigma: float = 0.9,
               vocab: list | None = None, prefix: list | None = None) -> list:
    """A seeded list of n_requests ``Request``s: arrivals, prompt and output lengths.

    Gaps between arrivals are exponential (mean mean_gap steps; a Poisson process; 0: all at step 0), prompt lengths uniform
    in prompt_range, output lengths log-normal (median output_median, sigma output_sigma: a long tail of
    long answers), each cut so that prompt + output fits the context. Prompt tokens are drawn from `vocab`
    (default: ids 0..63); `prefix` (a shared system prompt) is put in front of every prompt.
    """
    rng = random.Random(seed)
    vocab = list(range(64)) if vocab is None else vocab
    prefix = [] if prefix is None else list(prefix)
    requests, clock = [], 0.0
    for i in range(n_requests):
        n_prompt = rng.randint(*prompt_range)
        prompt = prefix + [rng.choice(vocab) for _ in range(n_prompt)]
        room = context - len(prompt)
        n_out = max(1, min(room, round(rng.lognormvariate(math.log(output_median), output_sigma))))
        requests.append(Request(f"r{i:02d}", prompt, n_out, arrival=int(clock)))
        clock += rng.expovariate(1.0 / mean_gap) if mean_gap > 0 else 0.0
    return requests


# ----------------------------------------------------------------------------------------------------
# load: a sweep of request rates (or of any setting) on the step clock


def quantile(values: list, q: float) -> float:
    """The q-quantile (0 < q <= 1) by the nearest-rank rule: the smallest value with a fraction q at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def serving_stats(results: dict, trace: Trace) -> dict:
    """What a run gave its users, in engine steps (the same on any machine) and in seconds (this machine, now).

    tokens_per_step: tokens generated / the run's steps (throughput); ttft_steps: per request, first_token_step -
    arrival_step; tpot_steps: per request with 2 tokens or more, (finish_step - first_token_step) / (tokens - 1);
    step_tokens: per request, the median tokens computed by the steps that gave its 2nd .. last token (what a
    decoding request waits for: its own token and everyone else's, prompt chunks included). Each as its median
    (p50) and 95th percentile (p95, nearest rank); ttft_s, tpot_s: the same in seconds (``Result.ttft``, ``tpot``).
    Also tpot_steps_max, the largest tpot_steps over the requests, and most_running, the most sequences in one
    step's forward pass (``Trace.batch``; 0 if it is empty)."""
    served = [r for r in results.values() if r.error is None]
    if not served:
        raise ValueError("results holds no finished request: nothing to measure")
    computed = dict(zip(trace.clock, trace.computed))
    later = [r for r in served if len(r.tokens) > 1]
    measures = {
        "ttft_steps": [r.first_token_step - r.arrival_step for r in served],
        "tpot_steps": [(r.finish_step - r.first_token_step) / (len(r.tokens) - 1) for r in later],
        "step_tokens": [statistics.median(computed[s] for s in range(r.first_token_step + 1, r.finish_step + 1))
                        for r in later],
        "ttft_s": [r.ttft for r in served], "tpot_s": [r.tpot for r in later],
    }
    tokens = sum(len(r.tokens) for r in served)
    stats = {"requests": len(served), "tokens": tokens, "steps": trace.steps, "seconds": trace.seconds,
             "tokens_per_step": tokens / trace.steps, "tokens_per_s": tokens / trace.seconds}
    for name, values in measures.items():
        stats[f"{name}_p50"] = quantile(values, 0.5) if values else math.nan
        stats[f"{name}_p95"] = quantile(values, 0.95) if values else math.nan
    stats["tpot_steps_max"] = max(measures["tpot_steps"], default=math.nan)
    stats["most_running"] = max(trace.batch, default=0)
    return stats


def load_sweep(systems: Mapping, traces: Mapping) -> list:
    """Run every system on every trace; one row of ``serving_stats`` per (trace, system), with their names.

    systems: {name: a function of a list of Requests returning ({name: Result}, Trace)} (``Engine(...).run``,
    ``lambda reqs: static_batching(model, reqs, 8)``); traces: {label: a list of Requests} (e.g. request rates,
    ``make_trace(..., mean_gap=1 / rate)``). The systems run one after another on each trace, so that background
    load hits them alike. Rows carry "trace" (the label), "system" and every ``serving_stats`` field."""
    rows = []
    for label, requests in traces.items():
        for name, run in systems.items():
            rows.append({"trace": label, "system": name, **serving_stats(*run(requests))})
    return rows
