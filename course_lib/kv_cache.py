"""KV cache, chapter 05: cached inference for course_lib.gpt.GPT.

Generating token t+1 needs the keys and values of tokens 0..t in every layer. Those of 0..t-1 were
already computed at the previous step: a KV cache keeps them, so each step projects only the new
token(s). ``KVCache`` preallocates the storage once; ``cached_forward`` runs a GPT over new tokens
against a cache (prefill: the whole prompt at once; decode: one token at a time).

Shapes: B batch, T new tokens, P tokens already in the cache, L layers, H query heads, H_kv key/value
heads (H_kv = H for GPT-2; fewer for grouped-query attention), Dh head size, V vocabulary.

Positions. ``cache.length`` counts the *slots* written so far (the same for every row). The
position of a token in the model (its learned position embedding) equals its slot unless the batch
is left-padded: then ``attention_mask`` (B, P + T), 1 for real tokens and 0 for padding, gives each
row's positions as the running count of its real tokens, as Hugging Face's GPT-2 does.
"""
from __future__ import annotations

import math

import torch

from .attention import masked_softmax


class KVCache:
    """Preallocated keys and values of every layer: storage (L, 2, B, H_kv, max_len, Dh), no re-allocation per step.

    ``update(layer, k, v)`` stores the new keys and values of one layer at slots length..length+T-1 and
    returns everything the new queries may attend to; ``advance(T)`` moves the write position once all
    layers are done (``cached_forward`` does both). ``crop(n)`` forgets everything after slot n (rollback,
    for speculative decoding).

    With ``window=W`` the storage holds only the last W slots, as a ring buffer (slot s lives at index
    s % W): memory stays constant however long the generation, and a query at slot s attends to keys at
    slots s-W+1..s only (sliding-window attention).
    """

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, head_dim: int, max_len: int, *,
                 window: int | None = None, dtype=torch.float32, device=None):
        for name, value in (("n_layer", n_layer), ("batch_size", batch_size), ("n_kv_head", n_kv_head),
                            ("head_dim", head_dim), ("max_len", max_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or an integer >= 1, got {window!r}")
        self.max_len = max_len
        self.window = window
        capacity = max_len if window is None else min(window, max_len)
        self.storage = torch.zeros(n_layer, 2, batch_size, n_kv_head, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0  # slots written so far

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, *, window: int | None = None) -> "KVCache":
        """An empty cache sized for a course_lib.gpt.GPT (max_len defaults to its block_size)."""
        c = model.config
        weight = model.transformer.wte.weight
        return cls(c.n_layer, batch_size, getattr(c, "n_kv_head", None) or c.n_head, c.n_embd // c.n_head,
                   c.block_size if max_len is None else max_len, window=window, dtype=weight.dtype, device=weight.device)

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
        T = k.shape[2]
        if self.length + T > self.max_len:
            raise ValueError(f"the cache is full: it holds max_len = {self.max_len} tokens, "
                             f"{self.length} are cached and {T} more were given")
        keys, values = self.storage[layer, 0], self.storage[layer, 1]  # views (B, H_kv, capacity, Dh)
        if self.window is None:
            keys[:, :, self.length:self.length + T] = k
            values[:, :, self.length:self.length + T] = v
            return keys[:, :, :self.length + T], values[:, :, :self.length + T]
        # ring buffer: the new queries see the held window and every new token; then only the last W are kept
        held = self.slots() % self.capacity
        all_keys = torch.cat([keys[:, :, held], k], dim=2)
        all_values = torch.cat([values[:, :, held], v], dim=2)
        kept = min(T, self.capacity)
        where = torch.arange(self.length + T - kept, self.length + T, device=k.device) % self.capacity
        keys[:, :, where] = k[:, :, T - kept:]
        values[:, :, where] = v[:, :, T - kept:]
        return all_keys, all_values

    def advance(self, T: int) -> None:
        """Move the write position past the T slots every layer has just stored."""
        self.length += T

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` (B_new,) int64, in that order: beam search follows its surviving beams.

        B_new may differ from the current batch size (a row may be repeated or dropped)."""
        self.storage = self.storage.index_select(2, rows.to(self.storage.device))

    @property
    def batch_size(self) -> int:
        return self.storage.shape[2]

    def crop(self, length: int) -> None:
        """Forget every slot from `length` on (rollback): the next update writes at slot `length`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}] (the cached length), got {length}")
        if self.window is not None and length < self.length and self.length > self.capacity:
            raise ValueError("a sliding-window cache cannot be cropped once it has wrapped around "
                             f"(it holds only the last {self.capacity} slots)")
        self.length = length


def cached_attention(attn, x, cache: KVCache, layer: int, allowed: torch.Tensor):
    """One CausalSelfAttention (course_lib.gpt) over new tokens x (B, T, C), against the cache of `layer`.

    allowed (B, 1, T, T_k) bool says which cached-or-new key each new query may attend to.
    Returns (B, T, C). The new keys and values are written into the cache.
    """
    B, T, C = x.shape
    H = attn.n_head
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)
    keys, values = cache.update(layer, k, v)  # (B, H, T_k, Dh)
    weights = masked_softmax(q @ keys.transpose(-2, -1) / math.sqrt(C // H), allowed)  # (B, H, T, T_k)
    y = (weights @ values).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y)


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


@torch.no_grad()
def cached_forward(model, idx, cache: KVCache, attention_mask=None):
    """Run a course_lib.gpt.GPT over new tokens idx (B, T) against `cache`; returns logits (B, T, V).

    The first call (empty cache) is the prefill: the whole prompt in one pass. Later calls decode, one
    token (or a chunk of tokens) at a time; the causal mask holds inside a chunk too. attention_mask
    (B, P + T), if given, covers every slot so far (cached and new): 1 for real tokens, 0 for padding.
    Inference only: no gradients, and the model must be in eval mode (no dropout). The cache advances by T.
    """
    B, T = idx.shape
    if cache.batch_size != B:
        raise ValueError(f"idx has batch size {B} but the cache holds {cache.batch_size} rows")
    past = cache.length
    if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
        raise ValueError(f"attention_mask must have shape (B, cached + new) = {(B, past + T)}, got {tuple(attention_mask.shape)}")
    positions = position_ids(attention_mask, past, T, B, idx.device)
    if positions.numel() and positions.max().item() >= model.config.block_size:
        raise ValueError(f"positions must be < block_size = {model.config.block_size}: the context is full "
                         f"(position {positions.max().item()} requested)")
    query_slots = torch.arange(past, past + T, device=idx.device)
    key_slots = cache.key_slots(T)
    allowed = attention_allowed(query_slots, key_slots, attention_mask, cache.window)
    tr = model.transformer
    x = tr.wte(idx) + tr.wpe(positions)  # (B, T, C)
    for layer, block in enumerate(tr.h):
        x = x + cached_attention(block.attn, block.ln_1(x), cache, layer, allowed)
        x = x + block.mlp(block.ln_2(x))
    cache.advance(T)
    return model.lm_head(tr.ln_f(x))
