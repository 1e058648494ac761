"""course_lib.gpt against independent oracles: PyTorch's nn.MultiheadAttention and SDPA, float64 formulas, counting."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.gpt import (GPT, IGNORE_INDEX, CausalSelfAttention, GPTConfig, attention_maps, count_parameters, estimate_loss,
                            gpt_layers, gpt_logits, gpt_param_count, gpt_sample, greedy_choice, qkv_heads,
                            sample_choice, text_nats)
from course_lib.decoding import apply_temperature
from tests.helpers import assert_parity


def small_config(**overrides) -> GPTConfig:
    sizes = dict(vocab_size=17, block_size=12, n_layer=2, n_head=4, n_embd=16)
    return GPTConfig(**{**sizes, **overrides})


def randomized(module, seed=0, scale=0.2):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "ln" in name and name.endswith("weight") else 0.0))
    return module.eval()


@pytest.mark.parametrize("field,value", [("vocab_size", 0), ("block_size", -1), ("n_layer", 0), ("n_head", 0), ("n_embd", 0)])
def test_config_rejects_sizes_below_one(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1"):
        small_config(**{field: value})


def test_config_rejects_indivisible_heads_and_bad_dropout():
    with pytest.raises(ValueError, match="n_embd must be divisible by n_head"):
        small_config(n_embd=18, n_head=4)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        small_config(dropout=1.0)


@pytest.mark.parametrize("n_head,bias", [(1, True), (4, True), (8, False)])
def test_causal_self_attention_matches_nn_multihead_attention_with_a_causal_mask(n_head, bias, generator):
    config = small_config(n_head=n_head, n_embd=32, bias=bias)
    attn = randomized(CausalSelfAttention(config), seed=n_head)
    oracle = nn.MultiheadAttention(32, n_head, bias=bias, batch_first=True)
    with torch.no_grad():
        oracle.in_proj_weight.copy_(attn.c_attn.weight)
        oracle.out_proj.weight.copy_(attn.c_proj.weight)
        if bias:
            oracle.in_proj_bias.copy_(attn.c_attn.bias)
            oracle.out_proj.bias.copy_(attn.c_proj.bias)
    x = torch.randn(3, 7, 32, generator=generator)
    blocked = torch.ones(7, 7, dtype=torch.bool).triu(1)  # nn.MultiheadAttention: True = may NOT attend
    expected, _ = oracle.train()(x, x, x, attn_mask=blocked, need_weights=False)  # train(): the plain (slow) path
    with torch.no_grad():
        assert_parity(attn(x), expected.detach())


def test_causal_self_attention_equals_sdpa_is_causal(generator):
    attn = randomized(CausalSelfAttention(small_config()), seed=3)
    x = torch.randn(2, 9, 16, generator=generator)
    q, k, v = (t.view(2, 9, 4, 4).transpose(1, 2) for t in F.linear(x, attn.c_attn.weight, attn.c_attn.bias).split(16, -1))
    y = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True).transpose(1, 2).reshape(2, 9, 16)
    with torch.no_grad():
        assert_parity(attn(x), F.linear(y, attn.c_proj.weight.double(), attn.c_proj.bias.double()))


def functional_gpt(model: GPT, idx):
    """Float64 oracle with F.* only (independent of the modules' forward methods)."""
    s = {k: v.double() for k, v in model.state_dict().items()}
    c = model.config
    B, T = idx.shape
    x = s["transformer.wte.weight"][idx] + s["transformer.wpe.weight"][:T]
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (c.n_embd,), s[p + "ln_1.weight"], s[p + "ln_1.bias"])
        q, k, v = (t.view(B, T, c.n_head, -1).transpose(1, 2)
                   for t in F.linear(h, s[p + "attn.c_attn.weight"], s[p + "attn.c_attn.bias"]).split(c.n_embd, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c.n_embd // c.n_head)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, c.n_embd)
        x = x + F.linear(y, s[p + "attn.c_proj.weight"], s[p + "attn.c_proj.bias"])
        h = F.layer_norm(x, (c.n_embd,), s[p + "ln_2.weight"], s[p + "ln_2.bias"])
        u = F.linear(h, s[p + "mlp.c_fc.weight"], s[p + "mlp.c_fc.bias"])
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))  # GPT-2's gelu_new, written out
        x = x + F.linear(u, s[p + "mlp.c_proj.weight"], s[p + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (c.n_embd,), s["transformer.ln_f.weight"], s["transformer.ln_f.bias"])
    return x @ s["transformer.wte.weight"].T


@pytest.mark.parametrize("T", [1, 5, 12])
def test_gpt_logits_match_a_float64_functional_oracle(T, generator):
    model = randomized(GPT(small_config()), seed=T)
    idx = torch.randint(0, 17, (3, T), generator=generator)
    with torch.no_grad():
        logits, loss = model(idx)
    assert loss is None
    assert_parity(logits, functional_gpt(model, idx))


def test_gpt_loss_is_mean_cross_entropy_over_non_padding_targets(generator):
    model = randomized(GPT(small_config()), seed=1)
    idx, targets = torch.randint(0, 17, (3, 10), generator=generator), torch.randint(0, 17, (3, 10), generator=generator)
    with torch.no_grad():
        logits, loss = model(idx, targets)
    assert_parity(loss, F.cross_entropy(logits.double().reshape(-1, 17), targets.reshape(-1)))
    targets[1, 4:] = -100
    with torch.no_grad():
        _, padded = model(idx, targets)
    keep = targets != -100
    per_token = -torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    assert_parity(padded, per_token[keep].mean())


def test_the_padding_target_is_pytorchs_ignore_index():
    """IGNORE_INDEX, which Llama's loss and chapter 04's check use, is the -100 GPT.forward writes out: PyTorch's default."""
    import inspect

    assert IGNORE_INDEX == inspect.signature(F.cross_entropy).parameters["ignore_index"].default == -100


def test_gpt_is_causal_end_to_end(generator):
    model = randomized(GPT(small_config()), seed=2)
    idx = torch.randint(0, 17, (2, 12), generator=generator)
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 17
    with torch.no_grad():
        assert torch.equal(model(idx)[0][:, :7], model(changed)[0][:, :7])
        assert not torch.allclose(model(idx)[0][:, 7:], model(changed)[0][:, 7:])


def test_gpt_layers_with_an_attend_hook_runs_the_blocks_as_they_are(generator):
    # gpt_layers spells out GPTBlock.forward's two residual steps around attend: with attend = the module itself,
    # it must equal the blocks called as they are, bit for bit
    model = GPT(small_config()).eval()
    x = torch.randn(2, 5, 16, generator=generator)
    with torch.no_grad():
        by_blocks = model.transformer.ln_f(functools.reduce(lambda h, block: block(h), model.transformer.h, x))
        assert torch.equal(gpt_layers(model, x), by_blocks)
        assert torch.equal(gpt_layers(model, x, lambda layer, attn, h: attn(h)), by_blocks)


def test_gpt_rejects_sequences_longer_than_block_size():
    with pytest.raises(ValueError, match="sequence length must be <= block_size = 12, got 13"):
        GPT(small_config())(torch.zeros(1, 13, dtype=torch.long))


def test_weight_tying_is_one_parameter_through_training_and_state_dict(generator):
    model = GPT(small_config())
    assert model.lm_head.weight is model.transformer.wte.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randint(0, 17, (2, 6), generator=generator), torch.randint(0, 17, (2, 6), generator=generator))[1].backward()
    optimizer.step()
    assert model.lm_head.weight is model.transformer.wte.weight
    clone = GPT(small_config())
    clone.load_state_dict(model.state_dict())
    assert clone.lm_head.weight is clone.transformer.wte.weight
    assert torch.equal(clone.lm_head.weight, model.transformer.wte.weight)


def test_gpt2_initialisation():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=64, n_layer=8, n_head=4, n_embd=128)
    model = GPT(config)
    residual = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")])
    others = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight"))])
    assert abs(residual.std().item() - 0.02 / math.sqrt(16)) < 2e-4
    assert abs(others.std().item() - 0.02) < 2e-4
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        if ".ln_" in name and name.endswith("weight"):
            assert torch.equal(p, torch.ones_like(p)), name


@pytest.mark.parametrize("sizes", [dict(vocab_size=103, block_size=128, n_layer=4, n_head=4, n_embd=128),
                                   dict(vocab_size=7, block_size=3, n_layer=1, n_head=1, n_embd=4),
                                   dict(vocab_size=50257, block_size=256, n_layer=6, n_head=6, n_embd=384)])
@pytest.mark.parametrize("bias", [True, False])
def test_param_count_formula_equals_counting(sizes, bias):
    config = GPTConfig(**sizes, bias=bias)
    with torch.device("meta"):
        model = GPT(config)
    assert gpt_param_count(config) == count_parameters(model)
    untied = sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))  # the shared matrix twice
    assert gpt_param_count(config, tied=False) == untied


def test_param_count_of_gpt2_small_and_the_6x384_example():
    # GPT-2 small: wte 50257*768 + wpe 1024*768 + 12*(12*768^2 + 13*768) + 2*768
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert gpt_param_count(gpt2) == 50257 * 768 + 1024 * 768 + 12 * (12 * 768 ** 2 + 13 * 768) + 2 * 768 == 124_439_808
    example = GPTConfig(vocab_size=50257, block_size=256, n_layer=6, n_head=6, n_embd=384)
    assert gpt_param_count(example) == 50257 * 384 + 256 * 384 + 6 * (12 * 384 ** 2 + 13 * 384) + 2 * 384 == 30_044_544


def test_gpt_sample_greedy_is_argmax_and_crops_the_context(generator):
    model = randomized(GPT(small_config(block_size=6)), seed=5)
    prompt = torch.randint(0, 17, (2, 4), generator=generator)
    out = gpt_sample(model, prompt, 5, greedy=True)
    assert out.shape == (2, 9) and torch.equal(out[:, :4], prompt)
    with torch.no_grad():
        for t in range(4, 9):
            context = out[:, max(0, t - 6):t]
            assert torch.equal(out[:, t], model(context)[0][:, -1].argmax(-1))


def test_gpt_sample_is_reproducible_with_a_generator_and_validates(generator):
    model = randomized(GPT(small_config()), seed=6)
    prompt = torch.randint(0, 17, (1, 3), generator=generator)
    a = gpt_sample(model, prompt, 8, temperature=0.7, generator=torch.Generator().manual_seed(1))
    b = gpt_sample(model, prompt, 8, temperature=0.7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    with torch.no_grad():  # the first token: one multinomial draw from softmax(logits / 0.7), by hand
        probs = torch.softmax(model(prompt)[0][:, -1] / 0.7, -1)
    first = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[:, 3:4], first)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        gpt_sample(model, prompt, -1)


def test_gpt_sample_checks_temperature_by_chapter_06s_processor_only(generator):
    """One check of the temperature's range, apply_temperature's: the same ValueError, greedy or not (a second check
    in gpt_sample, with its own range or words, fails), and temperature 0 is the processor's greedy limit."""
    model = randomized(GPT(small_config()), seed=6)
    prompt = torch.randint(0, 17, (1, 3), generator=generator)
    with pytest.raises(ValueError, match=r"temperature must be >= 0") as processor:
        apply_temperature(torch.zeros(1, 17), -0.5)
    for greedy in (False, True):
        with pytest.raises(ValueError) as ours:
            gpt_sample(model, prompt, 1, temperature=-0.5, greedy=greedy)
        assert str(ours.value) == str(processor.value)
    assert torch.equal(gpt_sample(model, prompt, 8, temperature=0.0), gpt_sample(model, prompt, 8, greedy=True))


def test_attention_maps_are_causal_distributions_equal_to_sdpa_weights(generator):
    model = randomized(GPT(small_config()), seed=7)
    idx = torch.randint(0, 17, (2, 9), generator=generator)
    maps = attention_maps(model, idx)
    assert maps.shape == (2, 2, 4, 9, 9)
    assert_parity(maps.sum(-1), torch.ones(2, 2, 4, 9))
    assert torch.equal(maps.masked_fill(torch.ones(9, 9, dtype=torch.bool).tril(), 0), torch.zeros_like(maps))
    # layer 0's weights from the embedding, recomputed with float64 formulas
    with torch.no_grad():
        x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(9))
        h = model.transformer.h[0].ln_1(x).double()
        q, k, _ = (t.view(2, 9, 4, 4).transpose(1, 2) for t in F.linear(h, model.transformer.h[0].attn.c_attn.weight.double(),
                                                                         model.transformer.h[0].attn.c_attn.bias.double()).split(16, -1))
        scores = (q @ k.transpose(-2, -1) / 2).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -math.inf)
    assert_parity(maps[0], scores.softmax(-1))


def test_estimate_loss_is_the_mean_over_batches_and_restores_the_mode(generator):
    model = randomized(GPT(small_config()), seed=8).train()
    batches = [(torch.randint(0, 17, (2, 5), generator=generator), torch.randint(0, 17, (2, 5), generator=generator)) for _ in range(3)]
    with torch.no_grad():
        expected = sum(model.eval()(x, y)[1].item() for x, y in batches) / 3
    model.train()
    assert abs(estimate_loss(model, batches) - expected) < 1e-6
    assert model.training


def test_extend_feeds_the_prompt_once_then_each_chosen_token_and_never_the_last():
    """The one autoregressive loop: a counting "model" whose next token is the newest one + 1 (mod 10)."""
    from course_lib.gpt import extend

    seen = []

    def next_logits(tokens, new):
        seen.append((tokens.shape[1], new.tolist()))
        return torch.nn.functional.one_hot((new[:, -1] + 1) % 10, 10).float()

    out = extend(torch.tensor([[3, 4], [8, 9]]), 3, next_logits, greedy_choice)
    assert out.tolist() == [[3, 4, 5, 6, 7], [8, 9, 0, 1, 2]]
    assert seen == [(2, [[3, 4], [8, 9]]), (3, [[5], [0]]), (4, [[6], [1]])]
    assert extend(torch.tensor([[1]]), 0, next_logits, greedy_choice).tolist() == [[1]] and len(seen) == 3
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        extend(torch.tensor([[1]]), -1, next_logits, greedy_choice)
    # done(tokens) is asked after each step, with every token so far: True ends the loop there
    asked = []
    out = extend(torch.tensor([[3]]), 5, next_logits, greedy_choice, lambda tokens: asked.append(tokens.tolist()) or
                 tokens[0, -1].item() == 5)
    assert out.tolist() == [[3, 4, 5]] and asked == [[[3, 4]], [[3, 4, 5]]]


def test_sample_choice_draws_from_the_softmax_with_its_generator():
    """The one sampler: the frequencies of 20,000 draws are softmax(logits) (a float64 formula) to within 4 standard
    errors; a seeded generator gives the same draws, and a token of probability 0 is never drawn."""
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]]).repeat(20_000, 1)
    draws = sample_choice(logits, torch.Generator().manual_seed(0))
    assert draws.shape == (20_000, 1) and torch.equal(draws, sample_choice(logits, torch.Generator().manual_seed(0)))
    expected = torch.softmax(logits[0].double(), dim=-1)
    frequencies = torch.bincount(draws.view(-1), minlength=4).double() / 20_000
    assert frequencies[3] == 0
    assert ((frequencies - expected).abs() <= 4 * (expected * (1 - expected) / 20_000).sqrt() + 1e-12).all(), frequencies


def test_gpt_logits_and_qkv_heads_are_gpt_forward_and_its_attention(generator):
    """gpt_logits is GPT.forward's logits bit for bit (all positions, the last alone, some rows alone, positions given), and
    within rounding for one row without its batch dimension; qkv_heads is the
    split CausalSelfAttention.forward computes: with it, F.scaled_dot_product_attention gives the module's output."""
    model = GPT(small_config()).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 7), generator=generator)
    with torch.no_grad():
        logits, _ = model(idx)
        assert torch.equal(gpt_logits(model, idx), logits)
        torch.testing.assert_close(gpt_logits(model, idx, at=-1), logits[:, -1], rtol=0, atol=1e-6)
        rows = torch.tensor([6, 0, 3])
        torch.testing.assert_close(gpt_logits(model, idx, at=rows), logits[:, rows], rtol=0, atol=1e-6)
        assert torch.equal(gpt_logits(model, idx, torch.arange(7).expand(2, 7)), logits)
        # one row without its batch dimension, with an attend that takes (T, C) (chapter 12's paged forward): (T,) -> (T, V),
        # `at` indexing its T positions
        unbatched = lambda layer, attn, h: attn(h[None])[0]  # noqa: E731 - the module's own attention on the row
        torch.testing.assert_close(gpt_logits(model, idx[1], attend=unbatched), logits[1], rtol=0, atol=1e-6)
        torch.testing.assert_close(gpt_logits(model, idx[1], attend=unbatched, at=-1), logits[1, -1], rtol=0, atol=1e-6)
        torch.testing.assert_close(gpt_logits(model, idx[1], attend=unbatched, at=rows), logits[1, rows], rtol=0, atol=1e-6)
        attn = model.transformer.h[0].attn
        x = torch.randn(2, 7, model.config.n_embd, generator=generator)
        q, k, v = qkv_heads(attn, x)
        assert q.shape == k.shape == v.shape == (2, model.config.n_head, 7, model.config.n_embd // model.config.n_head)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(attn.c_proj(y.transpose(1, 2).reshape(2, 7, -1)), attn(x), rtol=1e-5, atol=1e-6)


def test_text_nats_equals_one_forward_pass_per_token():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=7, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    ids = torch.randint(0, 7, (30,), generator=torch.Generator().manual_seed(1))
    for stride, first in ((1, 1), (4, 1), (7, 5), (3, 29), (5, 2)):
        starts = list(range(0, 30 - 8 + 1, stride))
        starts += [30 - 8] if starts[-1] != 30 - 8 else []  # the last window ends at the text's end
        expected = 0.0
        with torch.no_grad():
            for t in range(first, 30):
                start = next(s for s in starts if s < t < s + 8)  # the first window holding t past its first token
                context = ids[start:t]
                expected -= torch.log_softmax(model(context.view(1, -1))[0][0, -1].double(), -1)[ids[t]].item()
        assert text_nats(model, ids, first=first, stride=stride, batch_size=3) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="stride must be in"):
        text_nats(model, ids, stride=8)
    with pytest.raises(ValueError, match="first must be in"):
        text_nats(model, ids, first=0)
