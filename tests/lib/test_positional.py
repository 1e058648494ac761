"""course_lib.positional against independent oracles: float64 formulas, complex numbers, Hugging Face code."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib.positional import LearnedPositionalEmbedding, alibi_bias, alibi_slopes, apply_rope, sinusoidal_encoding
from tests.helpers import assert_parity


# --- sinusoidal ----------------------------------------------------------------------------------

@pytest.mark.parametrize("max_len,d_model", [(1, 2), (7, 4), (50, 16), (33, 10)])
def test_sinusoidal_matches_the_paper_entry_by_entry(max_len, d_model):
    expected = torch.tensor([[math.sin(pos / 10000 ** (2 * (j // 2) / d_model)) if j % 2 == 0
                              else math.cos(pos / 10000 ** (2 * (j // 2) / d_model)) for j in range(d_model)]
                             for pos in range(max_len)], dtype=torch.float64)
    table = sinusoidal_encoding(max_len, d_model)
    assert table.dtype == torch.float32 and table.shape == (max_len, d_model)
    assert_parity(table, expected)


def test_sinusoidal_long_table_is_accurate_to_the_course_tolerance():
    """Computed in float64: a float32 pos * frequency would be off by ~1e-4 at positions in the thousands."""
    table = sinusoidal_encoding(4096, 64)
    position = torch.arange(4096, dtype=torch.float64)[:, None]
    frequency = torch.tensor([10000 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert_parity(table[:, 0::2], torch.sin(position * frequency))
    assert_parity(table[:, 1::2], torch.cos(position * frequency))


def test_sinusoidal_dot_product_depends_only_on_the_offset():
    table = sinusoidal_encoding(64, 32).double()
    gram = table @ table.T
    assert_parity(gram[1:, 1:], gram[:-1, :-1])  # Toeplitz: gram[p, q] depends on q - p only
    assert_parity(gram, gram.T)  # and not on its sign
    assert_parity(gram.diagonal(), torch.full((64,), 16.0, dtype=torch.float64))  # d/2: sin^2 + cos^2 per pair


@pytest.mark.parametrize("args,match", [((4, 7), r"d_model must be a positive even number .* got 7"),
                                        ((4, 0), r"got 0"), ((0, 8), r"max_len must be >= 1, got 0")])
def test_sinusoidal_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        sinusoidal_encoding(*args)


# --- learned -----------------------------------------------------------------------------------------

def test_learned_embedding_adds_the_first_t_rows(generator):
    module = LearnedPositionalEmbedding(10, 6)
    x = torch.randn(2, 4, 6, generator=generator)
    assert_parity(module(x), x + module.embedding.weight[:4])
    assert sum(p.numel() for p in module.parameters()) == 60
    module(x).sum().backward()
    assert torch.equal(module.embedding.weight.grad[4:], torch.zeros(6, 6))
    assert torch.equal(module.embedding.weight.grad[:4], torch.full((4, 6), 2.0))


def test_learned_embedding_rejects_sequences_longer_than_its_table():
    module = LearnedPositionalEmbedding(5, 4)
    module(torch.zeros(1, 5, 4))
    with pytest.raises(ValueError, match=r"sequence length 6 exceeds max_len=5"):
        module(torch.zeros(1, 6, 4))
    with pytest.raises(ValueError, match=r"max_len=0 and d_model=4"):
        LearnedPositionalEmbedding(0, 4)


# --- RoPE --------------------------------------------------------------------------------------------

def rope_complex(x, positions, base):
    """Independent oracle: multiply x[2i] + j x[2i+1] by exp(j pos base^(-2i/Dh)), in float64 complex numbers."""
    d = x.shape[-1]
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    rotated = z * torch.exp(1j * positions.double()[..., None] * theta)
    return torch.view_as_real(rotated).flatten(-2)


@pytest.mark.parametrize("shape,base", [((5, 8), 10000.0), ((2, 3, 7, 16), 10000.0), ((2, 4, 6), 100.0)])
def test_rope_matches_the_complex_number_formula(shape, base, generator):
    x = torch.randn(shape, generator=generator)
    assert_parity(apply_rope(x, base=base), rope_complex(x, torch.arange(shape[-2]), base))


def test_rope_matches_hugging_face_llama_after_permuting_the_pairs(generator):
    """HF pairs feature i with i + Dh/2 (rotate_half); ours pairs (2i, 2i+1): the same rotation up to a permutation."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d_head, time = 16, 9
    config = LlamaConfig(hidden_size=2 * d_head, num_attention_heads=2, head_dim=d_head, rope_theta=500.0)
    q, k = torch.randn(2, 2, time, d_head, generator=generator), torch.randn(2, 2, time, d_head, generator=generator)
    positions = torch.arange(3, 3 + time)[None].expand(2, time)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    # HF feature i and i + Dh/2 form a pair; place them at 2i and 2i+1
    interleave = torch.stack((torch.arange(d_head // 2), torch.arange(d_head // 2) + d_head // 2), dim=-1).flatten()
    assert_parity(apply_rope(q[..., interleave], positions[:, None], base=500.0), hf_q[..., interleave])
    assert_parity(apply_rope(k[..., interleave], positions[:, None], base=500.0), hf_k[..., interleave])


def test_rope_scores_depend_only_on_the_offset(generator):
    q, k = torch.randn(32, generator=generator), torch.randn(32, generator=generator)
    rq, rk = apply_rope(q.expand(40, 32).double()), apply_rope(k.expand(40, 32).double())
    scores = rq @ rk.T
    assert_parity(scores[1:, 1:], scores[:-1, :-1])
    assert_parity(scores.diagonal(), torch.full((40,), (q.double() @ k.double()).item(), dtype=torch.float64))


def test_rope_positions_offset_and_per_batch_positions(generator):
    x = torch.randn(2, 3, 6, 8, generator=generator)
    long = torch.randn(2, 3, 10, 8, generator=generator)
    long[:, :, 4:] = x
    assert_parity(apply_rope(x, torch.arange(4, 10)), apply_rope(long)[:, :, 4:])
    per_batch = torch.stack((torch.arange(6), torch.arange(2, 8))).view(2, 1, 6)
    out = apply_rope(x, per_batch)
    assert_parity(out[0], apply_rope(x[0]))
    assert_parity(out[1], apply_rope(x[1], torch.arange(2, 8)))


def test_rope_keeps_norms_dtype_and_rejects_bad_arguments(generator):
    x = torch.randn(3, 7, 10, generator=generator)
    assert_parity(apply_rope(x).norm(dim=-1), x.norm(dim=-1))
    assert apply_rope(x.bfloat16()).dtype == torch.bfloat16 and apply_rope(x.double()).dtype == torch.float64
    with pytest.raises(ValueError, match=r"last dimension of x must be even .* got 7"):
        apply_rope(torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match=r"positions must have T=3 entries .* got shape \(4,\)"):
        apply_rope(torch.zeros(2, 3, 8), torch.arange(4))


def test_rope_in_float32_stays_accurate_at_long_positions(generator):
    x = torch.randn(1, 8, 64, generator=generator)
    positions = torch.arange(30000, 30008)
    assert_parity(apply_rope(x, positions), rope_complex(x, positions, 10000.0))  # angles are computed in float64


# --- ALiBi -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16])
def test_alibi_slopes_for_powers_of_two_are_geometric(n_heads):
    assert_parity(alibi_slopes(n_heads), torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)], dtype=torch.float64))


@pytest.mark.parametrize("n_heads", list(range(1, 17)) + [24, 40])
def test_alibi_slopes_match_hugging_face_bloom(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    hf = build_alibi_tensor(torch.ones(1, 3), n_heads, torch.float32)  # (H, 1, 3): slope_h * key position
    assert_parity(alibi_slopes(n_heads), hf[:, 0, 1])


def test_alibi_bias_is_minus_slope_times_distance():
    bias = alibi_bias(4, 5)
    slopes = [2 ** (-2 * (h + 1)) for h in range(4)]
    expected = torch.tensor([[[-slopes[h] * abs(i - j) for j in range(5)] for i in range(5)] for h in range(4)], dtype=torch.float64)
    assert bias.shape == (4, 5, 5)
    assert_parity(bias, expected)


def test_alibi_bias_with_fewer_queries_is_the_last_rows():
    assert torch.equal(alibi_bias(8, 3, 7), alibi_bias(8, 7)[:, 4:])


def test_alibi_causal_attention_equals_hugging_face_bloom_bias_after_softmax(generator):
    """BLOOM adds slope * j (key position) instead; under a causal mask both give the same softmax."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    n_heads, time = 6, 7
    scores = torch.randn(n_heads, time, time, generator=generator)
    causal = torch.ones(time, time, dtype=torch.bool).tril()
    ours = torch.softmax((scores + alibi_bias(n_heads, time)).masked_fill(~causal, -math.inf), dim=-1)
    hf_bias = build_alibi_tensor(torch.ones(1, time), n_heads, torch.float32)  # (H, 1, T)
    theirs = torch.softmax((scores + hf_bias).masked_fill(~causal, -math.inf), dim=-1)
    assert_parity(ours, theirs)


@pytest.mark.parametrize("args,match", [((0, 4), r"n_heads must be >= 1, got 0"), ((4, 5, 3), r"need 1 <= T_q <= T_k, got T_q=5 and T_k=3"),
                                        ((4, 0), r"T_q=0")])
def test_alibi_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        alibi_bias(*args)
