"""course_lib.encoder_decoder against independent oracles: torch.tril, nn.Transformer's own masks, and
nn.TransformerEncoderLayer / nn.TransformerDecoderLayer with our weights copied in (post-LN and pre-LN)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from course_lib import checks
from course_lib.data import BOS, DIGIT_VOCAB_SIZE, EOS, PAD, reversal_batch
from course_lib.encoder_decoder import (DecoderLayer, EncoderLayer, Transformer, exact_match, make_causal_mask,
                                    make_padding_mask, make_target_mask, shift_right, train_transformer, transformer_loss)
from tests.helpers import assert_parity


def lengths_mask(lengths, T):
    return torch.arange(T) < torch.tensor(lengths)[:, None]  # (B, T), True on real positions


# --- masks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pad_id", [0, 7])
def test_padding_mask_marks_real_tokens_as_key_axis(pad_id):
    tokens = torch.tensor([[3, pad_id, 4, pad_id], [pad_id] * 4, [1, 2, 3, 4]])
    mask = make_padding_mask(tokens, pad_id)
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 1, 4)
    assert torch.equal(mask[:, 0, 0], tokens != pad_id)


@pytest.mark.parametrize("T", [1, 2, 7])
def test_causal_mask_is_the_inverse_of_pytorchs_subsequent_mask(T):
    mask = make_causal_mask(T)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, T, T)
    pytorch = nn.Transformer.generate_square_subsequent_mask(T)  # float, -inf where NOT allowed
    assert torch.equal(mask[0, 0], ~torch.isinf(pytorch))
    assert mask[0, 0].diagonal().all()


def test_target_mask_is_padding_and_causal():
    tgt = torch.tensor([[BOS, 5, 6, EOS, PAD], [BOS, 5, EOS, PAD, PAD]])
    mask = make_target_mask(tgt, PAD)
    assert mask.shape == (2, 1, 5, 5)
    for b in range(2):
        for i in range(5):
            for j in range(5):
                assert bool(mask[b, 0, i, j]) == (j <= i and int(tgt[b, j]) != PAD)


def test_masks_match_sdpa_is_causal(generator):
    from course_lib.attention import scaled_dot_product_attention
    q, k, v = (torch.randn(2, 3, 6, 4, generator=generator) for _ in range(3))
    out, _ = scaled_dot_product_attention(q, k, v, make_causal_mask(6))
    assert_parity(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("call,match", [(lambda: make_padding_mask(torch.zeros(4, dtype=torch.long), 0), r"shape \(B, T\)"),
                                        (lambda: make_causal_mask(0), "T must be >= 1")])
def test_masks_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- layers against PyTorch ------------------------------------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("d_model,n_heads,d_ff,lengths", [(16, 4, 32, [5, 3]), (24, 3, 40, [7, 7, 1]), (8, 1, 8, [4])])
def test_encoder_layer_matches_pytorch_forward_and_backward(norm_first, d_model, n_heads, d_ff, lengths, generator):
    layer = checks.seeded_parameters(EncoderLayer(d_model, n_heads, d_ff, norm_first=norm_first), seed=1).eval()
    oracle = checks.torch_encoder_layer(layer)
    T = max(lengths)
    x = torch.randn(len(lengths), T, d_model, generator=generator)
    real = lengths_mask(lengths, T)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x_ours, make_padding_mask(real.long(), 0))
    expected = oracle(x_theirs, src_key_padding_mask=~real)  # PyTorch: True = padding = NOT attended
    assert_parity(out, expected.detach())
    upstream = torch.randn(out.shape, generator=generator)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert_parity(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-4)  # gradients pass through 2 sublayers: a looser atol


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_pytorch_with_target_and_memory_masks(norm_first, generator):
    layer = checks.seeded_parameters(DecoderLayer(16, 4, 32, norm_first=norm_first), seed=2).eval()
    oracle = checks.torch_decoder_layer(layer)
    tgt = torch.tensor([[BOS, 4, 5, 6, EOS], [BOS, 4, EOS, PAD, PAD], [BOS, EOS, PAD, PAD, PAD]])
    src_real = lengths_mask([6, 2, 4], 6)
    x, memory = torch.randn(3, 5, 16, generator=generator), torch.randn(3, 6, 16, generator=generator)
    with torch.no_grad():
        out = layer(x, memory, make_target_mask(tgt, PAD), src_real[:, None, None, :])
        # two equivalent ways to give PyTorch the same masks (both inverted: True = blocked)
        split = oracle(x, memory, tgt_mask=~make_causal_mask(5)[0, 0], tgt_key_padding_mask=tgt == PAD,
                       memory_key_padding_mask=~src_real)
        full = oracle(x, memory, tgt_mask=checks.torch_attention_mask(make_target_mask(tgt, PAD), 4, 3, 5, 5),
                      memory_mask=checks.torch_attention_mask(src_real[:, None, None, :], 4, 3, 5, 6))
    assert_parity(out, split)
    assert_parity(out, full)


@pytest.mark.parametrize("cls", [EncoderLayer, DecoderLayer])
def test_layers_apply_dropout_in_training_only(cls, generator):
    layer = checks.seeded_parameters(cls(16, 4, 32, dropout=0.3), seed=3)
    x = torch.randn(2, 5, 16, generator=generator)
    args = (x,) if cls is EncoderLayer else (x, torch.randn(2, 4, 16, generator=generator))
    layer.eval()
    with torch.no_grad():
        first, second = layer(*args), layer(*args)
        for module in layer.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        without = layer(*args)
        for module in layer.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.3
        layer.train()
        training = layer(*args)
    assert torch.equal(first, second) and torch.equal(first, without)
    assert not torch.allclose(training, first)


@pytest.mark.parametrize("make,match", [
    (lambda: EncoderLayer(10, 3, 16), "d_model must be a multiple of n_heads"),
    (lambda: DecoderLayer(16, 4, 32, dropout=1.5), r"dropout must be in \[0, 1\)"),
    (lambda: EncoderLayer(16, 4, 0), "d_ff must be an integer >= 1"),
    (lambda: Transformer(13, 13, pad_id=13), r"pad_id must be in \[0, 13\)"),
    (lambda: Transformer(13, 13, n_encoder_layers=0), "n_encoder_layers must be an integer >= 1"),
    (lambda: Transformer(0, 13), "src_vocab_size must be an integer >= 1"),
])
def test_bad_arguments_raise_clear_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --- the encoder-decoder model ---------------------------------------------------------------------

def small_model(norm_first=False, seed=0, **kwargs):
    torch.manual_seed(seed)
    options = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, max_len=16)
    options.update(kwargs)
    return Transformer(DIGIT_VOCAB_SIZE, DIGIT_VOCAB_SIZE, norm_first=norm_first, **options).eval()


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_equals_the_same_stack_of_pytorch_layers(norm_first, generator):
    """Embeddings, positions, final norms and read-out from our model; every layer replaced by PyTorch's, masks inverted."""
    model = small_model(norm_first)
    for layer in [*model.encoder_layers, *model.decoder_layers]:
        checks.seeded_parameters(layer, seed=4)
    batch = reversal_batch(4, max_len=9, generator=generator)
    tgt_in = shift_right(batch.tgt)
    with torch.no_grad():
        src_pad, tgt_pad = batch.src == PAD, tgt_in == PAD
        causal_blocked = ~make_causal_mask(tgt_in.shape[1])[0, 0]
        x = model.src_embed(batch.src) * math.sqrt(16) + model.positions[: batch.src.shape[1]]
        for layer in model.encoder_layers:
            x = checks.torch_encoder_layer(layer)(x, src_key_padding_mask=src_pad)
        memory = model.encoder_norm(x)
        y = model.tgt_embed(tgt_in) * math.sqrt(16) + model.positions[: tgt_in.shape[1]]
        for layer in model.decoder_layers:
            y = checks.torch_decoder_layer(layer)(y, memory, tgt_mask=causal_blocked, tgt_key_padding_mask=tgt_pad,
                                                  memory_key_padding_mask=src_pad)
        expected = model.generator(model.decoder_norm(y))
        assert_parity(model(batch.src, tgt_in), expected)
    assert isinstance(model.encoder_norm, nn.Identity) != norm_first


def test_padding_does_not_change_the_real_positions(generator):
    model = small_model()
    batch = reversal_batch(5, generator=generator)
    tgt_in = shift_right(batch.tgt)
    with torch.no_grad():
        logits = model(batch.src, tgt_in)
        more_src = torch.cat([batch.src, torch.full((5, 4), PAD)], 1)
        more_tgt = torch.cat([tgt_in, torch.full((5, 2), PAD)], 1)
        padded = model(more_src, more_tgt)[:, : tgt_in.shape[1]]
        for b, n in enumerate(batch.src_lengths.tolist()):
            alone = model(batch.src[b : b + 1, :n], tgt_in[b : b + 1, : n + 1])
            assert_parity(alone[0], logits[b, : n + 1])
    real = batch.tgt != PAD
    assert_parity(padded[real], logits[real])


def test_decoder_is_causal(generator):
    model = small_model()
    batch = reversal_batch(3, min_len=6, max_len=6, generator=generator)
    tgt_in = shift_right(batch.tgt)
    changed = tgt_in.clone()
    changed[:, 4:] = torch.randint(3, 13, (3, 3), generator=generator)
    with torch.no_grad():
        assert_parity(model(batch.src, changed)[:, :4], model(batch.src, tgt_in)[:, :4])


def test_generate_is_the_greedy_argmax_of_the_teacher_forced_logits_and_pads_after_eos(generator):
    model = small_model(seed=3)
    src = reversal_batch(6, generator=generator).src
    tokens = model.generate(src, max_len=12)
    assert tokens.shape == (6, 12)
    with torch.no_grad():
        logits = model(src, shift_right(tokens))
    for b in range(6):
        row = tokens[b].tolist()
        end = row.index(EOS) + 1 if EOS in row else 12
        assert torch.equal(logits[b, :end].argmax(-1), tokens[b, :end])
        assert all(t == PAD for t in row[end:])


def test_cross_attention_weights_are_recorded_per_layer_and_hooks_removed(generator):
    model = small_model()
    batch = reversal_batch(3, generator=generator)
    weights = model.cross_attention_weights(batch.src, shift_right(batch.tgt))
    assert len(weights) == 2 and weights[0].shape == (3, 2, batch.tgt.shape[1], batch.src.shape[1])
    src_real = (batch.src != PAD)[:, None, None, :]
    assert torch.equal(weights[0].masked_fill(src_real, 0), torch.zeros_like(weights[0]))  # no weight on source padding
    assert_parity(weights[1].sum(-1), torch.ones(weights[1].shape[:-1]))
    assert all(not layer.cross_attn._forward_hooks for layer in model.decoder_layers)


def test_the_layer_classes_can_be_given_and_take_the_same_state_dict(generator):
    calls = []

    class MyEncoderLayer(EncoderLayer):
        def forward(self, x, mask=None):
            calls.append("encoder")
            return super().forward(x, mask)

    class MyDecoderLayer(DecoderLayer):
        def forward(self, x, memory, tgt_mask=None, memory_mask=None):
            calls.append("decoder")
            return super().forward(x, memory, tgt_mask, memory_mask)

    reference = small_model().eval()
    mine = small_model(encoder_layer=MyEncoderLayer, decoder_layer=MyDecoderLayer)
    mine.load_state_dict(reference.state_dict())  # strict: the same parameter names
    mine.eval()
    assert all(isinstance(layer, MyEncoderLayer) for layer in mine.encoder_layers)
    assert all(isinstance(layer, MyDecoderLayer) for layer in mine.decoder_layers)
    src = torch.randint(3, 13, (2, 5), generator=generator)
    tgt_in = torch.randint(3, 13, (2, 4), generator=generator)
    with torch.no_grad():
        assert torch.equal(mine(src, tgt_in), reference(src, tgt_in))
    assert calls.count("encoder") == len(mine.encoder_layers) and calls.count("decoder") == len(mine.decoder_layers)


def test_sequences_longer_than_max_len_are_rejected():
    with pytest.raises(ValueError, match="sequence length must be <= max_len = 16, got 17"):
        small_model()(torch.full((1, 17), 5), torch.full((1, 3), BOS))


def test_shift_right_and_loss_ignore_padding(generator):
    tgt = torch.tensor([[5, 6, EOS, PAD], [7, EOS, PAD, PAD]])
    assert shift_right(tgt).tolist() == [[BOS, 5, 6, EOS], [BOS, 7, EOS, PAD]]
    logits = torch.randn(2, 4, 13, generator=generator)
    real = tgt != PAD
    torch.testing.assert_close(transformer_loss(logits, tgt), nn.functional.cross_entropy(logits[real], tgt[real]))


def test_exact_match_of_a_perfect_and_a_wrong_model(generator):
    batch = reversal_batch(4, generator=generator)

    class Copy(Transformer):
        def generate(self, src, max_len, bos_id=BOS, eos_id=EOS):
            return answer.clone()

    model = Copy(DIGIT_VOCAB_SIZE, DIGIT_VOCAB_SIZE, d_model=8, n_heads=2, d_ff=8)
    answer = batch.tgt
    assert exact_match(model, batch)[0].all()
    answer = batch.tgt.clone()
    answer[1, 0] = EOS  # stops too early
    assert exact_match(model, batch)[0].tolist() == [True, False, True, True]


def test_a_short_training_run_lowers_the_loss_and_leaves_eval_mode():
    model = small_model()
    run = train_transformer(model, lambda g: reversal_batch(32, min_len=1, max_len=4, generator=g), steps=60, warmup=5, lr=3e-3,
                            progress=False)
    assert len(run.losses) == 60 and not model.training
    assert sum(run.losses[-5:]) / 5 < 0.8 * sum(run.losses[:5]) / 5


def test_train_transformer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="lr must be > 0"):
        train_transformer(small_model(), lambda g: reversal_batch(2, generator=g), steps=1, lr=0.0)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        train_transformer(small_model(), lambda g: reversal_batch(2, generator=g), steps=0)
