"""The paged KV cache: one pool of fixed-size blocks for every layer, a free list, reference counts and the prefix
cache (vLLM's ``core/block_pool.py`` and ``kv_cache_manager.py``, nano-vllm's ``engine/block_manager.py``); a
sequence's block table against the pool (``allocate_slots``, ``cache_full_blocks``, ``used_slots``: the kv_cache_manager's
part, parallel sampling's copy on write included).

Shapes: L layers, H heads, Dh head size, N blocks in the pool, S block size (slots per block). The pool of one layer
holds keys (N, S, H, Dh) and values (N, S, H, Dh); slot ``b * S + o`` is offset o of block b.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from ..validation import check_positive


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
        #: per layer, views of its pool made once: (key pool, value pool), each (N, S, H, Dh)
        self.layers = [(pool[0], pool[1]) for pool in self.storage]
        #: per layer, its keys and values by slot, a view (2, N * S, H, Dh): a pass writes its new keys and values in one
        #: copy (sizes stated, not -1: the caller's bookkeeping of a tensor-parallel pool has 0 heads)
        self.slots = [pool.view(2, num_blocks * block_size, n_head, head_dim) for pool in self.storage]
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
        return self.storage.numel() // self.num_blocks * self.storage.element_size()

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

    def copy_on_write(self, block: int) -> int:
        """A fresh block holding a copy of `block` (keys and values of every layer), which loses this reference: what a
        sequence writes into then stays its own (parallel sampling's shared last prompt block, vLLM's copy on write)."""
        fresh = self.allocate()
        self.copy_block(block, fresh)
        self.release(block)
        return fresh

    def copy_block(self, source: int, fresh: int) -> None:
        """Block `fresh` becomes a copy of block `source`: keys and values of every layer."""
        self.storage[:, :, fresh] = self.storage[:, :, source]

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


# ----------------------------------------------------------------------------------------------------
# a sequence's block table (``serving.request.Sequence``: blocks, n_cached, tokens, shared_tail) against the pool


def allocate_slots(cache: PagedKVCache, seq, n: int) -> None:
    """Fresh blocks for positions n_cached .. n_cached + n - 1 (never a block another sequence holds: see
    ``Sequence.find_prefix``; a forked sequence's shared last block is copied first)."""
    if seq.shared_tail and seq.tail_copy_needed():
        seq.blocks[-1] = cache.copy_on_write(seq.blocks[-1])
    while len(seq.blocks) * cache.block_size < seq.n_cached + n:
        seq.blocks.append(cache.allocate())


def cache_full_blocks(cache: PagedKVCache, seq, before: int) -> None:
    """Remember every block filled since `before` tokens were cached (for the prefix cache)."""
    S = cache.block_size
    for i in range(before // S, seq.n_cached // S):
        cache.register(tuple(seq.tokens[:(i + 1) * S]), seq.blocks[i])


def used_slots(cache: PagedKVCache, running: list, forked: bool = True) -> int:
    """Slots holding a cached token, each shared block counted once: the running sequences' cached tokens, less a
    block's S slots for each reference to a block beyond its first (only full blocks are shared, found by prefix;
    every table holds just the blocks its n_cached fill; a forked sequence's shared last block, partly filled, holds
    n_cached % S for every sequence that shares it). forked: whether any sequence may share a partly filled last
    block (parallel sampling); False skips looking for one."""
    tables = [seq.blocks for seq in running]
    shared = sum(map(len, tables)) - len(set(itertools.chain.from_iterable(tables)))  # references beyond the first
    used = sum(seq.n_cached for seq in running) - cache.block_size * shared
    if forked:  # parallel sampling: a partly filled last block may be shared too (it holds n_cached % S)
        S, tails = cache.block_size, {}
        for seq in running:
            if seq.shared_tail and seq.n_cached % S:
                tails[seq.blocks[-1]] = tails.get(seq.blocks[-1], -1) + 1  # references beyond the first
                used += (S - seq.n_cached % S) * (tails[seq.blocks[-1]] > 0)
    return used
