"""Chapter 05's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import checks
from course_lib.attention import masked_softmax
from course_lib.kv_cache import KVCache, StaticKVCache, cached_attention_step, cached_forward, generate_cached, kv_cache_bytes, position_ids
from tests.helpers import mutant


def step_without_mask(q, k, v, past_k, past_v):
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ values, keys, values


def step_unscaled(q, k, v, past_k, past_v):
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    P, T = past_k.shape[2], q.shape[2]
    allowed = torch.ones(T, P + T, dtype=torch.bool).tril(diagonal=P)
    return masked_softmax(q @ keys.transpose(-2, -1), allowed) @ values, keys, values


def step_mask_not_offset(q, k, v, past_k, past_v):
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    P, T = past_k.shape[2], q.shape[2]
    allowed = torch.ones(T, P + T, dtype=torch.bool).tril()  # new token i sees slots 0..i, not 0..P + i
    return masked_softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]), allowed) @ values, keys, values


def step_new_first(q, k, v, past_k, past_v):
    y, _, _ = cached_attention_step(q, k, v, past_k, past_v)
    return y, torch.cat([k, past_k], dim=2), torch.cat([v, past_v], dim=2)


def step_returns_repeated_cache(q, k, v, past_k, past_v):
    y, keys, values = cached_attention_step(q, k, v, past_k, past_v)
    group = q.shape[1] // keys.shape[1]
    return y, keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # H heads, not H_kv


@torch.inference_mode()
def generate_reprefilling(model, idx, max_new_tokens, attention_mask=None):
    """Right tokens, no cache use: every step runs the whole prefix through a fresh cache."""
    B, T = idx.shape
    mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask.new_ones(B, max_new_tokens)], 1)
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)
    for t in range(T, T + max_new_tokens):
        logits = cached_forward(model, out[:, :t], KVCache.for_model(model, B, t), None if mask is None else mask[:, :t])
        out[:, t] = logits[:, -1].argmax(-1)
    return out


@torch.inference_mode()
def generate_twice(model, idx, max_new_tokens, attention_mask=None):
    cache = KVCache.for_model(model, idx.shape[0], idx.shape[1] + max_new_tokens + 1)
    cached_forward(model, idx, cache)
    token, out = idx[:, -1:], idx
    for _ in range(max_new_tokens):
        token = cached_forward(model, token, cache)[:, -1:].argmax(-1)  # the last prompt token fed again first
        out = torch.cat([out, token], dim=1)
    return out


@torch.inference_mode()
def generate_position_zero(model, idx, max_new_tokens, attention_mask=None):
    B, T = idx.shape
    cache = KVCache.for_model(model, B, T + max_new_tokens)
    logits = cached_forward(model, idx, cache)
    out = idx
    for _ in range(max_new_tokens):
        token = logits[:, -1:].argmax(-1)
        out = torch.cat([out, token], dim=1)
        logits = cached_forward(model, token, cache, positions=torch.zeros(B, 1, dtype=torch.long))  # never advanced
    return out


def generate_planted(*replacements):
    """The reference generate_cached with one planted mistake (source replacements), for the left-padded path."""
    from course_lib import kv_cache

    return mutant(kv_cache.generate_cached, *replacements)


PREFILL = "logits = cached_forward(model, idx, cache, None if mask is None else mask[:, :T], positions)  # prefill"
DECODE = "logits = cached_forward(model, out[:, t:t + 1], cache, None if mask is None else mask[:, :t + 1], position)"
PROMPT_POSITIONS = "positions = position_ids(attention_mask, 0, T, B, idx.device)"
MASK_IGNORED = generate_planted((PREFILL, "logits = cached_forward(model, idx, cache)"),
                                (DECODE, "logits = cached_forward(model, out[:, t:t + 1], cache)"))
PADDING_ATTENDED = generate_planted((PREFILL, PREFILL.replace("None if mask is None else mask[:, :T]", "None")),
                                    (DECODE, DECODE.replace("None if mask is None else mask[:, :t + 1]", "None")))
POSITIONS_NOT_SHIFTED = generate_planted((PROMPT_POSITIONS, "positions = position_ids(None, 0, T, B, idx.device)"))
NEW_TOKENS_AT_THEIR_SLOTS = generate_planted((DECODE, DECODE.replace(", position)", ", torch.full_like(position, t))")))

class CacheUnsliced(StaticKVCache):  # returns every max_len slot, the empty ones too
    def update(self, layer, k, v):
        super().update(layer, k, v)
        return self.storage[layer, 0], self.storage[layer, 1]


class CacheFullTooEarly(StaticKVCache):  # full already at length + T == max_len
    def update(self, layer, k, v):
        if self.length + k.shape[2] >= self.max_len:
            raise ValueError("the cache is full")
        return super().update(layer, k, v)


class CacheNeverFull(StaticKVCache):  # silently drops what does not fit
    def check_room(self, T):
        pass


class CacheCheckRoomSilent(StaticKVCache):  # update checks by itself; check_room, in the contract, never refuses
    def check_room(self, T):
        pass

    def update(self, layer, k, v):
        if self.length + k.shape[2] > self.max_len:
            raise ValueError("the cache is full")
        return super().update(layer, k, v)


class CacheAlwaysFloat32(StaticKVCache):  # issue 41: for_model ignores the model's dtype
    @classmethod
    def for_model(cls, model, batch_size, max_len=None, **options):
        c = model.config
        return cls(c.n_layer, batch_size, c.n_head, c.n_embd // c.n_head, c.block_size if max_len is None else max_len, **options)


class CacheNotAdvanced(StaticKVCache):
    def advance(self, T):
        pass


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_cached_attention_step, step_without_mask,
     r"the last new token is right, but tokens 0 and 1 of the chunk are off by up to \d.*causal mask missing"),
    (checks.check_cached_attention_step, step_unscaled, r"^your output is attention without the 1/sqrt\(Dh\) scale \(Dh = 8\)"),
    (checks.check_cached_attention_step, step_mask_not_offset,
     r"^your output is attention with the causal mask not offset by the 4 cached tokens \(tril\(diagonal=0\)\)"),
    (checks.check_cached_attention_step, lambda q, k, v, pk, pv: (cached_attention_step(q, k, v, pk, pv)[0] * 1.1,
                                                                  *cached_attention_step(q, k, v, pk, pv)[1:]),
     r"every new token is off .*offset by the P cached tokens"),
    (checks.check_cached_attention_step, step_new_first, r"the returned keys \(the cached ones first"),
    (checks.check_cached_attention_step, step_returns_repeated_cache,
     r"your returned keys have shape \(1, 4, 5, 8\): 4 heads, repeated for the queries. Return the cache with its 2"),
    (checks.check_static_kv_cache, CacheUnsliced, r"^update\(layer=0, k, v\) with 0 cached and 3 new tokens returned keys of "
     r"shape \(3, 2, 5, 4\), expected \(3, 2, 3, 4\) = \(B, H_kv, length \+ T, Dh\): return the cached and the new slots only"),
    (checks.check_static_kv_cache, CacheFullTooEarly, r"update of 2 tokens with 3 cached and max_len = 5 raised ValueError"),
    (checks.check_static_kv_cache, CacheNeverFull, r"holding 5 tokens accepted a sixth"),
    (checks.check_static_kv_cache, CacheCheckRoomSilent, r"check_room\(1\) on a cache holding 5 of max_len = 5 tokens did not raise"),
    (checks.check_static_kv_cache, CacheAlwaysFloat32, r"^for_model on a float64 GPT made a cache that returns torch.float32 keys, "
     r"rounded: the cache takes the model's dtype and device"),
    (checks.check_static_kv_cache, CacheNotAdvanced, r"after advance\(3\) with 0 cached, length should be 3, got 0"),
    (checks.check_generate_cached, generate_reprefilling, r"the model embedded \d+ tokens .*re-feeds the prefix, so it "
     r"does not use the cache"),
    (checks.check_cached_attention_step, lambda q, k, v, pk, pv: cached_attention_step(q, k, v, pk, pv)[0],
     r"should return a tuple \(y, keys, values\)"),
    (checks.check_generate_cached, generate_twice, r"(first new token is \d+|agree with greedy decoding without a cache for \d+ step)"),
    (checks.check_generate_cached, generate_position_zero, r"agree with greedy decoding without a cache for \d+ step\(s\), then differ.*positions advance"),
    (checks.check_generate_cached, lambda model, idx, n, attention_mask=None: generate_cached(model, idx, n)[:, 1:],
     r"has shape \(1, 17\), expected \(1, 18\)"),
    (checks.check_generate_cached, MASK_IGNORED, r"row 0 \(a prompt of 3 tokens after 4 padding tokens\) generates .*, "
     r"but the same prompt alone generates .*: the attention mask is ignored altogether"),
    (checks.check_generate_cached, PADDING_ATTENDED, r"row 0 .*: the padding is attended to: the mask does not reach cached_forward"),
    (checks.check_generate_cached, POSITIONS_NOT_SHIFTED, r"row 0 .*: the positions are not shifted per row"),
    (checks.check_generate_cached, NEW_TOKENS_AT_THEIR_SLOTS, r"row 0 .*: the prompt's positions are right, but the new tokens' are their slots"),
    (checks.check_generate_cached, lambda model, idx, n, attention_mask=None: generate_cached(model, idx, n, attention_mask)
        if attention_mask is None else generate_cached(model, idx.flip(0), n, attention_mask.flip(0)),
     r"the first 7 columns of the output should be the left-padded prompts themselves"),
    (checks.check_kv_cache_bytes, lambda L, C, H, T, n_kv_head=None, batch_size=1, dtype=torch.float16:
        kv_cache_bytes(L, C, H, T, n_kv_head=n_kv_head, batch_size=batch_size, dtype=dtype) // 2,
     r"you computed 262,144 bytes, the cache holds 524,288 \(ratio 0.5;"),
    (checks.check_kv_cache_bytes, lambda L, C, H, T, n_kv_head=None, batch_size=1, dtype=torch.float16:
        kv_cache_bytes(L, C, H, T, batch_size=batch_size, dtype=dtype),
     r"a GQA model .*you computed 16,777,216 bytes, the cache holds 4,194,304 \(ratio 4;"),
    (checks.check_kv_cache_bytes, lambda L, C, H, T, n_kv_head=None, batch_size=1, dtype=torch.float16:
        kv_cache_bytes(L, C, H, T, n_kv_head=n_kv_head, batch_size=batch_size),  # the dtype ignored: always 2 bytes
     r"the course model .*you computed 262,144 bytes, the cache holds 524,288; with dtype=torch.float16 you compute the "
     r"same 262,144: the bytes per element come from dtype \(float32: 4, float16: 2\)"),
    (checks.check_kv_cache_bytes, lambda *a, **k: float(kv_cache_bytes(*a, **k)), r"should return an int \(bytes\), got float"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_the_padded_oracle_is_greedy_decoding_of_each_prompt_alone_and_each_flag_plants_its_mistake():
    model = checks.kv_test_model(seed=502)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 17, (1, n), generator=g) for n in (2, 5, 6)]
    batch, mask = torch.ones(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, 6 - prompt.shape[1]:], mask[row, 6 - prompt.shape[1]:] = prompt[0], 1
    out = checks.padded_greedy_oracle(model, batch, mask, 6)
    for row, prompt in enumerate(prompts):
        assert torch.equal(out[row, 6:], checks.greedy_oracle(model, prompt, 6)[0, prompt.shape[1]:])
    assert torch.equal(out, generate_cached(model, batch, 6, mask))
    for flags, planted in ((dict(mask_padding=False), PADDING_ATTENDED), (dict(shift_prompt=False, shift_new=False), POSITIONS_NOT_SHIFTED),
                           (dict(shift_new=False), NEW_TOKENS_AT_THEIR_SLOTS),
                           (dict(mask_padding=False, shift_prompt=False, shift_new=False), MASK_IGNORED)):
        assert torch.equal(checks.padded_greedy_oracle(model, batch, mask, 6, **flags), planted(model, batch, 6, mask))


def test_the_oracles_are_independent_of_the_reference():
    assert checks.kv_cache_bytes_oracle(36, 1280, 20, 1024) == 188_743_680
    model = checks.kv_test_model(seed=0)
    idx = torch.randint(0, 17, (2, 4), generator=torch.Generator().manual_seed(0))
    out = checks.greedy_oracle(model, idx, 3)
    with torch.no_grad():
        assert torch.equal(out[:, 4], model(idx)[0][:, -1].argmax(-1))
    assert position_ids(None, 3, 2, 1).tolist() == [[3, 4]]
