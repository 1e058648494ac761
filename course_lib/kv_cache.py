"""KV cache, chapter 05: cached inference for course_lib.gpt.GPT.

Generating token t+1 needs the keys and values of tokens 0..t in every layer. Those of 0..t-1 were
already computed at the previous step: a KV cache keeps them, so each step projects only the new
token(s). ``KVCache`` preallocates the storage once; ``cached_forward`` runs a GPT over new tokens
against a cache (prefill: the whole prompt at once; decode: one token at a time).

Shapes: B batch, T new tokens, P tokens already in the cache, L layers, H query heads, H_kv key/value
heads (H_kv = H for GPT-2; fewer for grouped-query attention), Dh head size, V vocabulary.

Contents: ``StaticKVCache`` (preallocated, batched), ``KVCache`` (the same with rollback, beam reordering and
an optional sliding-window ring buffer) and ``ConcatKVCache``
(the naive cache that grows by ``torch.cat``, chapter 05's first version); ``cached_forward`` (a GPT over
new tokens against a cache) and ``generate_cached`` (greedy prefill + decode); ``cached_attention_step``
(attention of new queries against cached keys and values, grouped-query aware); ``kv_cache_bytes``
(the memory formula); ``GQASelfAttention`` (grouped-/multi-query causal self-attention whose cache holds
H_kv heads). ``cached_attention_step``, ``StaticKVCache`` with ``generate_cached``, and ``kv_cache_bytes`` are the
reference solutions of chapter 05's exercises (``tests/grading/test_solution_drift.py`` keeps them equal to the notebook's).

Positions. ``cache.length`` counts the *slots* written so far (the same for every row). The
position of a token in the model (its learned position embedding) equals its slot unless the batch
is left-padded: then ``attention_mask`` (B, P + T), 1 for real tokens and 0 for padding, gives each
row's positions as the running count of its real tokens, as Hugging Face's GPT-2 does.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import masked_softmax
from .gpt import gpt_logits, qkv_heads
from .validation import check_positive


class StaticKVCache:
    """A preallocated KV cache of every layer of a model, for a batch of rows (no sliding window).

    The cache ``cached_forward`` runs against and ``generate_cached`` decodes with (chapter 05, exercise 2).
    Contract, which the tests check by behaviour:

    * ``StaticKVCache(n_layer, batch_size, n_kv_head, head_dim, max_len, *, dtype=torch.float32, device=None)``
      has room for max_len tokens of each of batch_size rows; each of the five sizes must be an integer
      >= 1, else ValueError naming it. Memory is allocated here, once: never per step.
    * ``StaticKVCache.for_model(model, batch_size, max_len=None, **options)``: an empty cache sized for a
      chapter 04 GPT (its layers, heads, head size n_embd // n_head, dtype and device); max_len defaults
      to its block_size; options go to the constructor.
    * ``length`` (tokens cached so far, 0 when empty, the same for every row), ``batch_size``, ``max_len``: ints.
    * ``update(layer, k, v)``, k and v (B, H_kv, T, Dh) the keys and values of T new tokens in `layer`:
      stores them and returns (keys, values), each (B, H_kv, length + T, Dh), the cached tokens first
      (oldest first), then the new ones. It raises ValueError ("the cache is full") exactly when
      length + T > max_len. ``length`` does not change until ``advance(T)``, called once every layer is updated.
    * ``check_room(T)``: raises that ValueError unless T more tokens fit (length + T <= max_len); ``update`` calls it.
    * The storage has the dtype and device given (``for_model``: the model's), and ``update`` returns them.
    """

    window = None  # no sliding window: a new token may attend to every cached slot

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, head_dim: int, max_len: int, *,
                 dtype=torch.float32, device=None):
        for name, value in (("n_layer", n_layer), ("batch_size", batch_size), ("n_kv_head", n_kv_head),
                            ("head_dim", head_dim), ("max_len", max_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_len = max_len
        self.storage = torch.zeros(n_layer, 2, batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device)
        self.length = 0  # slots written so far

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, **options):
        c = model.config
        weight = model.transformer.wte.weight
        return cls(c.n_layer, batch_size, getattr(c, "n_kv_head", None) or c.n_head, c.n_embd // c.n_head,
                   c.block_size if max_len is None else max_len, dtype=weight.dtype, device=weight.device, **options)

    @property
    def batch_size(self) -> int:
        return self.storage.shape[2]

    def check_room(self, T: int) -> None:
        """ValueError ("the cache is full") unless T more tokens fit: length + T <= max_len."""
        if self.length + T > self.max_len:
            raise ValueError(f"the cache is full: it holds max_len = {self.max_len} tokens, "
                             f"{self.length} are cached and {T} more were given")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        T = k.shape[2]
        self.check_room(T)
        keys, values = self.storage[layer, 0], self.storage[layer, 1]  # views (B, H_kv, max_len, Dh)
        keys[:, :, self.length:self.length + T] = k
        values[:, :, self.length:self.length + T] = v
        return keys[:, :, :self.length + T], values[:, :, :self.length + T]

    def advance(self, T: int) -> None:
        self.length += T


class KVCache(StaticKVCache):
    """``StaticKVCache`` with rollback (``crop``), beam reordering (``reorder``) and an optional sliding window.

    Storage (L, 2, B, H_kv, capacity, Dh), no re-allocation per step. ``update(layer, k, v)`` stores the
    new keys and values of one layer at slots length..length+T-1 and returns everything the new queries
    may attend to; ``advance(T)`` moves the write position once all layers are done (``cached_forward``
    does both). ``crop(n)`` forgets everything after slot n (rollback, for speculative decoding).

    With ``window=W`` the storage holds only the last W slots, as a ring buffer (slot s lives at index
    s % W): memory stays constant however long the generation, and a query at slot s attends to keys at
    slots s-W+1..s only (sliding-window attention).
    """

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, head_dim: int, max_len: int, *,
                 window: int | None = None, dtype=torch.float32, device=None):
        check_positive("window", window, optional=True)
        capacity = max_len if window is None or not isinstance(max_len, int) else min(window, max_len)
        super().__init__(n_layer, batch_size, n_kv_head, head_dim, capacity, dtype=dtype, device=device)
        self.max_len = max_len
        self.window = window

    @property
    def capacity(self) -> int:
        """Slots the storage holds: max_len, or the window for a sliding-window cache."""
        return self.storage.shape[4]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values: 2 * L * B * H_kv * capacity * Dh * element size."""
        return self.storage.numel() * self.storage.element_size()

    def slots(self) -> torch.Tensor:
        """The slots whose keys and values the cache holds, oldest first: (n,) int64."""
        start = 0 if self.window is None else max(0, self.length - self.capacity)
        return torch.arange(start, self.length, device=self.storage.device)

    def key_slots(self, T: int) -> torch.Tensor:
        """The slots of the keys that ``update`` returns when T new tokens come: the held ones, then the new ones."""
        start = 0 if self.window is None else max(0, self.length - self.capacity)
        return torch.arange(start, self.length + T, device=self.storage.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, H_kv, T, Dh) at slots length..length+T-1 of `layer`.

        Returns keys and values (B, H_kv, T_k, Dh) of every slot the new queries may need: the held
        ones, oldest first, then the new ones (their slots are ``key_slots(T)``).
        """
        if self.window is None:
            return super().update(layer, k, v)
        T = k.shape[2]
        self.check_room(T)
        keys, values = self.storage[layer, 0], self.storage[layer, 1]  # views (B, H_kv, capacity, Dh)
        # ring buffer: the new queries see the held window and every new token; then only the last W are kept
        held = self.slots() % self.capacity
        all_keys = torch.cat([keys[:, :, held], k], dim=2)
        all_values = torch.cat([values[:, :, held], v], dim=2)
        kept = min(T, self.capacity)
        where = torch.arange(self.length + T - kept, self.length + T, device=k.device) % self.capacity
        keys[:, :, where] = k[:, :, T - kept:]
        values[:, :, where] = v[:, :, T - kept:]
        return all_keys, all_values

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` (B_new,) int64, in that order: beam search follows its surviving beams.

        B_new may differ from the current batch size (a row may be repeated or dropped)."""
        self.storage = self.storage.index_select(2, rows.to(self.storage.device))

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on (rollback): the next update writes at slot `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}] (the cached length), got {length}")
        if self.window is not None and length < self.length and self.length > self.capacity:
            raise ValueError("a sliding-window cache cannot be cropped once it has wrapped around "
                             f"(it holds only the last {self.capacity} slots)")
        self.length = length


class ConcatKVCache:
    """The first, simplest cache: per layer, keys and values grow by ``torch.cat`` at every step.

    Same interface as ``KVCache`` (``update``, ``advance``, ``key_slots``, ``length``), so
    ``cached_forward`` runs on it; but every step allocates new (B, H_kv, P + T, Dh) tensors and copies
    everything cached so far: O(P) copying per step, O(N^2) over a generation. ``KVCache`` fixes that.
    """

    window = None
    max_len = math.inf

    def __init__(self, n_layer: int, batch_size: int):
        if n_layer < 1 or batch_size < 1:
            raise ValueError(f"n_layer and batch_size must be >= 1, got {n_layer} and {batch_size}")
        self.keys: list = [None] * n_layer
        self.values: list = [None] * n_layer
        self.batch_size = batch_size
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (B, H_kv, T, Dh); return all keys and values of the layer (B, H_kv, P + T, Dh)."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)  # a new tensor: copies all P cached keys
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def key_slots(self, T: int) -> torch.Tensor:
        return torch.arange(self.length + T)

    def advance(self, T: int) -> None:
        self.length += T

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


def cached_attention_step(q, k, v, past_k, past_v):
    """Attention of T new queries against the cached keys and values plus the T new ones.

    q (B, H, T, Dh): queries of the new tokens; k, v (B, H_kv, T, Dh): their keys and values;
    past_k, past_v (B, H_kv, P, Dh): the cache (P may be 0). H_kv divides H: each group of H / H_kv
    consecutive query heads shares one key/value head (H_kv = H: multi-head; 1: multi-query).
    New token i sits at slot P + i: it attends to slots 0..P + i (causal inside a chunk too, T may be 1
    or more); the scores are scaled by 1/sqrt(Dh).
    Returns (y (B, H, T, Dh), keys (B, H_kv, P + T, Dh), values (B, H_kv, P + T, Dh)): the new cache, cached
    ones first, with the H_kv key/value heads only (not repeated for the query heads).
    """
    P, T, Dh = past_k.shape[2], q.shape[2], q.shape[3]
    keys = torch.cat([past_k, k], dim=2)  # (B, H_kv, P + T, Dh): oldest first
    values = torch.cat([past_v, v], dim=2)
    group = q.shape[1] // keys.shape[1]  # query heads per key/value head
    k_all = keys.repeat_interleave(group, dim=1)  # (B, H, P + T, Dh): head h reads key/value head h // group
    v_all = values.repeat_interleave(group, dim=1)
    allowed = torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(diagonal=P)  # query i: keys 0..P + i
    weights = masked_softmax(q @ k_all.transpose(-2, -1) / math.sqrt(Dh), allowed)  # (B, H, T, P + T)
    return weights @ v_all, keys, values


def attention_allowed(query_slots, key_slots, attention_mask=None, window: int | None = None):
    """Which key each query may attend to: (B or 1, 1, T, T_k) bool.

    Causal (key slot <= query slot), within the window if any (query slot - key slot < window), and
    never a padding key (attention_mask (B, P + T), 0 for padding, indexed by slot).
    """
    allowed = key_slots[None, :] <= query_slots[:, None]  # (T, T_k)
    if window is not None:
        allowed = allowed & (query_slots[:, None] - key_slots[None, :] < window)
    allowed = allowed[None, None]  # (1, 1, T, T_k)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, key_slots].bool()[:, None, None, :]
    return allowed


def position_ids(attention_mask, past: int, T: int, batch_size: int, device=None) -> torch.Tensor:
    """Positions of the T new tokens: (B, T) int64. Slots past..past+T-1 without a mask; with a
    (left-padding) mask, the number of real tokens before each one (padding gets position 0)."""
    if attention_mask is None:
        return torch.arange(past, past + T, device=device).expand(batch_size, T)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:past + T]


def cached_attention(attn, x, cache, layer: int, allowed):
    """One CausalSelfAttention (course_lib.gpt) over new tokens x (B, T, C), against the cache of `layer`.

    allowed (B or 1, 1, T, T_k) bool says which cached-or-new key each new query may attend to; None
    means every key (one new token, no padding, no window: the common decode step, which then runs
    ``F.scaled_dot_product_attention`` without a mask). Returns (B, T, C); the new keys and values
    are written into the cache.
    """
    B, T, _ = x.shape
    q, k, v = qkv_heads(attn, x)  # (B, H, T, Dh)
    keys, values = cache.update(layer, k, v)  # (B, H, T_k, Dh)
    if allowed is None:
        y = F.scaled_dot_product_attention(q, keys, values)  # (B, H, T, Dh)
    else:
        y = masked_softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), allowed) @ values
    H, Dh = y.shape[1], y.shape[3]
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, H * Dh))  # C, or a rank's C / p (chapter 16); T may be 0


@torch.no_grad()
def cached_forward(model, idx, cache, attention_mask=None, positions=None):
    """Run a course_lib.gpt.GPT over new tokens idx (B, T) against `cache`; returns logits (B, T, V).

    The first call (empty cache) is the prefill: the whole prompt in one pass. Later calls decode, one
    token (or a chunk of tokens) at a time; the causal mask holds inside a chunk too. attention_mask
    (B, P + T), if given, covers every slot so far (cached and new): 1 for real tokens, 0 for padding.
    positions (B, T) int64, if given, are the new tokens' positions (default: their slots, or with a
    mask the count of real tokens before each one, see ``position_ids``).
    Inference only: no gradients, and the model must be in eval mode (no dropout). The cache advances by T.
    The cache needs ``batch_size``, ``max_len``, ``length``, ``update`` and ``advance`` (see ``StaticKVCache``);
    a sliding-window one also ``window`` and ``key_slots``.
    """
    B, T = idx.shape
    if cache.batch_size != B:
        raise ValueError(f"idx has batch size {B} but the cache holds {cache.batch_size} rows")
    past = cache.length
    if past + T > cache.max_len:
        raise ValueError(f"the cache is full: it holds max_len = {cache.max_len} tokens, "
                         f"{past} are cached and {T} more were given")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
        raise ValueError(f"attention_mask must have shape (B, cached + new) = {(B, past + T)}, got {tuple(attention_mask.shape)}")
    block_size = model.config.block_size
    if positions is None and attention_mask is None:  # positions = slots: checked without touching a tensor
        if past + T > block_size:
            raise ValueError(f"positions must be < block_size = {block_size}: the context is full "
                             f"(position {past + T - 1} requested)")
        positions = position_ids(None, past, T, B, idx.device)
    else:
        if positions is None:
            positions = position_ids(attention_mask, past, T, B, idx.device)
        elif tuple(positions.shape) != (B, T):
            raise ValueError(f"positions must have shape (B, T) = {(B, T)}, got {tuple(positions.shape)}")
        if positions.numel() and positions.max().item() >= block_size:
            raise ValueError(f"positions must be < block_size = {block_size}: the context is full "
                         f"(position {positions.max().item()} requested)")
    window = getattr(cache, "window", None)  # a cache without the attribute has no sliding window
    if T == 1 and attention_mask is None and window is None:
        allowed = None  # one new token, no padding: it may attend to every cached key and to itself
    else:
        query_slots = torch.arange(past, past + T, device=idx.device)
        key_slots = torch.arange(past + T, device=idx.device) if window is None else cache.key_slots(T)
        allowed = attention_allowed(query_slots, key_slots, attention_mask, window)
    logits = gpt_logits(model, idx, positions, lambda layer, attn, h: cached_attention(attn, h, cache, layer, allowed))
    cache.advance(T)
    return logits


@torch.inference_mode()
def generate_cached(model, idx, max_new_tokens: int, attention_mask=None):
    """Greedy generation with a KV cache: idx (B, T) int64 -> (B, T + max_new_tokens) int64, the prompt first.

    model: a chapter 04 GPT in eval mode; max_new_tokens >= 1. attention_mask (B, T), optional: 1 for
    real tokens, 0 for padding, for a batch of prompts of different lengths padded on the left.
    Contract: row b of the output is the prompt, then the tokens that greedy decoding without a cache (a
    full forward pass per token) appends to row b's real tokens alone, padding dropped; equal to Hugging
    Face's ``generate(do_sample=False)`` on the same weights. It runs on a ``StaticKVCache`` of
    T + max_new_tokens slots, feeds the model each prompt token once and each new token but the last one
    once: T + max_new_tokens - 1 token rows in all. Errors: those of ``cached_forward`` (a context longer
    than block_size).
    """
    B, T = idx.shape
    cache = StaticKVCache.for_model(model, B, T + max_new_tokens)
    mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask.new_ones(B, max_new_tokens)], dim=1)
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # (B, T + max_new_tokens), filled in below
    positions = position_ids(attention_mask, 0, T, B, idx.device)  # (B, T)
    logits = cached_forward(model, idx, cache, None if mask is None else mask[:, :T], positions)  # prefill
    position = positions[:, -1:] + 1  # (B, 1): the position of the first new token
    for t in range(T, T + max_new_tokens):
        out[:, t] = logits[:, -1].argmax(dim=-1)  # the greedy choice
        if t + 1 < T + max_new_tokens:  # feed it, once, at its own position
            logits = cached_forward(model, out[:, t:t + 1], cache, None if mask is None else mask[:, :t + 1], position)
            position = position + 1
    return out


def kv_cache_bytes(n_layer: int, n_embd: int, n_head: int, seq_len: int, *, n_kv_head: int | None = None,
                   batch_size: int = 1, dtype=torch.float16) -> int:
    """Bytes of the keys and values a KV cache holds for seq_len tokens (S) of each of batch_size sequences, an int.

    Dh = n_embd // n_head (the query heads set the head size); n_kv_head key/value heads (default n_head) are
    cached. The bytes per element are the dtype's (float16 and bfloat16 2, float32 4, float64 8). The tests
    compare with the tensors of real caches (allocated on the meta device), and check that the size follows
    n_kv_head, dtype, batch_size and seq_len.
    """
    H_kv = n_head if n_kv_head is None else n_kv_head
    head_dim = n_embd // n_head
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layer * batch_size * seq_len * H_kv * head_dim * element


class GQASelfAttention(nn.Module):
    """Causal self-attention with grouped-query attention: H query heads, H_kv key/value heads (H_kv divides H).

    n_kv_head = n_head is multi-head attention, 1 is multi-query attention. Each group of H / H_kv
    consecutive query heads shares one key/value head, so a KV cache holds H_kv heads per token and
    shrinks by H / H_kv. q_proj: C -> C, kv_proj: C -> 2 * H_kv * Dh, c_proj: C -> C.
    ``cached_attention_step`` (default: the course's) computes the attention itself, with the signature and
    contract of the course's ``cached_attention_step``; chapter 05 passes the learner's once it passes its check.
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, bias: bool = True, *,
                 cached_attention_step: Callable = cached_attention_step):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd must be divisible by n_head, got n_embd={n_embd} and n_head={n_head}")
        if not 1 <= n_kv_head <= n_head or n_head % n_kv_head != 0:
            raise ValueError(f"n_kv_head must divide n_head = {n_head} (1 <= n_kv_head <= n_head), got {n_kv_head}")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.kv_proj = nn.Linear(n_embd, 2 * n_kv_head * self.head_dim, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.cached_attention_step = cached_attention_step

    def forward(self, x, cache: KVCache | None = None, layer: int = 0):
        """x (B, T, C) -> (B, T, C). With a cache, x holds the T new tokens, their keys and values are
        stored in layer `layer` of the cache and the queries attend to everything cached before them
        (the caller advances the cache)."""
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k, v = self.kv_proj(x).view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, H_kv, T, Dh) each
        if cache is None:
            past_k = past_v = k[:, :, :0]  # nothing cached
            y, _, _ = self.cached_attention_step(q, k, v, past_k, past_v)
        else:
            if cache.window is not None:
                raise ValueError("GQASelfAttention supports a full cache only (window=None)")
            P = cache.length
            keys, values = cache.update(layer, k, v)  # (B, H_kv, P + T, Dh)
            y, _, _ = self.cached_attention_step(q, k, v, keys[:, :, :P], values[:, :, :P])
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
