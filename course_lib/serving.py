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
* **shared prefixes**: a full block whose tokens (and all tokens before them) equal another
  sequence's is shared, with a reference count; a shared block that would be written is copied first
  (copy-on-write);
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
model's context per row (``reserve="context"``).

``slot_mapping``, ``paged_attention`` and ``schedule_step`` are the reference solutions of
chapter 12's exercises (``tests/grading/test_solution_drift.py`` keeps them equal to the notebook's).
"""
from __future__ import annotations

import math
import numbers
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from .attention import masked_softmax
from .decoding import REPLACEABLE, process_logits
from .gpt import gpt_layers
from .kv_cache import KVCache, cached_forward

# ----------------------------------------------------------------------------------------------------
# the three exercises


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where the tokens at `positions` live in the pool: flat slots (T,) int64.

    block_table (n,) int64: the blocks of one sequence, in order (block_table[i] holds positions
    i * block_size .. (i + 1) * block_size - 1); positions (T,) int64. Position p lives in block
    block_table[p // block_size] at offset p % block_size, that is in slot
    block_table[p // block_size] * block_size + p % block_size.
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
    scores = (keys * q[:, None]).sum(-1).transpose(1, 2) / math.sqrt(Dh)  # (B, H, M * S): q . k per position
    valid = torch.arange(M * S, device=q.device)[None, :] < context_lens[:, None]  # (B, M * S)
    weights = masked_softmax(scores, valid[:, None, :])  # (B, H, M * S): zero past the context
    return (weights.transpose(1, 2)[..., None] * values).sum(1)  # (B, H, Dh)


def schedule_step(running: list, waiting: list, num_free_blocks: int, token_budget: int):
    """One step of the scheduler: which sequences run, with how many tokens, and which are preempted.

    running: the running sequences, oldest admission first; waiting: the waiting ones, first come first.
    Each sequence has ``n_tokens`` (its prompt and generated tokens), ``n_cached`` (those whose keys and
    values are in the cache), ``blocks_needed(n)`` (new blocks it must get to cache n more tokens) and
    ``blocks_freed()`` (blocks that go back to the free list if it is preempted: those it alone holds; a
    block shared only among sequences preempted in the same step is freed too but counted by none, so
    the policy may preempt more than it needs, never less). The policy:

    1. Running sequences, in order, while tokens of the budget are left: sequence s wants
       n = min(s.n_tokens - s.n_cached, tokens left) tokens (1 when it decodes, the rest of its prompt, or
       as much of it as fits, when it prefills) and s.blocks_needed(n) blocks. While fewer blocks are free,
       preempt the last running sequence not yet scheduled (the most recent; its blocks_freed() become
       free); if that is s itself, s is preempted and step 1 ends. Otherwise s is scheduled with n tokens.
    2. Only if nothing was preempted: waiting sequences, in order, while tokens are left: s wants
       n = min(s.n_tokens - s.n_cached, tokens left) and s.blocks_needed(n) blocks; if they are free, s is
       scheduled, else admission stops (no later request overtakes it).

    Returns (scheduled: list of (sequence, n) in the order above, preempted: list of sequences in the
    order they were preempted). Changes neither list.
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
    ``dict(temperature=0.8, top_k=20)``; ``SAMPLING`` lists them and their ranges), drawn with a
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


def _integer(value) -> bool:
    """A Python int that is not a bool (True is an int in Python, but not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """A real number (int, float, numpy scalar) that is not a bool; NaN passes here and fails every range below."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: the sampling settings a request may carry (``process_logits``'s keyword arguments): a check and its range in words
SAMPLING = {
    "temperature": (lambda v: _number(v) and 0 <= v < math.inf, "a finite number >= 0 (0 means greedy)"),
    "top_k": (lambda v: v is None or (_integer(v) and v >= 0), "None or an integer >= 0 (0 and None disable it)"),
    "top_p": (lambda v: v is None or (_number(v) and 0 < v <= 1), "None or a number in (0, 1]"),
    "min_p": (lambda v: v is None or (_number(v) and 0 <= v <= 1), "None or a number in [0, 1]"),
    "repetition_penalty": (lambda v: v is None or (_number(v) and 0 < v < math.inf),
                           "None or a finite number > 0 (1 means no penalty)"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "functions": (lambda v: v is None or (isinstance(v, Mapping) and set(v) <= set(REPLACEABLE)
                                          and all(callable(f) for f in v.values())),
                  f"None or a dict {{name: function}} with names among {', '.join(REPLACEABLE)}"),
}
SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes: [-2**63, 2**64)


def _arrival_error(request: Request) -> str | None:
    if not _integer(request.arrival) or request.arrival < 0:
        return f"request {request.name}: arrival must be an integer >= 0 (an engine step), got {request.arrival!r}"
    return None


def validate(request: Request, block_size_ctx: int, num_blocks: int | None = None, block_size: int | None = None, *,
             vocab_size: int | None = None) -> None:
    """Raise ValueError, naming the request, the argument and its allowed range, if `request` cannot be served.

    Checked: arrival (an integer >= 0); prompt (a non-empty list or tuple of integer token ids, each in
    [0, vocab_size) when vocab_size is given); max_new_tokens (an integer >= 1); prompt + max_new_tokens within
    the model's context block_size_ctx; its blocks within a pool of num_blocks blocks of block_size tokens (when
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
    if not _integer(request.max_new_tokens) or request.max_new_tokens < 1:
        raise ValueError(f"request {name}: max_new_tokens must be an integer >= 1, got {request.max_new_tokens!r}")
    total = len(prompt) + request.max_new_tokens
    if total > block_size_ctx:
        raise ValueError(f"request {name}: prompt length + max_new_tokens must be <= the model's context "
                         f"block_size = {block_size_ctx}, got {len(prompt)} + {request.max_new_tokens}")
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
    if not _integer(request.seed) or not SEED_RANGE[0] <= request.seed < SEED_RANGE[1]:
        raise ValueError(f"request {name}: seed must be an integer in [-2**63, 2**64), got {request.seed!r}")


def _choose(logits: torch.Tensor, tokens: list, prompt_len: int, sampling: dict | None, generator) -> int:
    """The next token from one row of logits (V,): the argmax, or a draw after chapter 06's processors."""
    if sampling is None:
        return int(logits.argmax())
    ids = torch.tensor([tokens])
    scores = process_logits(logits[None].float(), ids, ids[:, prompt_len:], **sampling)
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


# ----------------------------------------------------------------------------------------------------
# the paged cache


class PagedKVCache:
    """Keys and values of every layer in one pool of blocks: storage (L, 2, N, S, H, Dh).

    The pool is shared by all sequences. ``allocate()`` takes a block from the free list (reference
    count 1), ``share(b)`` adds a reference, ``release(b)`` drops one and returns the block to the free
    list at zero. Full blocks are remembered by the tokens that fill them and every token before
    (``register``/``lookup``): a new sequence with the same prefix shares them (prefix sharing).
    """

    def __init__(self, n_layer: int, n_head: int, head_dim: int, num_blocks: int, block_size: int, *,
                 dtype=torch.float32):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.storage = torch.zeros(n_layer, 2, num_blocks, block_size, n_head, head_dim, dtype=dtype)
        self.free = list(range(num_blocks))  # the free list
        self.refs = [0] * num_blocks  # reference counts
        self.prefix: dict = {}  # tuple of tokens 0 .. end of a full block -> that block
        self.key_of: dict = {}  # block -> its key in self.prefix

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
        if not self.free:
            raise RuntimeError("the pool has no free block (the scheduler should have preempted)")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            key = self.key_of.pop(block, None)
            if key is not None:
                del self.prefix[key]
            self.free.append(block)

    def copy_block(self, source: int) -> int:
        """Copy-on-write: a fresh block holding `source`'s keys and values; `source` loses one reference."""
        target = self.allocate()
        self.storage[:, :, target] = self.storage[:, :, source]
        self.release(source)
        return target

    def register(self, tokens: tuple, block: int) -> None:
        """Remember that `block` holds the last block_size of `tokens` (all of them computed, in order)."""
        if tokens not in self.prefix and block not in self.key_of:
            self.prefix[tokens] = block
            self.key_of[block] = tokens

    def lookup(self, tokens: list) -> list:
        """The blocks that already hold the longest run of full blocks at the start of `tokens`."""
        blocks, S = [], self.block_size
        for end in range(S, len(tokens) + 1, S):
            block = self.prefix.get(tuple(tokens[:end]))
            if block is None:
                break
            blocks.append(block)
        return blocks


class Sequence:
    """A request inside the engine: its tokens so far, how many are cached, its block table."""

    def __init__(self, request: Request, result: Result, cache: PagedKVCache):
        self.request, self.result, self.cache = request, result, cache
        self.tokens = list(request.prompt)
        self.prompt_len = len(request.prompt)
        self.n_cached = 0
        self.blocks: list = []  # the block table
        self.hit: list = []  # blocks of a shared prefix found while waiting (no reference taken yet)
        self.generator = torch.Generator().manual_seed(request.seed)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def find_prefix(self, share: bool) -> None:
        """While waiting: find the blocks of a shared prefix (references are taken on admission) and start after them.

        The last prompt token is always computed (its logits give the first new token), so a prefix that
        covers the whole prompt starts one token early, inside its last shared block."""
        self.hit = self.cache.lookup(self.tokens) if share else []
        self.n_cached = min(len(self.hit) * self.cache.block_size, self.n_tokens - 1)

    def blocks_needed(self, n: int) -> int:
        """New blocks to cache n more tokens: one more if the last block is shared and would be written (copy-on-write)."""
        S = self.cache.block_size
        table = self.blocks or self.hit  # a waiting sequence's table will be its shared prefix
        writes_held = self.n_cached < len(table) * S  # the next token goes into a block already in the table
        shared_tail = writes_held and (not self.blocks or self.cache.refs[table[self.n_cached // S]] > 1)
        return max(0, math.ceil((self.n_cached + n) / S) - len(table)) + int(shared_tail)

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


def _layout(chunks: list, S: int, slots_of=slot_mapping) -> _Layout:
    """The `_Layout` of a forward pass over `chunks` ((block_table, start, tokens), as ``paged_forward`` takes them).

    The block tables laid end to end are one long table, in which position p of a chunk whose table begins at
    block o is position o * S + p: so one call of slots_of gives the slots of every new token, and one more those
    of every prefill chunk's keys, whatever the number of chunks; the decodes' tables, padded, are one gather from
    it. The index arithmetic is vectorised in NumPy (as vLLM prepares its inputs): a fixed number of operations
    per pass, none per sequence."""
    table = torch.cat([t for t, _, _ in chunks])  # every block table, end to end
    starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
    lengths = np.array([tokens.numel() for _, _, tokens in chunks], dtype=np.int64)
    widths = np.array([t.numel() for t, _, _ in chunks], dtype=np.int64)
    offsets = np.cumsum(widths) - widths  # where each chunk's table begins in the long one, in blocks
    ends = np.cumsum(lengths)  # one past each chunk's last row
    first = ends - lengths  # each chunk's first row
    chunk = np.repeat(np.arange(len(chunks)), lengths)  # (N,): the chunk of each token
    positions = starts[chunk] + np.arange(ends[-1]) - first[chunk]
    decode, prefill = np.flatnonzero(lengths == 1), np.flatnonzero(lengths > 1)
    M_d = int(widths[decode].max(initial=0))
    gather = np.minimum(offsets[decode, None] + np.arange(M_d), len(table) - 1)  # (B_d, M_d); padding: the next tables'
    layout = _Layout(ids=torch.cat([tokens for _, _, tokens in chunks]), positions=_int64(positions),
                     slots=slots_of(table, _int64(offsets[chunk] * S + positions), S), last=_int64(ends - 1),
                     decode_rows=_int64(first[decode]), decode_tables=table[_int64(gather)],
                     decode_lens=_int64(starts[decode] + 1))
    if len(prefill):
        t, k = np.arange(lengths[prefill].max()), np.arange((starts + lengths)[prefill].max())
        start, length = starts[prefill, None], lengths[prefill, None]
        keys = np.minimum(k[None, :], start + length - 1)  # (P, K_p): padding repeats the last key
        layout.prefill_rows = _int64(first[prefill, None] + np.minimum(t[None, :], length - 1))
        layout.prefill_real = torch.from_numpy(t[None, :] < length)
        layout.prefill_slots = slots_of(table, _int64(offsets[prefill, None] * S + keys).flatten(), S).view(keys.shape)
        layout.prefill_allowed = torch.from_numpy(k[None, None, :] <= (start + t[None, :])[:, :, None])[:, None]
    return layout


def _prefill_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Attention of every prefill chunk's queries against its cached keys, the chunks padded into one batch: (P, T_p, H, Dh).

    q (N, H, Dh): every token's query; key_pool, value_pool (N_blocks, S, H, Dh). Chunk p's query i (at position
    start + i) attends to its positions 0 .. start + i, gathered through its block table (``layout.prefill_slots``)."""
    H, Dh = q.shape[1:]
    keys = key_pool.view(-1, H, Dh)[layout.prefill_slots].permute(0, 2, 3, 1)  # (P, H, Dh, K_p)
    values = value_pool.view(-1, H, Dh)[layout.prefill_slots].transpose(1, 2)  # (P, H, K_p, Dh)
    queries = q[layout.prefill_rows].transpose(1, 2)  # (P, H, T_p, Dh)
    weights = masked_softmax(queries @ keys / math.sqrt(Dh), layout.prefill_allowed)  # (P, H, T_p, K_p)
    return (weights @ values).transpose(1, 2)  # (P, T_p, H, Dh)


#: Multiply-adds of one layer's linear products in a pass (tokens x 12 C^2) below which the pass runs on one thread.
#: Intra-op threads pay only when an operation's work outweighs waking and joining them; a decode step of a small
#: model is hundreds of operations of microseconds, and each parallel one waits for every thread, on a busy machine
#: for a descheduled thread's time slice (measured here: the course model's engine 25 times slower at 2 threads
#: than at 1 on a loaded 2-core machine). Above it (GPT-2 small's width from 3 tokens) the caller's threads are used.
ONE_THREAD_WORK = 2 ** 24


@contextmanager
def _threads(n: int):
    """Run the block with n torch threads (at most the caller's), then restore the caller's count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(min(n, previous))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@torch.inference_mode()
def paged_forward(model, cache: PagedKVCache, chunks: list, *, attention=paged_attention, slots_of=slot_mapping) -> torch.Tensor:
    """Run a course_lib.gpt.GPT over the chunks of several sequences at once; logits of each chunk's last token.

    chunks: list of (block_table (n,) int64, start, tokens (T,) int64): tokens at positions start..start+T-1,
    their blocks already allocated. Every token goes through the linear layers in one (sum T, C) matrix. In each
    layer, the new keys and values go to their slots in one copy; attention reads each sequence's keys and values
    through its block table: one ``attention`` (paged attention) for all the chunks of one token (decodes), their
    block tables padded into one tensor, and one masked attention for all the longer chunks (prefill), padded into
    one batch. The slots come from slots_of, called twice per pass whatever the number of chunks (``_layout``).
    A pass whose linear work is small runs on one thread (``ONE_THREAD_WORK``). Returns (len(chunks), V).
    attention and slots_of: the functions used for paged attention and the slot mapping (the learner's, say), with
    the contracts of ``paged_attention`` and ``slot_mapping``.
    """
    work = sum(tokens.numel() for _, _, tokens in chunks) * 12 * model.config.n_embd ** 2  # per layer
    with _threads(1 if work < ONE_THREAD_WORK else torch.get_num_threads()):
        return _paged_forward(model, cache, chunks, attention, slots_of)


def _paged_forward(model, cache: PagedKVCache, chunks: list, attention, slots_of) -> torch.Tensor:
    """``paged_forward``'s pass, on the threads it chose."""
    tr, S = model.transformer, cache.block_size
    layout = _layout(chunks, S, slots_of)
    x = tr.wte(layout.ids) + tr.wpe(layout.positions)  # (N, C)
    N, C = x.shape

    def attend(layer, attn, h):  # every chunk's attention in block `layer`, through the block tables
        H = attn.n_head
        qkv = attn.c_attn(h)  # (N, 3C): queries, keys, values
        q = qkv[:, :C].view(N, H, C // H)
        pool = cache.storage[layer]  # (2, N_blocks, S, H, Dh): keys, values
        pool.view(2, -1, C).index_copy_(1, layout.slots, qkv[:, C:].view(N, 2, C).transpose(0, 1))  # into their slots
        key_pool, value_pool = pool[0], pool[1]
        if layout.prefill_rows is None:  # a decode-only step: every row is a decode, in order
            y = attention(q, key_pool, value_pool, layout.decode_tables, layout.decode_lens)
        else:
            y = torch.empty_like(q)
            if len(layout.decode_rows):
                y[layout.decode_rows] = attention(q[layout.decode_rows], key_pool, value_pool, layout.decode_tables,
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
    seconds: float = 0.0
    steps: int = 0


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

    ``run`` raises (RuntimeError) only for the engine's own faults, which would otherwise hang or corrupt
    every request: a step that makes no progress (nothing scheduled, nothing preempted: with this scheduler
    that happens only when blocks leak or a replacement scheduler stalls; the message counts the free,
    held and leaked blocks), a scheduler that schedules more blocks than are free, or the batched pass above.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 8, token_budget: int = 64, *,
                 share_prefixes: bool = True, max_num_seqs: int | None = None):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("token_budget", token_budget)):
            if not _integer(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_num_seqs is not None and (not _integer(max_num_seqs) or max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be None (no cap) or an integer >= 1 (most sequences running at once), "
                             f"got {max_num_seqs!r}")
        self.model = model.eval()
        self.num_blocks, self.block_size, self.token_budget = num_blocks, block_size, token_budget
        self.share_prefixes, self.max_num_seqs = share_prefixes, max_num_seqs

    def run(self, requests: list, *, scheduler=schedule_step, attention=paged_attention, slots_of=slot_mapping) -> tuple:
        """Serve `requests`; returns ({name: Result}, Trace). scheduler, attention, slots_of: the functions it runs on."""
        cache = PagedKVCache.for_model(self.model, self.num_blocks, self.block_size)
        S, context, vocab = self.block_size, self.model.config.block_size, self.model.config.vocab_size
        results, pending = _start(requests)
        waiting, running, trace = [], [], Trace()
        start_time = time.perf_counter()
        step = 0
        while pending or waiting or running:
            now = step_start = time.perf_counter() - start_time
            while pending and pending[0].arrival <= step:
                request = pending.pop(0)
                result = results[request.name]
                result.arrival_time = now
                try:
                    validate(request, context, self.num_blocks, S, vocab_size=vocab)
                except ValueError as error:
                    result.error = str(error)
                    continue
                waiting.append(Sequence(request, result, cache))
            if not waiting and not running:
                if pending:
                    step = pending[0].arrival  # nothing to do until then (the steps between change nothing)
                continue
            for seq in waiting:
                seq.find_prefix(self.share_prefixes)
            admissible = waiting if self.max_num_seqs is None else waiting[:max(0, self.max_num_seqs - len(running))]
            scheduled, preempted = scheduler(running, admissible, len(cache.free), self.token_budget)
            if not scheduled and not preempted:
                raise RuntimeError(self._no_progress(cache, running, waiting, step))
            for seq in preempted:  # give the blocks back; recompute later, keeping the tokens generated
                for b in seq.blocks:
                    cache.release(b)
                seq.blocks, seq.n_cached = [], 0
                seq.result.preemptions += 1
                running.remove(seq)
            waiting = sorted(preempted, key=lambda s: s.request.arrival) + waiting
            chunks, prefill_tokens = [], 0
            for seq, n in scheduled:
                if seq in waiting:  # admitted: take the shared prefix
                    waiting.remove(seq)
                    running.append(seq)
                    for b in seq.hit:
                        cache.share(b)
                    seq.blocks, seq.hit = seq.hit, []
                self._make_room(cache, seq, n)
                if not (n == 1 and seq.prompt_len <= seq.n_cached == seq.n_tokens - 1):  # not a decode: a prompt chunk
                    prefill_tokens += n
                chunks.append((torch.tensor(seq.blocks), seq.n_cached,
                               torch.tensor(seq.tokens[seq.n_cached:seq.n_cached + n])))
            failed = {}  # index in scheduled -> the exception its chunk raised alone
            if chunks:
                try:
                    logits = paged_forward(self.model, cache, chunks, attention=attention, slots_of=slots_of)
                except Exception as error:  # noqa: BLE001 - whose error is it? each chunk again, alone
                    logits, failed = self._forward_alone(cache, chunks, error, step, attention, slots_of)
            now = time.perf_counter() - start_time
            states = {s.request.name: "waiting" for s in waiting}
            for i, (seq, n) in enumerate(scheduled):
                states[seq.request.name] = "decode" if seq.n_cached >= seq.prompt_len else "prefill"
                if i in failed:
                    self._fail(cache, seq, running, step, failed[i])
                    continue
                seq.n_cached += n
                self._register_full_blocks(cache, seq, seq.n_cached - n)
                if seq.n_cached == seq.n_tokens:  # the chunk reached the end: a new token
                    try:
                        token = _choose(logits[i], seq.tokens, seq.prompt_len, seq.request.sampling, seq.generator)
                    except Exception as error:  # noqa: BLE001 - this request's sampling: it fails alone
                        self._fail(cache, seq, running, step, error)
                        continue
                    seq.tokens.append(token)
                    seq.result.tokens.append(token)
                    seq.result.token_times.append(now)
                    if seq.result.first_token_step is None:
                        seq.result.first_token_step = step
                    if len(seq.result.tokens) == seq.request.max_new_tokens:
                        seq.result.finish_step = step
                        for b in seq.blocks:
                            cache.release(b)
                        seq.blocks = []
                        running.remove(seq)
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
            step += 1
        trace.seconds, trace.steps = time.perf_counter() - start_time, step
        return results, trace

    def _forward_alone(self, cache: PagedKVCache, chunks: list, error: Exception, step: int, attention, slots_of):
        """The batched pass raised `error`: run each chunk alone. Returns (logits, {chunk index: its exception}).

        A chunk's keys and values go to its own blocks (a shared block is copied before it is written), so
        what the failed batched pass wrote is rewritten here or freed with a failed request's blocks."""
        rows, failed = [], {}
        for i, chunk in enumerate(chunks):
            try:
                rows.append(paged_forward(self.model, cache, [chunk], attention=attention, slots_of=slots_of)[0])
            except Exception as alone:  # noqa: BLE001 - this chunk's own error
                failed[i] = alone
                rows.append(None)
        if not failed:
            raise RuntimeError(f"step {step}: the batched forward pass over {len(chunks)} chunks raised, but every "
                               f"chunk alone succeeded: an engine error, not a request's") from error
        return rows, failed

    @staticmethod
    def _fail(cache: PagedKVCache, seq: Sequence, running: list, step: int, error: Exception) -> None:
        """Record `error` on the request's Result and give its blocks back; it leaves the engine."""
        seq.result.error = f"request {seq.request.name}: failed at step {step}: {type(error).__name__}: {error}"
        for b in seq.blocks:
            cache.release(b)
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
        """Blocks for positions n_cached .. n_cached + n - 1: copy a shared block first, then append new ones."""
        S = cache.block_size
        i = seq.n_cached // S  # the block the next token goes into
        if seq.n_cached < len(seq.blocks) * S and cache.refs[seq.blocks[i]] > 1:  # it would write into a shared block
            seq.blocks[i] = cache.copy_block(seq.blocks[i])
        while len(seq.blocks) * S < seq.n_cached + n:
            seq.blocks.append(cache.allocate())

    @staticmethod
    def _register_full_blocks(cache: PagedKVCache, seq: Sequence, before: int) -> None:
        """Offer for sharing every block this step filled."""
        S = cache.block_size
        for i in range(before // S, seq.n_cached // S):
            cache.register(tuple(seq.tokens[:(i + 1) * S]), seq.blocks[i])

    @staticmethod
    def _used_slots(cache: PagedKVCache, running: list) -> int:
        """Slots holding a cached token, each shared block counted once."""
        filled: dict = {}
        S = cache.block_size
        for seq in running:
            for i, b in enumerate(seq.blocks):
                filled[b] = max(filled.get(b, 0), min(S, seq.n_cached - i * S))
        return sum(max(0, f) for f in filled.values())


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
    if not _integer(max_batch_size) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
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
            now = time.perf_counter() - start_time
            column = torch.zeros(B, 1, dtype=torch.long)
            for row, r in enumerate(batch):
                done = len(tokens[row]) - len(r.prompt) >= r.max_new_tokens or row in failed
                states[r.name] = "idle" if done else ("prefill" if t == 0 else "decode")
                if done:
                    continue
                try:
                    token = _choose(logits[row], tokens[row], len(r.prompt), r.sampling, generators[row])
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
