"""course_lib.llama, the RMSNorm/SwiGLU layers and the RoPE layouts, against independent oracles: PyTorch's
F.rms_norm, float64 formulas, and Hugging Face's LlamaForCausalLM / MistralForCausalLM (random init, no download)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.hf import llama_from_hf, llama_to_hf
from course_lib.kv_cache import kv_cache_bytes
from course_lib.layers import RMSNorm, SwiGLU, rms_norm, swiglu, swiglu_width
from course_lib.llama import Llama, LlamaConfig, generate_llama, llama_cached_forward, llama_param_count, new_cache
from course_lib.positional import apply_rope, apply_rope_half, rope_permutation, rope_to_half, rope_to_interleaved

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks: tiny models crawl on several busy threads
TOL = dict(rtol=1e-5, atol=1e-5)


def small(**overrides) -> LlamaConfig:
    sizes = dict(vocab_size=61, block_size=48, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, intermediate_size=88)
    return LlamaConfig(**{**sizes, **overrides})


# ----------------------------------------------------------------------------- the parts


def test_rms_norm_is_torch_rms_norm_and_the_float64_formula():
    x, w = torch.randn(3, 5, 16) * 3 + 1, torch.randn(16)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), F.rms_norm(x, (16,), w, 1e-5), **TOL)
    x64 = x.double()
    expected = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(RMSNorm(16)(x).double(), expected / w.double(), **TOL)
    assert rms_norm(x, w).abs().sum() > 0 and not torch.allclose(rms_norm(x, torch.ones(16)), F.layer_norm(x, (16,)), atol=1e-3)


def test_swiglu_is_its_float64_formula_and_keeps_the_parameter_count_of_a_4c_gelu_mlp():
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    g, u, d = torch.randn(32, 12, dtype=torch.float64), torch.randn(32, 12, dtype=torch.float64), torch.randn(12, 32, dtype=torch.float64)
    a = x @ g.T
    torch.testing.assert_close(swiglu(x, g, u, d), (a * torch.sigmoid(a) * (x @ u.T)) @ d.T)
    mlp = SwiGLU(12, 32)
    torch.testing.assert_close(mlp(x.float()), swiglu(x.float(), mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))
    assert swiglu_width(4096, 256) == 11008  # Llama 7B's width
    assert swiglu_width(768, 1) * 3 == 8 * 768  # 8C/3 exactly when it is whole: 3 C F = 8 C^2
    with pytest.raises(ValueError, match="n_embd"):
        swiglu_width(0)


def test_the_two_rope_layouts_are_one_rotation_after_a_permutation():
    x = torch.randn(2, 3, 7, 16)
    p = rope_permutation(16)
    assert p.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    torch.testing.assert_close(apply_rope_half(x[..., p]), apply_rope(x)[..., p], **TOL)
    positions = torch.tensor([3, 9, 100, 5, 0, 2, 8])
    torch.testing.assert_close(apply_rope_half(x[..., p], positions), apply_rope(x, positions)[..., p], **TOL)
    assert not torch.allclose(apply_rope_half(x), apply_rope(x), atol=1e-3)  # the layouts differ on the same features


def test_apply_rope_half_rejects_an_odd_head_size_and_positions_of_another_length():
    with pytest.raises(ValueError, match=r"d_head must be a positive even number .* got 7"):
        apply_rope_half(torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match=r"positions must have T=3 entries .* got shape \(4,\)"):
        apply_rope_half(torch.zeros(2, 3, 8), torch.arange(4))


def test_rope_to_half_is_hugging_faces_permute_and_rope_to_interleaved_undoes_it():
    H, Dh, C = 3, 8, 10
    w = torch.randn(H * Dh, C)
    # convert_llama_weights_to_hf.py: w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)
    hf = w.view(H, Dh // 2, 2, C).transpose(1, 2).reshape(H * Dh, C)
    assert torch.equal(rope_to_half(w, H), hf)
    assert torch.equal(rope_to_interleaved(rope_to_half(w, H), H), w)
    per_head = torch.cat([w[h * Dh:(h + 1) * Dh][rope_permutation(Dh)] for h in range(H)])
    assert torch.equal(rope_to_half(w, H), per_head)
    with pytest.raises(ValueError, match="n_heads must divide"):
        rope_to_interleaved(w, 5)


# ----------------------------------------------------------------------------- the model against Hugging Face


@pytest.mark.parametrize("window,layout", [(None, "half"), (None, "interleaved"), (6, "half"), (6, "interleaved")])
def test_logits_equal_hugging_faces_both_ways(window, layout):
    torch.manual_seed(0)
    ours = Llama(small(window=window, rope_layout=layout)).eval()
    theirs = llama_to_hf(ours)
    assert type(theirs).__name__ == ("MistralForCausalLM" if window else "LlamaForCausalLM")
    idx = torch.randint(0, 61, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, **TOL)
    back = llama_from_hf(theirs, layout)
    assert back.config == ours.config
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_model_from_hugging_face_converts_to_either_layout():
    torch.manual_seed(1)
    import transformers

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=48, rms_norm_eps=1e-5)).eval()
    idx = torch.randint(0, 61, (1, 20))
    with torch.no_grad():
        expected = theirs(idx).logits
        for layout in ("half", "interleaved"):
            torch.testing.assert_close(llama_from_hf(theirs, layout)(idx)[0], expected, **TOL)
        wrong = Llama(small(rope_layout="interleaved")).eval()
        wrong.load_state_dict(theirs.state_dict())  # no permutation: the wrong pairing for these weights
        assert (wrong(idx)[0] - expected).abs().max() > 1e-3


def test_a_tied_head_converts_and_what_our_llama_cannot_represent_is_refused():
    import transformers

    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=88, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=48)
    torch.manual_seed(3)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **sizes)).eval()
    ours = llama_from_hf(tied)
    idx = torch.randint(0, 61, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], tied(idx).logits, **TOL)
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()  # a copy: ours is untied
    for setting, overrides in [("rope_type", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
                               ("hidden_act", dict(hidden_act="gelu")), ("bias", dict(attention_bias=True)),
                               ("bias", dict(mlp_bias=True)), ("head_dim", dict(head_dim=16))]:
        with pytest.raises(ValueError, match=setting):
            llama_from_hf(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, **overrides})))


@pytest.mark.parametrize("window", [None, 5])
def test_parameter_count_by_formula_is_hugging_faces(window):
    config = small(window=window)
    theirs = llama_to_hf(Llama(config))
    assert llama_param_count(config) == sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in Llama(config).parameters())


@pytest.mark.parametrize("window", [None, 5])
def test_cached_decoding_equals_the_full_forward_and_greedy_tokens_equal_hugging_faces_generate(window):
    torch.manual_seed(2)
    ours = Llama(small(window=window, n_kv_head=1)).eval()
    theirs = llama_to_hf(ours)
    idx = torch.randint(0, 61, (2, 24))
    cache = new_cache(ours, 2, 24)
    logits = [llama_cached_forward(ours, idx[:, :7], cache)] + [llama_cached_forward(ours, idx[:, t:t + 1], cache) for t in range(7, 24)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(logits, 1), ours(idx)[0], **TOL)
    if window:
        assert cache.capacity == window
    prompt = idx[:, :6]
    with torch.inference_mode():
        expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30,
                                   min_new_tokens=30)
    assert torch.equal(generate_llama(ours, prompt, 30), expected)


def test_cached_decoding_after_generate_equals_the_full_forward():
    # generate_llama (inference mode) and a later cached forward (no_grad) of the same length share the RoPE rows
    ours = Llama(small()).eval()
    idx = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(3))
    generate_llama(ours, idx[:, :5], 15)
    cache = new_cache(ours, 1, 20)
    logits = [llama_cached_forward(ours, idx[:, :5], cache)] + [llama_cached_forward(ours, idx[:, t:t + 1], cache) for t in range(5, 20)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(logits, 1), ours(idx)[0], **TOL)


def test_gqa_shrinks_the_cache_by_the_group_size():
    ours = Llama(small(n_kv_head=1))
    cache = new_cache(ours, 1, 48)
    assert cache.nbytes == kv_cache_bytes(2, 32, 4, 48, n_kv_head=1, dtype=torch.float32) == kv_cache_bytes(2, 32, 4, 48, dtype=torch.float32) // 4


def test_bad_configs_and_inputs_raise():
    with pytest.raises(ValueError, match="n_kv_head must divide"):
        small(n_kv_head=3)
    with pytest.raises(ValueError, match="rope_layout"):
        small(rope_layout="complex")
    with pytest.raises(ValueError, match="window"):
        small(window=0)
    with pytest.raises(ValueError, match="heads of even size"):
        LlamaConfig(vocab_size=5, block_size=8, n_layer=1, n_head=4, n_embd=12)
    model = Llama(small()).eval()
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_llama(model, torch.zeros(1, 2, dtype=torch.long), -1)


def test_llama_loss_is_the_mean_cross_entropy_over_the_targets_that_are_not_padding():
    """The same contract as GPT's: targets are the next tokens as given, -100 marks padding (left out of the mean)."""
    torch.manual_seed(0)
    model = Llama(small()).eval()
    idx, targets = torch.randint(0, 61, (2, 9)), torch.randint(0, 61, (2, 9))
    targets[1, 5:] = -100
    with torch.no_grad():
        logits, loss = model(idx, targets)
    keep = targets != -100
    per_token = -torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    torch.testing.assert_close(loss.double(), per_token[keep].mean(), **TOL)
