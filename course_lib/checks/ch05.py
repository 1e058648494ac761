"""Visible checks of chapter 05 (KV cache), and the independent oracles they compare against.

Oracles: ``F.scaled_dot_product_attention`` over the whole sequence in float64 (the cached step must
give the rows of the new tokens), greedy decoding by full forward passes of the model with no cache
at all (``greedy_oracle``; for a left-padded batch ``padded_greedy_oracle``, written with
``torch.nn.functional``, which also plants the padding mistakes the check names), and cache sizes counted on tensors shaped like a real cache, allocated on
PyTorch's ``meta`` device (``kv_cache_bytes_oracle``); never course_lib's reference solutions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ch04 import randomize_gpt
from .core import assert_close, assert_shape, assert_tensor, fail, greedy_oracle, passed

__all__ = ["check_cached_attention_step", "check_generate_cached", "check_kv_cache_bytes", "check_static_kv_cache", "attention_rows_oracle",
           "kv_cache_bytes_oracle", "kv_test_model", "padded_greedy_oracle"]


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
def padded_greedy_oracle(model, idx, attention_mask, max_new_tokens: int, *, mask_padding: bool = True,
                         shift_prompt: bool = True, shift_new: bool = True):
    """Greedy decoding of a left-padded batch by full float64 forward passes (no cache), written with
    torch.nn.functional only: idx (B, T), attention_mask (B, T) 1 for real tokens -> (B, T + max_new_tokens).

    With every flag True, padding keys are masked out and each token's position is the number of real
    tokens before it: what a correct generate_cached computes. Each flag set to False plants one mistake,
    so that a check can name it: mask_padding=False lets every token attend to the padding, shift_prompt=False
    gives the prompt its slots 0..T-1 as positions, shift_new=False gives each new token its slot.
    """
    s = {name: p.detach().double() for name, p in model.named_parameters(remove_duplicate=False)}
    get, cfg = s.get, model.config
    B, T = idx.shape
    H, C = cfg.n_head, cfg.n_embd
    for _ in range(max_new_tokens):
        S = idx.shape[1]
        real = torch.cat([attention_mask.bool(), attention_mask.new_ones(B, S - T).bool()], dim=1)  # (B, S)
        counted = (real.long().cumsum(-1) - 1).clamp(min=0)  # positions that count real tokens only
        slots = torch.arange(S).expand(B, S)
        positions = torch.cat([(counted if shift_prompt else slots)[:, :T], (counted if shift_new else slots)[:, T:]], dim=1)
        keys_ok = real if mask_padding else torch.ones_like(real)
        # causal, no padding key; a padding query may see itself (its output is never used: no NaN from an empty row)
        allowed = (torch.ones(S, S, dtype=torch.bool).tril()[None] & keys_ok[:, None, :]) | torch.eye(S, dtype=torch.bool)
        x = F.embedding(idx, s["transformer.wte.weight"]) + s["transformer.wpe.weight"][positions]
        for i in range(cfg.n_layer):
            p = f"transformer.h.{i}."
            h = F.layer_norm(x, (C,), s[p + "ln_1.weight"], get(p + "ln_1.bias"), 1e-5)
            q, k, v = (t.reshape(B, S, H, C // H).transpose(1, 2)
                       for t in F.linear(h, s[p + "attn.c_attn.weight"], get(p + "attn.c_attn.bias")).split(C, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None]).transpose(1, 2).reshape(B, S, C)
            x = x + F.linear(y, s[p + "attn.c_proj.weight"], get(p + "attn.c_proj.bias"))
            h = F.layer_norm(x, (C,), s[p + "ln_2.weight"], get(p + "ln_2.bias"), 1e-5)
            h = F.gelu(F.linear(h, s[p + "mlp.c_fc.weight"], get(p + "mlp.c_fc.bias")), approximate="tanh")
            x = x + F.linear(h, s[p + "mlp.c_proj.weight"], get(p + "mlp.c_proj.bias"))
        x = F.layer_norm(x[:, -1], (C,), s["transformer.ln_f.weight"], get("transformer.ln_f.bias"), 1e-5)
        idx = torch.cat([idx, (x @ s["lm_head.weight"].T).argmax(-1, keepdim=True)], dim=1)
    return idx


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
        _name_the_wrong_attention(y, q, k, v, past_k, past_v)
        fail(f"every new token is off (by up to {error.max().item():.3g}); new token i sits at slot P + i = {P} + i and "
             "may attend to every cached slot and to slots P..P + i of the chunk. Is the causal mask offset by the "
             "P cached tokens (tril(diagonal=P))? Is the scale 1/sqrt(Dh)?")
    assert_close(y, expected.float(), "y compared with causal F.scaled_dot_product_attention over all 7 tokens (float64)")
    _check_grouped_heads(cached_attention_step, g)
    passed("cached_attention_step")


def _name_the_wrong_attention(y, q, k, v, past_k, past_v) -> None:
    """Fails naming the mistake if y (B, H, T, Dh) is float64 attention over past + new with one of two classic
    mistakes: the causal mask not offset by the P cached tokens (tril(diagonal=0) on the (T, P + T) scores), or
    the scores not scaled by 1/sqrt(Dh). Returns if y is neither."""
    P, T, Dh = past_k.shape[2], q.shape[2], q.shape[3]
    keys, values = torch.cat([past_k, k], dim=2).double(), torch.cat([past_v, v], dim=2).double()
    offset = torch.ones(T, P + T, dtype=torch.bool).tril(diagonal=P)
    mistakes = [
        (dict(attn_mask=torch.ones(T, P + T, dtype=torch.bool).tril()),
         f"your output is attention with the causal mask not offset by the {P} cached tokens (tril(diagonal=0)): new "
         f"token i sits at slot P + i and may attend to slots 0..P + i, tril(diagonal=P)"),
        (dict(attn_mask=offset, scale=1.0),
         f"your output is attention without the 1/sqrt(Dh) scale (Dh = {Dh}): divide the scores by sqrt(Dh)"),
    ]
    for wrong, message in mistakes:
        if torch.allclose(y.double(), F.scaled_dot_product_attention(q.double(), keys, values, **wrong), rtol=1e-4, atol=1e-5):
            fail(message)


def _check_grouped_heads(cached_attention_step, g) -> None:
    """4 query heads over 2 key/value heads: heads 0, 1 read key/value head 0 and heads 2, 3 head 1 (grouped)."""
    B, H, H_kv, P, T, Dh = 1, 4, 2, 3, 2, 8
    past_k, past_v = torch.randn(B, H_kv, P, Dh, generator=g), torch.randn(B, H_kv, P, Dh, generator=g)
    q = torch.randn(B, H, T, Dh, generator=g)
    k, v = torch.randn(B, H_kv, T, Dh, generator=g), torch.randn(B, H_kv, T, Dh, generator=g)
    y, keys, values = _unpack_step(cached_attention_step(q, k, v, past_k, past_v),
                                   "cached_attention_step with 4 query heads and 2 key/value heads")
    assert_shape(y, (B, H, T, Dh), "y for 4 query heads over 2 key/value heads (B, H, T, Dh) = (1, 4, 2, 8)")
    for name, got in (("keys", keys), ("values", values)):
        if isinstance(got, torch.Tensor) and got.dim() == 4 and got.shape[1] == H and H != H_kv:
            fail(f"with 4 query heads and 2 key/value heads, your returned {name} have shape {tuple(got.shape)}: "
                 f"{H} heads, repeated for the queries. Return the cache with its {H_kv} key/value heads, "
                 f"(B, H_kv, P + T, Dh) = ({B}, {H_kv}, {P + T}, {Dh}): repeat_interleave only the copy the scores "
                 "use, or the cache grows H / H_kv times and the next step repeats it again")
    assert_shape(keys, (B, H_kv, P + T, Dh), "the returned keys with 2 key/value heads (B, H_kv, P + T, Dh)")
    assert_shape(values, (B, H_kv, P + T, Dh), "the returned values with 2 key/value heads (B, H_kv, P + T, Dh)")
    assert_close(keys, torch.cat([past_k, k], dim=2), "the returned keys with 2 key/value heads (cached ones first)")
    assert_close(values, torch.cat([past_v, v], dim=2), "the returned values with 2 key/value heads (cached ones first)")
    expected = attention_rows_oracle(q, k, v, past_k, past_v)
    tile = lambda t: t.repeat(1, H // H_kv, 1, 1)  # noqa: E731 - head h reads key/value head h % H_kv
    tiled = attention_rows_oracle(q, tile(k), tile(v), tile(past_k), tile(past_v))
    if torch.allclose(y.double(), tiled, rtol=1e-4, atol=1e-5) and not torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-5):
        fail("with 4 query heads and 2 key/value heads, your query head h reads key/value head h % 2 (the heads are "
             "tiled, as .repeat does); grouped-query attention groups consecutive heads: head h reads key/value head "
             "h // (H / H_kv), as repeat_interleave does")
    assert_close(y, expected.float(), "y with 4 query heads over 2 key/value heads (grouped: head h reads h // 2)")


def check_static_kv_cache(cache_class) -> None:
    """Visible checks for chapter 05, exercise 2 (the cache alone; ``check_generate_cached`` runs them first)."""
    _check_cache(cache_class)
    passed("StaticKVCache")


def _check_cache(cache_class) -> None:
    """2 layers, 3 rows, 2 heads of size 4, room for 5 tokens, filled by a chunk of 3 tokens then 2: update must
    return exactly what was stored so far (torch.cat of the inputs) and a sixth token must raise ValueError, as must
    check_room(1) (check_room(0) must not);
    for_model sizes a cache after a small GPT, in its dtype (a float64 one)."""
    g = torch.Generator().manual_seed(505)
    cache = cache_class(2, 3, 2, 4, 5)
    if cache.length != 0:
        fail(f"a new cache should have length 0, got {cache.length!r}")
    stored = [[], []]  # per layer: the keys given so far
    for T in (3, 2):
        for layer in (0, 1):
            k, v = torch.randn(3, 2, T, 4, generator=g), torch.randn(3, 2, T, 4, generator=g)
            stored[layer].append((k, v))
            past = cache.length
            try:
                keys, values = cache.update(layer, k, v)
            except ValueError as error:
                fail(f"update of {T} tokens with {past} cached and max_len = 5 raised ValueError ({error}), "
                     f"but {past} + {T} tokens fit: the cache is full only when length + T > max_len")
            expected_k = torch.cat([kv[0] for kv in stored[layer]], dim=2)
            expected_v = torch.cat([kv[1] for kv in stored[layer]], dim=2)
            assert_tensor(keys, f"the keys update(layer={layer}, k, v) returns")
            if keys.shape != expected_k.shape:
                fail(f"update(layer={layer}, k, v) with {past} cached and {T} new tokens returned keys of shape "
                     f"{tuple(keys.shape)}, expected {tuple(expected_k.shape)} = (B, H_kv, length + T, Dh): return the "
                     "cached and the new slots only, not all max_len slots (the empty ones hold zeros, and attention "
                     "would weigh them)")
            assert_close(keys, expected_k, f"the keys update returns in layer {layer} (the cached ones first, then the new ones)")
            assert_close(values, expected_v, f"the values update returns in layer {layer} (the cached ones first, then the new ones)")
        cache.advance(T)
        if cache.length != past + T:
            fail(f"after advance({T}) with {past} cached, length should be {past + T}, got {cache.length!r}")
    try:
        cache.update(0, torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4))
    except ValueError:
        pass
    else:
        fail("a cache with max_len = 5 holding 5 tokens accepted a sixth: update should raise ValueError (the cache is full)")
    if not callable(getattr(cache, "check_room", None)):
        fail("your cache has no check_room(T) method: the contract has one, raising ValueError (the cache is full) unless "
             "T more tokens fit, length + T <= max_len (update calls it)")
    try:
        cache.check_room(0)
    except ValueError as error:
        fail(f"check_room(0) on a cache holding 5 of max_len = 5 tokens raised ValueError ({error}): no token more always fits")
    try:
        cache.check_room(1)
    except ValueError:
        pass
    else:
        fail("check_room(1) on a cache holding 5 of max_len = 5 tokens did not raise: check_room(T) raises ValueError (the "
             "cache is full) exactly when length + T > max_len")
    model = kv_test_model(seed=506, block_size=32)
    for max_len, expected in ((None, 32), (9, 9)):
        made = cache_class.for_model(model, 2, max_len)
        if (made.batch_size, made.max_len, made.length) != (2, expected, 0):
            fail(f"for_model(model, 2, {max_len}) for a GPT of block_size 32: batch_size, max_len, length are "
                 f"{(made.batch_size, made.max_len, made.length)}, expected {(2, expected, 0)}")
    made = cache_class.for_model(model.double(), 3, 5)  # a float64 GPT: its cache holds float64
    k = torch.randn(3, 2, 1, 8, generator=g, dtype=torch.float64)
    keys, _ = made.update(0, k, k)
    if keys.dtype != torch.float64 or not torch.equal(keys, k):
        fail(f"for_model on a float64 GPT made a cache that returns {keys.dtype} keys"
             f"{'' if keys.dtype == torch.float64 else ', rounded'}: the cache takes the model's dtype and device, from its "
             "weights (model.transformer.wte.weight), so that a float64 or bfloat16 model gets a cache of its own dtype")


def check_generate_cached(generate_cached, cache_class=None) -> None:
    """Visible checks for chapter 05, exercise 2: the cache class first, if given (``check_static_kv_cache``); then
    batch 1, 12 new tokens, against greedy decoding without a cache; then two left-padded prompts with an
    attention mask, each against its prompt generated alone."""
    if cache_class is not None:
        _check_cache(cache_class)
    model = kv_test_model(seed=502)
    idx = torch.randint(0, 17, (1, 6), generator=torch.Generator().manual_seed(503))
    fed = []  # token rows the model embeds, call by call: each token should be fed once
    hook = model.transformer.wte.register_forward_hook(lambda module, args, output: fed.append(args[0].numel()))
    try:
        out = generate_cached(model, idx, 12)
    finally:
        hook.remove()
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
    if sum(fed) > 6 + 12:
        fail(f"your new tokens are right, but the model embedded {sum(fed)} tokens in {len(fed)} calls (per call: "
             f"{fed[:5]}{' ...' if len(fed) > 5 else ''}) for a prompt of 6 and 12 new tokens: it re-feeds the prefix, "
             "so it does not use the cache. Prefill the prompt once (6 tokens), then feed each new token once against "
             "the same cache: 6 + 11 = 17 tokens in all")
    _check_left_padding(generate_cached, model)
    passed("generate_cached")


#: Mistakes of the left-padded path, each with the flags of padded_greedy_oracle that plant it.
PADDING_MISTAKES = [
    ("the attention mask is ignored altogether: the padding is attended to and counted in the positions "
     "(pass the mask to cached_forward, mask[:, :T] for the prefill and mask[:, :t + 1] for each decode step; "
     "cached_forward then counts the positions from it, or pass position_ids(attention_mask, ...))",
     dict(mask_padding=False, shift_prompt=False, shift_new=False)),
    ("the padding is attended to: the mask does not reach cached_forward (mask[:, :T] for the prefill, "
     "mask[:, :t + 1] for each decode step)", dict(mask_padding=False)),
    ("the positions are not shifted per row: a padded row's tokens sit at their slots, not at the count of real "
     "tokens before them (position_ids(attention_mask, 0, T, B) gives the prompt's; each new token is one more "
     "than its row's previous one)", dict(shift_prompt=False, shift_new=False)),
    ("the prompt's positions are right, but the new tokens' are their slots, not one more than their row's "
     "previous position (start from positions[:, -1:] + 1, a (B, 1) tensor, and add 1 per step)", dict(shift_new=False)),
]


def _check_left_padding(generate_cached, model) -> None:
    """Two prompts, of 3 and 7 tokens, left-padded to 7 with an attention mask: each row must generate what its
    prompt generates alone (greedy decoding without a cache); a padded row that does not gets its mistake named."""
    g = torch.Generator().manual_seed(504)
    prompts = [torch.randint(0, 17, (1, n), generator=g) for n in (3, 7)]
    batch = torch.full((2, 7), 1, dtype=torch.long)  # padding token 1
    mask = torch.zeros(2, 7, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, 7 - prompt.shape[1]:], mask[row, 7 - prompt.shape[1]:] = prompt[0], 1
    out = generate_cached(model, batch, 8, mask)
    assert_tensor(out, "generate_cached(model, batch, 8, attention_mask) for 2 left-padded prompts")
    assert_shape(out, (2, 15), "the output for 2 left-padded prompts of width 7 and 8 new tokens")
    if not torch.equal(out[:, :7], batch):
        fail("the first 7 columns of the output should be the left-padded prompts themselves")
    for row, prompt in enumerate(prompts):
        alone = greedy_oracle(model, prompt, 8)[0, prompt.shape[1]:]
        if torch.equal(out[row, 7:], alone):
            continue
        where = (f"row {row} (a prompt of {prompt.shape[1]} tokens after {7 - prompt.shape[1]} padding tokens) generates "
                 f"{out[row, 7:].tolist()}, but the same prompt alone generates {alone.tolist()}")
        for mistake, flags in PADDING_MISTAKES:
            if torch.equal(out[row], padded_greedy_oracle(model, batch, mask, 8, **flags)[row]):
                fail(f"{where}: {mistake}")
        fail(f"{where}. A padded row must see exactly what its prompt alone sees: padding keys masked out, and "
             "positions that count only real tokens (position_ids), advancing by one per new token.")


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
        dtype = kwargs["dtype"]
        if got != expected and dtype != torch.float16 and kv_cache_bytes(*args, **{**kwargs, "dtype": torch.float16}) == got:
            fail(f"for {name}: you computed {got:,} bytes, the cache holds {expected:,}; with dtype=torch.float16 you "
                 f"compute the same {got:,}: the bytes per element come from dtype ({str(dtype).removeprefix('torch.')}: "
                 f"{torch.empty((), dtype=dtype).element_size()}, float16: 2), torch.empty((), dtype=dtype).element_size()")
        if got != expected:
            fail(f"for {name}: you computed {got:,} bytes, the cache holds {expected:,} (ratio {got / expected:.4g}; "
                 "a key AND a value per token, layer and key/value head, each of head size n_embd // n_head)")
    passed("kv_cache_bytes")
