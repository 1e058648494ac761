"""course_lib.hf: our GPT and Hugging Face's GPT2LMHeadModel are the same function, both ways (nothing downloaded)."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere

import pytest
import torch

from course_lib.gpt import GPT, GPTConfig, count_parameters, gpt_param_count, gpt_sample
from course_lib.hf import from_hf, hf_config, to_hf
from tests.helpers import assert_parity

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def randomized(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "ln" in name and name.endswith("weight") else 0.0))
    return model.eval()


CONFIG = GPTConfig(vocab_size=31, block_size=24, n_layer=3, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def pair():
    ours = randomized(GPT(CONFIG), seed=0)
    return ours, to_hf(ours)


def test_to_hf_draws_no_random_initialisation_and_holds_every_tensor_of_ours(pair):
    """Every tensor of the converted model is copied from ours, so to_hf builds it uninitialised: torch's global random
    state is left as it was (drawing GPT-2's initialisation first took 6 s of chapter 08's run as on another CPU)."""
    ours, _ = pair
    state = torch.get_rng_state()
    theirs = to_hf(ours)
    assert torch.equal(torch.get_rng_state(), state)
    converted = from_hf(theirs).state_dict()
    assert all(torch.equal(converted[name], value) for name, value in ours.state_dict().items())
    assert theirs.lm_head.weight is theirs.transformer.wte.weight


def test_to_hf_logits_match_and_parameter_counts_agree(pair, generator):
    ours, theirs = pair
    idx = torch.randint(0, 31, (3, 24), generator=generator)
    with torch.no_grad():
        assert_parity(theirs(idx).logits, ours(idx)[0])
    assert count_parameters(ours) == theirs.num_parameters() == gpt_param_count(CONFIG)
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()
    assert tuple(theirs.transformer.h[0].attn.c_attn.weight.shape) == (32, 96)  # Conv1D: (in, out)


def test_hf_loss_with_labels_matches_our_loss_on_shifted_targets(pair, generator):
    ours, theirs = pair
    idx = torch.randint(0, 31, (2, 20), generator=generator)
    with torch.no_grad():
        hf_loss = theirs(idx, labels=idx).loss  # Hugging Face shifts the labels inside
        _, our_loss = ours(idx[:, :-1], idx[:, 1:])  # we shift once, in the data
    assert_parity(our_loss, hf_loss)


def test_greedy_tokens_equal_hf_generate(pair, generator):
    ours, theirs = pair
    prompt = torch.randint(0, 31, (2, 4), generator=generator)
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20)
    assert torch.equal(gpt_sample(ours, prompt, 20, greedy=True), expected)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_pytorch_tanh"])
def test_from_hf_of_a_random_hf_model_matches(activation, generator):
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=24, n_layer=2, n_head=3, activation_function=activation)).eval()
    ours = from_hf(hf_model)
    idx = torch.randint(0, 40, (2, 16), generator=generator)
    with torch.no_grad():
        assert_parity(ours(idx)[0], hf_model(idx).logits)
    assert count_parameters(ours) == hf_model.num_parameters()
    assert ours.config == GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=3, n_embd=24)


def test_round_trip_preserves_every_tensor(pair):
    ours, theirs = pair
    back = from_hf(theirs)
    for name, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert back.lm_head.weight is back.transformer.wte.weight


def test_from_hf_refuses_what_would_not_match():
    exact = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=10, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                                                 activation_function="gelu"))
    with pytest.raises(ValueError, match="activation_function must be one of"):
        from_hf(exact)
    scaled = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=10, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                                                  scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="scale attention scores"):
        from_hf(scaled)


def test_hf_config_rejects_models_without_bias_and_other_activations():
    with pytest.raises(ValueError, match="only a config with bias=True converts"):
        hf_config(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8, bias=False))
    with pytest.raises(ValueError, match="activation must be one of"):
        hf_config(CONFIG, activation="relu")


def test_gpt2_small_counts_agree_on_the_meta_device():
    with torch.device("meta"):
        hf_small = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert hf_small.num_parameters() == gpt_param_count(config) == 124_439_808


def test_shipped_checkpoint_converts_exactly_in_float64_and_within_float32_rounding():
    """float64: the same function. float32 on a trained model: each implementation's own rounding is a few 1e-5
    on 1,024 positions (different summation orders and GELU formulas), so the float32 check uses 2 windows."""
    import copy

    from course_lib import assets

    ours = assets.load("char-gpt")
    theirs = to_hf(ours)
    idx = torch.randint(0, ours.config.vocab_size, (2, ours.config.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap64 = (copy.deepcopy(ours).double()(idx)[0] - copy.deepcopy(theirs).double()(idx).logits).abs().max().item()
        ours32, theirs32 = ours(idx)[0], theirs(idx).logits
    assert gap64 < 1e-10
    torch.testing.assert_close(ours32, theirs32, rtol=1e-4, atol=1e-4)  # float32 rounding of a trained model, see above
