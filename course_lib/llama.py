"""A Llama-style decoder, chapter 11: GPT-2's model with the block of Llama and Mistral.

What changes from ``course_lib.gpt.GPT`` (GPT-2), part by part:

    LayerNorm                 -> RMSNorm (no mean subtracted, no bias)            course_lib.layers.RMSNorm
    GELU MLP, 4C wide         -> SwiGLU MLP, three matrices about 8C/3 wide       course_lib.layers.SwiGLU
    learned position table    -> rotary positions on queries and keys             course_lib.positional
    H key/value heads         -> H_kv <= H key/value heads (grouped-query)        grouped as in course_lib.kv_cache
    biases everywhere         -> no biases
    LM head tied to wte       -> an untied LM head
    full causal attention     -> optionally a sliding window of W keys (Mistral)

The parameter names are Hugging Face's ``LlamaForCausalLM``/``MistralForCausalLM`` names, so a state dict
converts by copying (``course_lib.hf.llama_to_hf``), after permuting the rows of W_q and W_k when our
model uses the interleaved RoPE layout::

    model.embed_tokens                       token embedding (V, C)
    model.layers[i].input_layernorm          RMSNorm before attention
    model.layers[i].self_attn.{q,k,v,o}_proj (H Dh, C), (H_kv Dh, C), (H_kv Dh, C), (C, H Dh)
    model.layers[i].post_attention_layernorm RMSNorm before the MLP
    model.layers[i].mlp.{gate,up,down}_proj  (F, C), (F, C), (C, F)
    model.norm                               final RMSNorm
    lm_head                                  (C -> V), its own weight

Shapes: B batch, T time, C = n_embd, H = n_head, H_kv = n_kv_head, Dh = C / H, F = intermediate_size, V vocabulary.
``expand_kv_heads`` is the reference solution of chapter 11's fourth exercise (the attention itself lets
``F.scaled_dot_product_attention(enable_gqa=True)`` group the heads the same way, without copying them).
``forward(idx, targets)`` is GPT's, so chapter 04's training loop trains it; ``llama_cached_forward`` and
``generate_llama`` decode with chapter 05's ``KVCache`` (a ring buffer when the model has a window), calling the model's linear modules
(``kernels.use_fastest_kernels`` makes them run chapter 08's faster kernel per weight shape).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import IGNORE_INDEX, extend, greedy_choice
from .kv_cache import KVCache, attention_allowed
from .layers import RMSNorm, SwiGLU, swiglu_width
from .positional import rope_cos_sin, rotate_half_layout, rotate_interleaved_layout
from .validation import check_positive

ROPE_LAYOUTS = ("half", "interleaved")


@dataclass
class LlamaConfig:
    """Sizes of a Llama-style model. n_kv_head None means n_head (multi-head attention); intermediate_size None
    means ``swiglu_width(n_embd)`` (about 8C/3); window None means full causal attention, W a sliding window of
    W keys (the query's own included); rope_layout "half" is Hugging Face's pairing, "interleaved" chapter 02's."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int | None = None
    intermediate_size: int | None = None
    rope_base: float = 10000.0
    eps: float = 1e-5
    window: int | None = None
    rope_layout: str = "half"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive(name, getattr(self, name))
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"n_embd must split into n_head heads of even size, got n_embd={self.n_embd} and n_head={self.n_head}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if not isinstance(self.n_kv_head, int) or not 1 <= self.n_kv_head <= self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head must divide n_head = {self.n_head}, got {self.n_kv_head!r}")
        if self.intermediate_size is None:
            self.intermediate_size = swiglu_width(self.n_embd)
        check_positive("intermediate_size", self.intermediate_size)
        check_positive("window", self.window, optional=True)
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if not self.rope_base > 1 or not self.eps >= 0:
            raise ValueError(f"need rope_base > 1 and eps >= 0, got {self.rope_base} and {self.eps}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def expand_kv_heads(kv, n_rep):
    """Grouped-query attention's key/value heads, expanded to one per query head: (B, H_kv, T, Dh) -> (B, H_kv * n_rep, T, Dh).

    Head h of the result is key/value head h // n_rep: each key/value head serves a group of n_rep consecutive
    query heads (grouped, k0 k0 k1 k1, as Hugging Face's repeat_kv), not the whole set tiled (k0 k1 k0 k1).
    """
    return kv.repeat_interleave(n_rep, dim=1)  # (B, H_kv * n_rep, T, Dh)


def _rotate(config: LlamaConfig):
    return rotate_half_layout if config.rope_layout == "half" else rotate_interleaved_layout


class LlamaAttention(nn.Module):
    """Causal self-attention with RoPE on queries and keys and H_kv key/value heads, each shared by a group of
    H / H_kv consecutive query heads (grouped, never tiled). No biases. (B, T, C) -> (B, T, C)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, H, H_kv, Dh = config.n_embd, config.n_head, config.n_kv_head, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim, self.window = H, H_kv, Dh, config.window
        self.rotate = _rotate(config)
        self.q_proj = nn.Linear(C, H * Dh, bias=False)
        self.k_proj = nn.Linear(C, H_kv * Dh, bias=False)
        self.v_proj = nn.Linear(C, H_kv * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, C, bias=False)

    def heads(self, x):
        """(B, T, C) -> queries (B, H, T, Dh), keys and values (B, H_kv, T, Dh), before RoPE."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x, cos, sin):
        """x (B, T, C); cos, sin (T, Dh/2) of positions 0 .. T-1 -> (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.heads(x)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if self.window is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, Dh)
        else:
            slots = torch.arange(T, device=x.device)
            allowed = attention_allowed(slots, slots, None, self.window)  # (1, 1, T, T): causal and within the window
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class LlamaBlock(nn.Module):
    """A pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), both norms RMSNorm. (B, T, C) -> (B, T, C)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.eps)
        self.mlp = SwiGLU(config.n_embd, config.intermediate_size)

    def forward(self, x, attend: Callable):
        """x (..., C) -> (..., C). attend(attn, h) -> (..., C) is the attention of the module ``attn`` over the normed
        input h at the tokens' positions (``attn(h, cos, sin)``, or against a cache)."""
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama-style language model. forward(idx (B, T), targets (B, T) or None) -> (logits (B, T, V), loss or None),
    the same contract as ``course_lib.gpt.GPT`` (targets are the next tokens, -100 is padding).

    Initialisation as our GPT's, so that a comparison of the two is one of architecture: N(0, 0.02) for every
    matrix and embedding, N(0, 0.02 / sqrt(2 n_layer)) for the two projections that write into the residual
    stream (o_proj, down_proj); norm gains 1.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
            layers=nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)]),
            norm=RMSNorm(config.n_embd, config.eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer) if residual else 0.02)

    def forward(self, idx, targets=None):
        """idx (B, T) int64, targets (B, T) int64 or None -> (logits (B, T, V), mean cross-entropy or None)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length must be <= block_size = {self.config.block_size}, got {T}")
        x = self.model.embed_tokens(idx)  # (B, T, C): no position table, positions enter through RoPE
        cos, sin = rope_cos_sin(torch.arange(T, device=idx.device), self.config.head_dim, self.config.rope_base, x.dtype)
        logits = self.lm_head(llama_layers(self, x, lambda layer, attn, h: attn(h, cos, sin)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=IGNORE_INDEX)
        return logits, loss


def llama_layers(model: Llama, x, attend: Callable):
    """The block stack of a Llama, the one layer loop of the training and the cached forward: embedded tokens
    x (..., C) -> the final RMSNorm of the last block's output (..., C). attend(layer, attn, h) -> (..., C) is the
    attention step of block ``layer`` (its module ``attn``, its normed input h)."""
    for layer, block in enumerate(model.model.layers):
        x = block(x, partial(attend, layer))
    return model.model.norm(x)


def llama_param_count(config: LlamaConfig) -> int:
    """The number of parameters of Llama(config), by formula.

    Token embedding V C and the untied head V C; per layer: W_q and W_o C (H Dh) each, W_k and W_v C (H_kv Dh)
    each, the SwiGLU MLP 3 C F, two RMSNorm gains 2 C; the final RMSNorm C. No biases, no position table.
    """
    V, C, L, F_ = config.vocab_size, config.n_embd, config.n_layer, config.intermediate_size
    q_width, kv_width = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    per_layer = 2 * C * q_width + 2 * C * kv_width + 3 * C * F_ + 2 * C
    return 2 * V * C + L * per_layer + C


def new_cache(model: Llama, batch_size: int, max_len: int) -> KVCache:
    """An empty KVCache for the model: H_kv heads per layer, a ring buffer of W slots if the model has a window."""
    c = model.config
    weight = model.lm_head.weight
    return KVCache(c.n_layer, batch_size, c.n_kv_head, c.head_dim, max_len, window=c.window, dtype=weight.dtype,
                   device=weight.device)


def cached_llama_attention(attn: LlamaAttention, x, cache: KVCache, layer: int, cos, sin, allowed):
    """One LlamaAttention over new tokens x (B, T, C) against layer `layer` of the cache; cos, sin (T, Dh/2) of their
    positions; allowed (1, 1, T, T_k) bool or None (every key). The keys are cached after RoPE. Returns (B, T, C)."""
    B, T, _ = x.shape
    q, k, v = attn.heads(x)
    q, k = attn.rotate(q, cos, sin), attn.rotate(k, cos, sin)
    keys, values = cache.update(layer, k, v)  # (B, H_kv, T_k, Dh)
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)  # (B, H, T, Dh)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, attn.n_head * attn.head_dim))


@lru_cache(maxsize=8)
def rope_table(n: int, head_dim: int, base: float, dtype: torch.dtype, device: torch.device):
    """``rope_cos_sin`` of positions 0 .. n-1, (n, Dh/2) each, kept for the next call with the same arguments: a decode
    step slices its positions' rows instead of computing the angles again (the same numbers, one slice)."""
    with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable outside inference mode too
        return rope_cos_sin(torch.arange(n, device=device), head_dim, base, dtype)


@torch.no_grad()
def llama_cached_forward(model: Llama, idx, cache: KVCache):
    """Run the model over new tokens idx (B, T) at positions cache.length .. cache.length + T - 1; logits (B, T, V).

    The first call is the prefill, later calls decode; the cache advances by T. With a window the cache is a
    ring buffer of W slots and each query sees the last W keys (its own included). Eval mode, no gradients.
    """
    B, T = idx.shape
    if cache.batch_size != B:
        raise ValueError(f"idx has batch size {B} but the cache holds {cache.batch_size} rows")
    past, limit = cache.length, min(cache.max_len, model.config.block_size)
    if past + T > limit:
        raise ValueError(f"positions must be < {limit} (the cache's max_len and the block_size): {past} are cached and "
                         f"{T} more were given")
    c = model.config
    if T == 1 and cache.window is None:
        allowed = None  # one new token: it may attend to every cached key and to itself
    else:
        allowed = attention_allowed(torch.arange(past, past + T, device=idx.device), cache.key_slots(T), None, cache.window)
    x = model.model.embed_tokens(idx)
    cos, sin = (table[past:past + T] for table in rope_table(limit, c.head_dim, c.rope_base, x.dtype, idx.device))
    x = llama_layers(model, x, lambda layer, attn, h: cached_llama_attention(attn, h, cache, layer, cos, sin, allowed))
    cache.advance(T)
    return model.lm_head(x)


@torch.inference_mode()
def generate_llama(model: Llama, idx, max_new_tokens: int):
    """Greedy generation with a KV cache: idx (B, T) -> (B, T + max_new_tokens). No padding (prompts of one length)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cache = new_cache(model, idx.shape[0], idx.shape[1] + max_new_tokens)
    return extend(idx, max_new_tokens, lambda tokens, new: llama_cached_forward(model, new, cache)[:, -1], greedy_choice)
