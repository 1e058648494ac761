"""Visible checks of chapter 05 (KV cache), and the independent oracles they compare against.

Oracles: ``F.scaled_dot_product_attention`` over the whole sequence in float64 (the cached step must
give the rows of the new tokens), greedy decoding by full forward passes of the model with no cache
at all (``greedy_oracle``), and cache sizes counted on tensors shaped like a real cache, allocated on
PyTorch's ``meta`` device (``kv_cache_bytes_oracle``); never course_lib's reference solutions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ch04 import randomize_gpt
from .core import assert_close, assert_shape, assert_tensor, fail, greedy_oracle, passed

__all__ = ["check_cached_attention_step", "check_generate_cached", "check_kv_cache_bytes", "attention_rows_oracle",
           "kv_cache_bytes_oracle", "kv_test_model"]


def attention_rows_oracle(q, k, v, past_k, past_v):
    """Float64 rows of the new tokens: causal F.scaled_dot_product_attention over the whole sequence (past + new).

    q (B, H, T, Dh), k, v (B, H_kv, T, Dh), past_k, past_v (B, H_kv, P, Dh) -> (B, H, T, Dh) float64.
    The queries of the past tokens are irrelevant (they are not computed again): zeros stand in for them.
    """
    P = past_k.shape[2]
    keys = torch.cat([past_k, k], dim=2).double()
    values = torch.cat([past_v, v], dim=2).double()
    queries = torch.cat([q.new_zeros(q.shape[0], q.shape[1], P, q.shape[3]), q], dim=2).double()
    out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, P:]


def kv_test_model(seed: int, vocab_size: int = 17, block_size: int = 64, n_layer: int = 2, n_head: int = 2, n_embd: int = 16):
    """A small GPT (chapter 04's model) with seeded random weights, in eval mode."""
    from ..gpt import GPT, GPTConfig  # the model the cache serves (chapter 04), not a chapter 05 solution

    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return randomize_gpt(GPT(config), seed=seed, scale=0.5)


@torch.no_grad()


def kv_cache_bytes_oracle(n_layer: int, n_embd: int, n_head: int, seq_len: int, n_kv_head: int | None = None,
                          batch_size: int = 1, dtype=torch.float16) -> int:
    """The bytes of a cache built as a list of (keys, values) per layer, each (B, H_kv, T, Dh), on the meta device."""
    H_kv = n_head if n_kv_head is None else n_kv_head
    shape = (batch_size, H_kv, seq_len, n_embd // n_head)
    layers = [(torch.empty(shape, dtype=dtype, device="meta"), torch.empty(shape, dtype=dtype, device="meta"))
              for _ in range(n_layer)]
    return sum(t.numel() * t.element_size() for pair in layers for t in pair)


def _unpack_step(result, name):
    if not isinstance(result, tuple) or len(result) != 3:
        fail(f"{name} should return a tuple (y, keys, values), got {type(result).__name__}")
    return result


def check_cached_attention_step(cached_attention_step) -> None:
    """Visible checks for chapter 05, exercise 1: a chunk of 3 new tokens against 4 cached ones, 2 heads."""
    g = torch.Generator().manual_seed(501)
    B, H, P, T, Dh = 2, 2, 4, 3, 8
    past_k, past_v = torch.randn(B, H, P, Dh, generator=g), torch.randn(B, H, P, Dh, generator=g)
    q, k, v = (torch.randn(B, H, T, Dh, generator=g) for _ in range(3))
    y, keys, values = _unpack_step(cached_attention_step(q, k, v, past_k, past_v), "cached_attention_step(q, k, v, past_k, past_v)")
    assert_shape(y, (B, H, T, Dh), "y for 3 new queries (B, H, T, Dh) = (2, 2, 3, 8)")
    assert_shape(keys, (B, H, P + T, Dh), "the returned keys: the 4 cached and the 3 new ones, (B, H, P + T, Dh)")
    assert_close(keys, torch.cat([past_k, k], dim=2), "the returned keys (the cached ones first, then the new ones)")
    assert_close(values, torch.cat([past_v, v], dim=2), "the returned values (the cached ones first, then the new ones)")
    expected = attention_rows_oracle(q, k, v, past_k, past_v)
    error = (y.double() - expected).abs().amax(dim=(0, 1, 3))  # per new token
    if error[-1] < 1e-4 and error[:-1].max() > 1e-4:
        fail(f"the last new token is right, but tokens 0 and 1 of the chunk are off by up to {error[:-1].max().item():.3g}: "
             "inside a chunk, new token i (slot P + i) may attend to slots 0..P + i only, not to the new tokens after it. "
             "Is the causal mask missing?")
    if error[0] > 1e-4 and error[-1] > 1e-4:
        fail(f"every new token is off (by up to {error.max().item():.3g}); new token i sits at slot P + i = {P} + i and "
             "may attend to every cached slot and to slots P..P + i of the chunk. Is the causal mask offset by the "
             "P cached tokens (tril(diagonal=P))? Is the scale 1/sqrt(Dh)?")
    assert_close(y, expected.float(), "y compared with causal F.scaled_dot_product_attention over all 7 tokens (float64)")
    _check_grouped_heads(cached_attention_step, g)
    passed("cached_attention_step")


def _check_grouped_heads(cached_attention_step, g) -> None:
    """4 query heads over 2 key/value heads: heads 0, 1 read key/value head 0 and heads 2, 3 head 1 (grouped)."""
    B, H, H_kv, P, T, Dh = 1, 4, 2, 3, 2, 8
    past_k, past_v = torch.randn(B, H_kv, P, Dh, generator=g), torch.randn(B, H_kv, P, Dh, generator=g)
    q = torch.randn(B, H, T, Dh, generator=g)
    k, v = torch.randn(B, H_kv, T, Dh, generator=g), torch.randn(B, H_kv, T, Dh, generator=g)
    y, _, _ = _unpack_step(cached_attention_step(q, k, v, past_k, past_v),
                           "cached_attention_step with 4 query heads and 2 key/value heads")
    assert_shape(y, (B, H, T, Dh), "y for 4 query heads over 2 key/value heads (B, H, T, Dh) = (1, 4, 2, 8)")
    expected = attention_rows_oracle(q, k, v, past_k, past_v)
    tile = lambda t: t.repeat(1, H // H_kv, 1, 1)  # noqa: E731 - head h reads key/value head h % H_kv
    tiled = attention_rows_oracle(q, tile(k), tile(v), tile(past_k), tile(past_v))
    if torch.allclose(y.double(), tiled, rtol=1e-4, atol=1e-5) and not torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-5):
        fail("with 4 query heads and 2 key/value heads, your query head h reads key/value head h % 2 (the heads are "
             "tiled, as .repeat does); grouped-query attention groups consecutive heads: head h reads key/value head "
             "h // (H / H_kv), as repeat_interleave does")
    assert_close(y, expected.float(), "y with 4 query heads over 2 key/value heads (grouped: head h reads h // 2)")


def check_generate_cached(generate_cached) -> None:
    """Visible checks for chapter 05, exercise 2: batch 1, 12 new tokens, against greedy decoding without a cache."""
    model = kv_test_model(seed=502)
    idx = torch.randint(0, 17, (1, 6), generator=torch.Generator().manual_seed(503))
    out = generate_cached(model, idx, 12)
    assert_tensor(out, "generate_cached(model, idx, 12)")
    assert_shape(out, (1, 18), "the output for a prompt of 6 tokens and 12 new ones (B, T + max_new_tokens)")
    if not torch.equal(out[:, :6], idx):
        fail("the first 6 tokens of the output should be the prompt itself")
    expected = greedy_oracle(model, idx, 12)
    if out[0, 6] != expected[0, 6]:
        fail(f"your first new token is {out[0, 6].item()}, but the argmax of the model's logits after the prompt is "
             f"{expected[0, 6].item()}: take it from the prefill's last logits (is the last prompt token fed a second time?)")
    differ = (out[0] != expected[0]).nonzero()
    if len(differ):
        step = differ[0].item() - 6
        fail(f"your new tokens agree with greedy decoding without a cache for {step} step(s), then differ: new token {step} "
             f"is {out[0, 6 + step].item()}, expected {expected[0, 6 + step].item()}. Is each new token fed once, at the "
             "next position (do the positions advance with the cache)?")
    passed("generate_cached")


def check_kv_cache_bytes(kv_cache_bytes) -> None:
    """Visible checks for chapter 05, exercise 3: the course model (float32), GPT-2 Large (float16), a GQA model."""
    cases = [
        ("the course model (4 layers, 128 dims, 4 heads), 128 tokens, float32", (4, 128, 4, 128), dict(dtype=torch.float32)),
        ("GPT-2 Large (36 layers, 1280 dims, 20 heads), 1024 tokens, float16", (36, 1280, 20, 1024), dict(dtype=torch.float16)),
        ("a GQA model (8 layers, 512 dims, 8 query heads, 2 key/value heads), 256 tokens, batch 4, float16",
         (8, 512, 8, 256), dict(n_kv_head=2, batch_size=4, dtype=torch.float16)),
    ]
    for name, args, kwargs in cases:
        got = kv_cache_bytes(*args, **kwargs)
        if not isinstance(got, int):
            fail(f"kv_cache_bytes should return an int (bytes), got {type(got).__name__}")
        expected = kv_cache_bytes_oracle(*args, **kwargs)
        if got != expected:
            fail(f"for {name}: you computed {got:,} bytes, the cache holds {expected:,} (ratio {got / expected:.4g}; "
                 "a key AND a value per token, layer and key/value head, each of head size n_embd / n_head)")
    passed("kv_cache_bytes")
