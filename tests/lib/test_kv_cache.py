"""course_lib.kv_cache against independent oracles: the model's own full forward pass, a banded-mask forward
written with F.scaled_dot_product_attention, PyTorch's grouped-query SDPA, and Hugging Face's generate.

Tolerance: float32 parity at rtol = atol = 1e-5 (tests/helpers.py) on models with GPT-2's initialisation. On
the shipped checkpoint (trained, logits up to ~15) float32 rounding alone puts the full forward pass ~1e-5 from
the float64 logits (chapter 04 measured the same against Hugging Face), so its exact comparisons run in float64.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from course_lib import assets
from course_lib.gpt import GPT, GPTConfig, gpt_sample
from course_lib.kv_cache import (ConcatKVCache, GQASelfAttention, KVCache, cached_attention_step, cached_forward,
                                 generate_cached, kv_cache_bytes)
from tests.helpers import assert_parity

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks: tiny models crawl on several busy threads


def gpt(block_size=256, seed=0, **sizes) -> GPT:
    torch.manual_seed(seed)
    config = dict(vocab_size=103, block_size=block_size, n_layer=4, n_head=4, n_embd=128)
    return GPT(GPTConfig(**{**config, **sizes})).eval()


@pytest.fixture(scope="module")
def char_gpt64():
    return assets.load("char-gpt").double()


def full_logits(model, idx):
    with torch.no_grad():
        return model(idx)[0]


def stepwise(model, prompt, n_new, attention_mask=None):
    """Greedy generation with the cache; yields (sequence so far, logits of the newest step) after every step."""
    B, T = prompt.shape
    cache = KVCache.for_model(model, B, T + n_new)
    mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask.new_ones(B, n_new)], dim=1)
    logits = cached_forward(model, prompt, cache, None if mask is None else mask[:, :T])
    seq = prompt
    yield seq, logits
    for t in range(T, T + n_new - 1):
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = cached_forward(model, seq[:, -1:], cache, None if mask is None else mask[:, :t + 1])
        yield seq, logits


def test_cached_logits_equal_the_full_forward_at_every_step_of_a_200_token_generation():
    model = gpt(n_layer=2, n_head=2, n_embd=32)  # small: 200 full forward passes of up to 215 tokens are the oracle
    prompt = torch.randint(0, 103, (1, 16), generator=torch.Generator().manual_seed(1))
    steps = 0
    for seq, logits in stepwise(model, prompt, 200):
        assert_parity(logits[:, -1], full_logits(model, seq)[:, -1])
        steps += 1
    assert steps == 200 and seq.shape[1] == 16 + 199


def test_cached_logits_equal_the_full_forward_on_the_shipped_checkpoint_in_float64(char_gpt64):
    prompt = torch.tensor([assets.tokenizer("char-gpt").encode("The with statement")])
    for seq, logits in stepwise(char_gpt64, prompt, 128 - prompt.shape[1]):
        assert_parity(logits[:, -1], full_logits(char_gpt64, seq)[:, -1])


def test_left_padded_batch_with_a_mask_equals_each_prompt_alone_at_every_step():
    model = gpt(seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 103, (n,), generator=g) for n in (9, 4, 1, 6)]
    width = max(len(p) for p in prompts)
    batch = torch.full((len(prompts), width), 7)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        batch[row, width - len(p):], mask[row, width - len(p):] = p, 1
    batched = list(stepwise(model, batch, 40, mask))
    for row, p in enumerate(prompts):
        alone = list(stepwise(model, p[None], 40))
        for (seq_b, logits_b), (seq_a, logits_a) in zip(batched, alone):
            assert torch.equal(seq_b[row, width - len(p):], seq_a[0])
            assert_parity(logits_b[row, -1], logits_a[0, -1])
            assert_parity(logits_b[row, -1], full_logits(model, seq_a)[0, -1])


def test_chunked_prefill_keeps_the_causal_mask():
    model = gpt(seed=4)
    idx = torch.randint(0, 103, (2, 50), generator=torch.Generator().manual_seed(5))
    cache = KVCache.for_model(model, 2)
    chunks = [cached_forward(model, idx[:, s:e], cache) for s, e in ((0, 7), (7, 8), (8, 30), (30, 50))]
    assert_parity(torch.cat(chunks, dim=1), full_logits(model, idx))
    assert cache.length == 50


def test_concatenating_and_preallocated_caches_agree_and_only_the_preallocated_one_keeps_its_storage():
    model = gpt(seed=6)
    idx = torch.randint(0, 103, (1, 30), generator=torch.Generator().manual_seed(7))
    pre, cat = KVCache.for_model(model, 1, 30), ConcatKVCache(4, 1)
    address = pre.storage.data_ptr()
    for cache in (pre, cat):
        out = [cached_forward(model, idx[:, :10], cache)] + [cached_forward(model, idx[:, t:t + 1], cache) for t in range(10, 30)]
        assert_parity(torch.cat(out, dim=1), full_logits(model, idx))
    assert pre.storage.data_ptr() == address and cat.nbytes == pre.nbytes


def banded_reference(model, idx, window):
    """The full forward pass with sliding-window attention: query t sees keys t-window+1..t (F.scaled_dot_product_attention)."""
    B, T = idx.shape
    t = torch.arange(T)
    band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
    tr = model.transformer
    with torch.no_grad():
        x = tr.wte(idx) + tr.wpe(t)
        for block in tr.h:
            h = block.ln_1(x)
            C = h.shape[-1]
            q, k, v = (z.view(B, T, block.attn.n_head, -1).transpose(1, 2) for z in block.attn.c_attn(h).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(tr.ln_f(x))


@pytest.mark.parametrize("window,chunks", [(8, [(0, 5), (5, 40)]), (8, [(0, 20)] + [(t, t + 1) for t in range(20, 40)]),
                                           (5, [(0, 3), (3, 12), (12, 13), (13, 40)]), (64, [(0, 40)])])
def test_sliding_window_ring_buffer_equals_full_attention_restricted_to_the_window(window, chunks):
    model = gpt(seed=8)
    idx = torch.randint(0, 103, (2, 40), generator=torch.Generator().manual_seed(9))
    cache = KVCache.for_model(model, 2, window=window)
    assert cache.capacity == min(window, model.config.block_size)
    out = torch.cat([cached_forward(model, idx[:, s:e], cache) for s, e in chunks], dim=1)
    assert_parity(out, banded_reference(model, idx, window))
    assert cache.nbytes == kv_cache_bytes(4, 128, 4, cache.capacity, batch_size=2, dtype=torch.float32)


@pytest.mark.parametrize("n_kv_head", [8, 4, 2, 1])
def test_gqa_cache_shrinks_by_h_over_h_kv_and_cached_equals_full_equals_torch_gqa(n_kv_head):
    torch.manual_seed(10)
    attn = GQASelfAttention(64, 8, n_kv_head).eval()
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(11))
    cache = KVCache(1, 2, n_kv_head, 8, 20)
    with torch.no_grad():
        full = attn(x)
        parts = []
        for s, e in ((0, 6), (6, 7), (7, 15), (15, 20)):
            parts.append(attn(x[:, s:e], cache))
            cache.advance(e - s)
        q = attn.q_proj(x).view(2, 20, 8, 8).transpose(1, 2)
        k, v = attn.kv_proj(x).view(2, 20, 2, n_kv_head, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        oracle = attn.c_proj(y.transpose(1, 2).reshape(2, 20, 64))
    assert_parity(full, oracle)
    assert_parity(torch.cat(parts, dim=1), full)
    assert cache.nbytes * 8 == KVCache(1, 2, 8, 8, 20).nbytes * n_kv_head
    assert cache.nbytes == kv_cache_bytes(1, 64, 8, 20, n_kv_head=n_kv_head, batch_size=2, dtype=torch.float32)


def test_gqa_runs_the_cached_attention_step_it_is_given_with_and_without_a_cache():
    calls = []

    def recorded_step(q, k, v, past_k, past_v):
        calls.append((q.shape[2], past_k.shape[2]))  # (T, P)
        return cached_attention_step(q, k, v, past_k, past_v)

    torch.manual_seed(10)
    attn = GQASelfAttention(64, 8, 2, cached_attention_step=recorded_step).eval()
    torch.manual_seed(10)
    reference = GQASelfAttention(64, 8, 2).eval()
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(11))
    cache = KVCache(1, 1, 2, 8, 9)
    with torch.no_grad():
        assert torch.equal(attn(x), reference(x))
        attn(x[:, :5], cache)
        cache.advance(5)
        attn(x[:, 5:], cache)
    assert calls == [(9, 0), (5, 0), (4, 5)]


def test_gqa_rejects_head_counts_that_do_not_divide():
    with pytest.raises(ValueError, match="n_kv_head must divide n_head = 8"):
        GQASelfAttention(64, 8, 3)
    with pytest.raises(ValueError, match="n_embd must be divisible by n_head"):
        GQASelfAttention(60, 8, 2)


def test_cached_attention_step_equals_sdpa_over_the_whole_sequence():
    g = torch.Generator().manual_seed(12)
    for H, H_kv, P, T in [(4, 4, 0, 5), (4, 4, 6, 1), (4, 2, 6, 3), (6, 1, 3, 4)]:
        past_k, past_v = torch.randn(2, H_kv, P, 8, generator=g), torch.randn(2, H_kv, P, 8, generator=g)
        q = torch.randn(2, H, T, 8, generator=g)
        k, v = torch.randn(2, H_kv, T, 8, generator=g), torch.randn(2, H_kv, T, 8, generator=g)
        y, keys, values = cached_attention_step(q, k, v, past_k, past_v)
        full_q = torch.cat([torch.zeros(2, H, P, 8), q], dim=2)
        expected = F.scaled_dot_product_attention(full_q, keys, values, is_causal=True, enable_gqa=True)[:, :, P:]
        assert_parity(y, expected)
        assert keys.shape == (2, H_kv, P + T, 8) and torch.equal(values[:, :, P:], v)


def test_kv_cache_bytes_matches_allocated_storage_and_gpt2_large():
    model = gpt(block_size=128)
    for B, T in [(1, 128), (3, 17)]:
        assert KVCache.for_model(model, B, T).nbytes == kv_cache_bytes(4, 128, 4, T, batch_size=B, dtype=torch.float32)
    assert kv_cache_bytes(36, 1280, 20, 1) == 2 * 36 * 1280 * 2 == 184_320
    assert kv_cache_bytes(36, 1280, 20, 1024) == 188_743_680
    assert kv_cache_bytes(36, 1280, 20, 1024, dtype=torch.float32) == 2 * 188_743_680


def test_generate_cached_equals_greedy_decoding_without_a_cache():
    model = gpt(block_size=128, seed=13)
    prompt = torch.randint(0, 103, (3, 10), generator=torch.Generator().manual_seed(14))
    assert torch.equal(generate_cached(model, prompt, 100), gpt_sample(model, prompt, 100, greedy=True))
    assert torch.equal(generate_cached(model, prompt, 1), gpt_sample(model, prompt, 1, greedy=True))


def test_clear_errors_when_the_cache_is_full_or_positions_exceed_the_context():
    model = gpt(block_size=16)
    idx = torch.randint(0, 103, (1, 20))
    cache = KVCache.for_model(model, 1, 10)
    cached_forward(model, idx[:, :8], cache)
    with pytest.raises(ValueError, match=r"the cache is full: it holds max_len = 10 tokens, 8 are cached and 3 more"):
        cached_forward(model, idx[:, :3], cache)
    assert cache.length == 8  # nothing was written
    big = KVCache.for_model(model, 1, 20)  # more room than the model has positions
    cached_forward(model, idx[:, :16], big)
    with pytest.raises(ValueError, match=r"positions must be < block_size = 16"):
        cached_forward(model, idx[:, 16:17], big)
    with pytest.raises(ValueError, match=r"positions must be < block_size = 16"):
        cached_forward(model, idx[:, 16:17], KVCache.for_model(model, 1, 20), positions=torch.tensor([[16]]))
    with pytest.raises(ValueError, match=r"attention_mask must have shape"):
        cached_forward(model, idx[:, :4], KVCache.for_model(model, 1), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"idx has batch size 1 but the cache holds 2 rows"):
        cached_forward(model, idx[:, :4], KVCache.for_model(model, 2))
    with pytest.raises(ValueError, match=r"max_len must be an integer >= 1"):
        KVCache(2, 1, 4, 8, 0)
    with pytest.raises(ValueError, match=r"window must be None or an integer >= 1"):
        KVCache(2, 1, 4, 8, 10, window=0)


def test_crop_rolls_back_and_the_next_tokens_are_computed_afresh():
    model = gpt(seed=15)
    idx = torch.randint(0, 103, (1, 30), generator=torch.Generator().manual_seed(16))
    other = torch.randint(0, 103, (1, 10), generator=torch.Generator().manual_seed(17))
    cache = KVCache.for_model(model, 1)
    cached_forward(model, idx[:, :20], cache)
    cached_forward(model, other, cache)  # a rejected continuation (speculative decoding)
    cache.crop(20)
    assert cache.length == 20
    assert_parity(cached_forward(model, idx[:, 20:30], cache), full_logits(model, idx)[:, 20:30])
    with pytest.raises(ValueError, match=r"length must be in \[0, 30\]"):
        cache.crop(31)
    ring = KVCache.for_model(model, 1, window=8)
    cached_forward(model, idx[:, :12], ring)
    with pytest.raises(ValueError, match="cannot be cropped once it has wrapped around"):
        ring.crop(10)


def test_reorder_follows_the_selected_rows():
    model = gpt(seed=18)
    idx = torch.randint(0, 103, (3, 12), generator=torch.Generator().manual_seed(19))
    cache = KVCache.for_model(model, 3, 20)
    cached_forward(model, idx[:, :8], cache)
    rows = torch.tensor([2, 0, 0, 1])  # reorder, repeat, change the batch size
    cache.reorder(rows)
    assert cache.batch_size == 4
    out = cached_forward(model, idx[rows, 8:12], cache)
    assert_parity(out, full_logits(model, idx[rows])[:, 8:12])


def test_greedy_tokens_equal_hugging_face_generate_on_the_shipped_checkpoint():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from course_lib.hf import to_hf

    model = assets.load("char-gpt")
    tokenizer = assets.tokenizer("char-gpt")
    encoded = [tokenizer.encode(p) for p in ("The while loop", "A class", "Exceptions are raised")]
    width = max(map(len, encoded))
    batch = torch.tensor([[0] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    hf = to_hf(model)
    ours = generate_cached(model, batch, 60, mask)
    theirs = hf.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=60, pad_token_id=0)
    assert torch.equal(ours, theirs)
    single = torch.tensor([encoded[0]])
    assert torch.equal(generate_cached(model, single, 80),
                       hf.generate(single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=80))
