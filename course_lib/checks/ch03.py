"""Visible checks of chapter 03 (the transformer), and the PyTorch oracles they compare against.

Oracles: ``torch.nn.functional.layer_norm``, ``torch.tril`` and ``torch.nn.TransformerEncoderLayer`` /
``torch.nn.TransformerDecoderLayer`` with the learner's weights copied in; never course_lib's
reference solutions.

PyTorch's transformer layers take boolean masks with the *opposite* meaning to this course's:
``True`` = "may NOT attend". ``torch_attention_mask`` converts (and says so in its name).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .core import assert_close, assert_shape, assert_tensor, call_learner, fail, passed

__all__ = ["check_layer_norm", "check_masks", "check_encoder_layer", "check_decoder_layer", "check_layers", "ENCODER_PARAMETERS", "DECODER_PARAMETERS",
           "torch_encoder_layer", "torch_decoder_layer", "torch_attention_mask", "seeded_parameters"]


def seeded_parameters(module: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    """Overwrite every parameter with seeded random values: N(0, scale^2), and 1 + N(0, scale^2) for LayerNorm gains.

    Checks then depend neither on the global random state nor on the initialisation (LayerNorm's
    default gain 1 and bias 0 would hide a forgotten gain or bias).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=gen) * scale
            parameter.copy_(1.0 + noise if "norm" in name and name.endswith("weight") else noise)
    return module


def _copy_attention(ours: nn.Module, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
    theirs.out_proj.weight.copy_(ours.W_o.weight)
    theirs.out_proj.bias.copy_(ours.W_o.bias)


def _copy_common(ours: nn.Module, theirs: nn.Module, n_norms: int) -> None:
    _copy_attention(ours.self_attn, theirs.self_attn)
    for name in ("linear1", "linear2"):
        getattr(theirs, name).load_state_dict(getattr(ours.ffn, name).state_dict())
    for i in range(1, n_norms + 1):
        getattr(theirs, f"norm{i}").weight.copy_(getattr(ours, f"norm{i}").weight)
        getattr(theirs, f"norm{i}").bias.copy_(getattr(ours, f"norm{i}").bias)


def torch_encoder_layer(layer: nn.Module) -> nn.TransformerEncoderLayer:
    """A torch.nn.TransformerEncoderLayer (batch_first, ReLU, eps 1e-5, no dropout, our dtype) holding the weights of our EncoderLayer.

    It runs in training mode: with dropout 0 that changes nothing, and it keeps PyTorch off its
    fused inference "fast path", so the oracle is the plain textbook computation.
    """
    attn = layer.self_attn
    oracle = nn.TransformerEncoderLayer(attn.d_model, attn.n_heads, layer.ffn.linear1.out_features, dropout=0.0,
                                        batch_first=True, norm_first=layer.norm_first, dtype=layer.norm1.weight.dtype)
    with torch.no_grad():
        _copy_common(layer, oracle, 2)
    return oracle.train()


def torch_decoder_layer(layer: nn.Module) -> nn.TransformerDecoderLayer:
    """A torch.nn.TransformerDecoderLayer (batch_first, ReLU, eps 1e-5, no dropout, our dtype) holding the weights of our DecoderLayer."""
    attn = layer.self_attn
    oracle = nn.TransformerDecoderLayer(attn.d_model, attn.n_heads, layer.ffn.linear1.out_features, dropout=0.0,
                                        batch_first=True, norm_first=layer.norm_first, dtype=layer.norm1.weight.dtype)
    with torch.no_grad():
        _copy_common(layer, oracle, 3)
        _copy_attention(layer.cross_attn, oracle.multihead_attn)
    return oracle.train()


def torch_attention_mask(mask: torch.Tensor, n_heads: int, batch: int, n_queries: int, n_keys: int) -> torch.Tensor:
    """Our mask (bool, broadcastable to (B, H, Tq, Tk), True = attend) as PyTorch's 3-D attn_mask (B*H, Tq, Tk), True = BLOCKED."""
    return ~mask.expand(batch, n_heads, n_queries, n_keys).reshape(batch * n_heads, n_queries, n_keys)


def _close(actual, expected, tol: float = 1e-5) -> bool:
    return isinstance(actual, torch.Tensor) and actual.shape == expected.shape and bool(
        ((actual.double() - expected.double()).abs() <= tol + tol * expected.double().abs()).all())


def _diagnose(actual, mistakes: dict) -> None:
    """Fail with the message of the first classic mistake whose result ``actual`` reproduces."""
    for message, result in mistakes.items():
        if _close(actual, result):
            fail(message)


# --- exercise 1: layer norm -------------------------------------------------------------------

def check_layer_norm(layer_norm) -> None:
    """Visible checks for exercise 1 against torch.nn.functional.layer_norm."""
    gen = torch.Generator().manual_seed(301)
    d = 8
    x = torch.randn(2, 3, d, generator=gen) * 3 + 1
    ones, zeros = torch.ones(d), torch.zeros(d)
    out = layer_norm(x, ones, zeros)
    assert_shape(out, (2, 3, d), "layer_norm(x, ...) for x of shape (2, 3, 8)")
    means = out.double().mean(-1)
    if (means.abs() > 1e-4).any():
        worst = tuple(int(i) for i in torch.unravel_index(means.abs().argmax(), means.shape))
        fail(f"with weight = 1 and bias = 0, the vector out[{worst[0]}, {worst[1]}] should have mean 0 over its last axis, "
             f"but it has mean {means[worst].item():.4g}: normalise each vector over the last axis (dim=-1), "
             "with keepdim=True so that the statistics broadcast back")
    second_moment = out.double().pow(2).mean(-1)  # the biased variance of the output, since its mean is 0
    if ((second_moment - (d - 1) / d).abs() < 1e-3).all():
        fail(f"the outputs have variance {second_moment.mean().item():.4f} = (D - 1) / D = 7/8 instead of 1: you divided "
             "by D - 1 (the unbiased variance, torch.var's default). LayerNorm uses the biased variance, dividing by D")
    assert_close(out, F.layer_norm(x, (d,), eps=1e-5), "layer_norm(x, ones, zeros)")
    weight, bias = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    affine = layer_norm(x, weight, bias)
    normalised = F.layer_norm(x, (d,), eps=1e-5)
    _diagnose(affine, {
        "layer_norm(x, weight, bias) ignores weight and bias: after normalising, multiply by weight and add bias": normalised,
        "layer_norm(x, weight, bias) multiplies by weight but never adds bias": normalised * weight,
        "layer_norm(x, weight, bias) adds bias but never multiplies by weight": normalised + bias,
        "layer_norm(x, weight, bias) adds bias before multiplying by weight: the order is normalised * weight + bias":
            (normalised + bias) * weight,
    })
    assert_close(affine, F.layer_norm(x, (d,), weight, bias, eps=1e-5),
                 "layer_norm(x, weight, bias) (is the result multiplied by weight and then bias added?)")
    tiny = torch.randn(4, d, generator=gen) * 1e-3  # variance 1e-6, below eps = 1e-5: eps matters here
    assert_close(layer_norm(tiny, ones, zeros), F.layer_norm(tiny, (d,), eps=1e-5),
                 "layer_norm of vectors whose variance (about 1e-6) is smaller than eps = 1e-5 "
                 "(eps belongs inside the square root: sqrt(var + eps))")
    passed("layer_norm")


# --- exercise 2: masks ----------------------------------------------------------------------------

def _as_bool_mask(value, name: str, shape) -> torch.Tensor:
    assert_tensor(value, name)
    if value.dtype != torch.bool:
        fail(f"{name} should be a bool tensor (True = may attend), got dtype {value.dtype}")
    assert_shape(value, shape, name)
    return value


def _show(mask: torch.Tensor) -> str:
    return "\n".join(" ".join(str(int(v)) for v in row) for row in mask.int())


def check_masks(make_padding_mask, make_causal_mask, make_target_mask) -> None:
    """Visible checks for exercise 2: the three masks on a small example."""
    pad = 0
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, pad, pad]])
    padding = _as_bool_mask(make_padding_mask(tokens, pad), "make_padding_mask(tokens, pad_id) for tokens (2, 4)", (2, 1, 1, 4))
    expected = tokens != pad
    if not torch.equal(padding[:, 0, 0], expected):
        fail(f"make_padding_mask gives {padding[:, 0, 0].int().tolist()} for tokens {tokens.tolist()} with pad_id 0, "
             f"expected {expected.int().tolist()} (True on the real tokens, False on padding)")
    # another pad id (3), padding on the left (as a batch padded for generation), and token 0 as a real token
    tokens3 = torch.tensor([[3, 3, 0, 6], [5, 0, 7, 8]])
    padding = _as_bool_mask(make_padding_mask(tokens3, 3), "make_padding_mask(tokens, 3) for tokens (2, 4)", (2, 1, 1, 4))
    expected = tokens3 != 3
    if not torch.equal(padding[:, 0, 0], expected):
        got = padding[:, 0, 0]
        lengths = expected.sum(1, keepdim=True)
        hint = ("your mask is tokens != 0: the pad id is hard-coded. Compare with the `pad_id` argument: tokens != pad_id"
                if torch.equal(got, tokens3 != 0) else
                "your mask keeps the first n tokens of each row (n = the number of real tokens): it assumes padding at the "
                "end. Padding may be anywhere (here on the left): mark exactly the positions where tokens == pad_id"
                if torch.equal(got, torch.arange(4) < lengths) else "False exactly where tokens == pad_id")
        fail(f"make_padding_mask gives {got.int().tolist()} for the left-padded tokens {tokens3.tolist()} with pad_id 3, "
             f"expected {expected.int().tolist()}: {hint}")

    causal = _as_bool_mask(make_causal_mask(4), "make_causal_mask(4)", (1, 1, 4, 4))
    expected = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    if not torch.equal(causal[0, 0], expected):
        hint = ("the diagonal is False: a position must be allowed to attend to itself" if not causal[0, 0].diagonal().all()
                else "a query may see a key in its future (above the diagonal)" if causal[0, 0].triu(1).any()
                else "some allowed keys are missing")
        fail(f"make_causal_mask(4) gives\n{_show(causal[0, 0])}\nexpected (row = query, column = key)\n{_show(expected)}\n{hint}")

    target = make_target_mask(tokens, pad)
    if isinstance(target, torch.Tensor) and target.dim() == 4 and target.shape[0] == 1:
        fail(f"make_target_mask(tgt, pad_id) for tgt (2, 4) has shape {tuple(target.shape)}, expected (2, 1, 4, 4): without "
             "a batch axis it cannot know which keys are padding; combine the padding mask and the causal mask with &")
    target = _as_bool_mask(target, "make_target_mask(tgt, pad_id) for tgt (2, 4)", (2, 1, 4, 4))
    expected = (tokens != pad)[:, None, None, :] & torch.tril(torch.ones(4, 4, dtype=torch.bool))
    if not torch.equal(target, expected):
        fail(f"make_target_mask for the target {tokens[1].tolist()} (pad_id 0) gives\n{_show(target[1, 0])}\nexpected\n"
             f"{_show(expected[1, 0])}\nkey j is allowed for query i only if j <= i AND token j is not padding: "
             "combine the padding mask and the causal mask with &")
    passed("masks")


# --- exercises 3 and 4: encoder and decoder layers ------------------------------------------------

def _attention_names(prefix: str) -> set[str]:
    return {f"{prefix}.{W}.{p}" for W in ("W_q", "W_k", "W_v", "W_o") for p in ("weight", "bias")}


_FFN_NAMES = {f"ffn.linear{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
ENCODER_PARAMETERS = _attention_names("self_attn") | _FFN_NAMES | {f"norm{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
DECODER_PARAMETERS = (_attention_names("self_attn") | _attention_names("cross_attn") | _FFN_NAMES
                      | {f"norm{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")})


def _check_parameter_names(layer: nn.Module, expected: set[str], name: str) -> None:
    """The layer holds exactly the parameters the docstring names, so a shipped model's weights load into it."""
    names = set(layer.state_dict())
    if names != expected:
        missing, unexpected = sorted(expected - names), sorted(names - expected)
        fail(f"your {name} holds other parameters than its docstring names (missing: {missing or 'none'}; unexpected: "
             f"{unexpected or 'none'}). Create exactly the submodules the docstring names, under those names: the chapter "
             "loads trained weights into your layers by them")


def _run(call, name: str, hint: str):
    """Call the learner's layer; a RuntimeError (shapes that do not broadcast) becomes a message with a hint."""
    with torch.no_grad():
        result = call_learner(call, name, hint)
    if isinstance(result, tuple):
        fail(f"{name} should return one tensor x (B, T, D), got a tuple of {len(result)}")
    return result


def _parity(ours, expected, name: str, oracle: str, hint: str) -> None:
    assert_close(ours, expected, f"{name} compared with {oracle} holding the same weights ({hint})")


def _check_dropout_off(build, run, expected, name: str) -> None:
    """In eval mode dropout is off: the layer built with dropout=0.5 (the same weights) gives the output of dropout 0."""
    layer = build(0.5)
    with torch.no_grad():
        out = _run(lambda: run(layer), f"{name}(dropout=0.5) after .eval()", "dropout acts in training mode only")
    if not _close(out, expected):
        fail(f"{name}(dropout=0.5) after .eval() gives another output than with dropout 0 and the same weights: dropout is "
             "still on in eval mode. F.dropout(x, p) drops whatever eval() says (its `training` defaults to True): use the "
             "nn.Dropout modules (self.dropout1(...)), or pass training=self.training")


POST_LN_ENCODER = "post-LN: x = norm1(x + self_attn(x, x, x, mask)[0]), then x = norm2(x + ffn(x))"
PRE_LN_ENCODER = ("pre-LN: h = norm1(x); x = x + self_attn(h, h, h, mask)[0], then x = x + ffn(norm2(x)); "
                  "the residual adds the un-normalised x")


def check_encoder_layer(EncoderLayer) -> None:
    """Visible checks of the encoder layer against torch.nn.TransformerEncoderLayer: post-LN and pre-LN, with a padding mask;
    dropout=0.5 off after eval()."""
    _check_encoder(EncoderLayer)
    passed("EncoderLayer")


def check_decoder_layer(DecoderLayer) -> None:
    """Visible checks of the decoder layer: post-LN and pre-LN with target (padding & causal) and memory padding masks;
    dropout=0.5 off after eval()."""
    _check_decoder(DecoderLayer)
    passed("DecoderLayer")


def check_layers(EncoderLayer, DecoderLayer) -> None:
    """Visible checks for exercise 3 (the build exercise): the encoder layer, then the decoder layer, as above."""
    _check_encoder(EncoderLayer)
    _check_decoder(DecoderLayer)
    passed("EncoderLayer and DecoderLayer")


def _check_encoder(EncoderLayer) -> None:
    d_model, n_heads, d_ff = 16, 4, 32
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(304))
    real = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])  # both end with padding
    for norm_first in (False, True):
        arrangement = "pre-LN" if norm_first else "post-LN"
        layer = seeded_parameters(EncoderLayer(d_model, n_heads, d_ff, dropout=0.0, norm_first=norm_first), seed=303).eval()
        _check_parameter_names(layer, ENCODER_PARAMETERS, "EncoderLayer")
        name = f"your {arrangement} EncoderLayer (norm_first={norm_first})"
        out = _run(lambda: layer(x, real[:, None, None, :]), f"{name} with a padding mask (2, 1, 1, 5)",
                   "the mask goes to self-attention: self.self_attn(query, key, value, mask)")
        with torch.no_grad():
            # PyTorch: key_padding_mask True = padding = NOT attended, the opposite of our masks
            oracle = torch_encoder_layer(layer)
            expected = oracle(x, src_key_padding_mask=~real)
            other = torch_encoder_layer(layer)
            other.norm_first = not norm_first
            _diagnose(out, {
                f"{name} with a padding mask attends to the padding keys only: the mask is inverted. Our masks say "
                "True = may attend; pass the mask to self-attention as it is (only PyTorch's layers want ~mask)":
                    oracle(x, src_key_padding_mask=real),
                f"{name} gives the same output with and without the padding mask: pass `mask` on to self-attention, "
                "self.self_attn(..., mask)": oracle(x),
                f"{name} computes {'post' if norm_first else 'pre'}-LN: with norm_first={norm_first} it must be {arrangement}. "
                + (PRE_LN_ENCODER if norm_first else POST_LN_ENCODER): other(x, src_key_padding_mask=~real),
            })
        _parity(out, expected, f"{name} with a padding mask", f"torch.nn.TransformerEncoderLayer(norm_first={norm_first})",
                PRE_LN_ENCODER if norm_first else POST_LN_ENCODER)
        _check_dropout_off(lambda p: seeded_parameters(EncoderLayer(d_model, n_heads, d_ff, dropout=p, norm_first=norm_first),
                                                   seed=303).eval(),
                           lambda layer: layer(x, real[:, None, None, :]), out, f"your {arrangement} EncoderLayer")


POST_LN_DECODER = ("post-LN: x = norm1(x + self_attn(x, x, x, tgt_mask)[0]), x = norm2(x + cross_attn(x, memory, memory, "
                   "memory_mask)[0]), x = norm3(x + ffn(x))")
PRE_LN_DECODER = ("pre-LN: h = norm1(x); x = x + self_attn(h, h, h, tgt_mask)[0]; x = x + cross_attn(norm2(x), memory, memory, "
                  "memory_mask)[0]; x = x + ffn(norm3(x))")


def _check_decoder(DecoderLayer) -> None:
    d_model, n_heads, d_ff = 16, 4, 32
    gen = torch.Generator().manual_seed(306)
    x, memory = torch.randn(2, 4, d_model, generator=gen), torch.randn(2, 6, d_model, generator=gen)
    tgt_real = torch.tensor([[True] * 4, [True, True, True, False]])
    src_real = torch.tensor([[True] * 6, [True, True, True, True, False, False]])
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    tgt_mask = tgt_real[:, None, None, :] & causal  # (2, 1, 4, 4)
    memory_mask = src_real[:, None, None, :]  # (2, 1, 1, 6)
    for norm_first in (False, True):
        arrangement = "pre-LN" if norm_first else "post-LN"
        layer = seeded_parameters(DecoderLayer(d_model, n_heads, d_ff, dropout=0.0, norm_first=norm_first), seed=305).eval()
        _check_parameter_names(layer, DECODER_PARAMETERS, "DecoderLayer")
        name = f"your {arrangement} DecoderLayer (norm_first={norm_first})"
        out = _run(lambda: layer(x, memory, tgt_mask, memory_mask), f"{name} with tgt_mask (2, 1, 4, 4) and memory_mask (2, 1, 1, 6)",
                   "tgt_mask goes to the self-attention over x; memory_mask to the cross-attention, whose keys and values "
                   "are memory: self.cross_attn(query, memory, memory, memory_mask)")
        with torch.no_grad():
            oracle = torch_decoder_layer(layer)
            masks = dict(tgt_mask=~causal, tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~src_real)
            expected = oracle(x, memory, **masks)
            other = torch_decoder_layer(layer)
            other.norm_first = not norm_first
            without = lambda key: {k: v for k, v in masks.items() if k != key}  # noqa: E731
            mistakes = {
                f"{name} ignores memory_mask: the cross-attention attends to the padding positions of memory. Pass "
                "memory_mask to self.cross_attn": oracle(x, memory, **without("memory_key_padding_mask")),
                f"{name} ignores the padding part of tgt_mask (the padding key of the second target is attended). Pass "
                "tgt_mask, as given, to the self-attention": oracle(x, memory, **without("tgt_key_padding_mask")),
                f"{name} ignores the causal part of tgt_mask (a query sees later positions). Pass tgt_mask, as given, to "
                "the self-attention": oracle(x, memory, **without("tgt_mask")),
                f"{name} ignores tgt_mask: the self-attention sees later positions and padding. Pass tgt_mask to "
                "self.self_attn": oracle(x, memory, memory_key_padding_mask=~src_real),
                f"{name} computes {'post' if norm_first else 'pre'}-LN: with norm_first={norm_first} it must be {arrangement}. "
                + (PRE_LN_DECODER if norm_first else POST_LN_DECODER): other(x, memory, **masks),
            }
            if norm_first:
                normalised_memory = F.layer_norm(memory, (d_model,), layer.norm2.weight, layer.norm2.bias, eps=1e-5)
                mistakes[f"{name} normalises memory too: in pre-LN, norm2 applies to the decoder-side query only; the "
                         "encoder's output (already normalised) is the cross-attention's keys and values as it is"] = (
                    oracle(x, normalised_memory, **masks))
            _diagnose(out, mistakes)
            if not _close(out, expected):
                # an inverted mask inside the layer gives the right output when it is handed the inverted mask
                for mask_name, inverted in (("tgt_mask", (~tgt_mask, memory_mask)), ("memory_mask", (tgt_mask, ~memory_mask))):
                    try:
                        flipped = layer(x, memory, *inverted)
                    except Exception:  # noqa: BLE001 (a diagnosis only: the parity message below says what is wrong)
                        continue
                    if _close(flipped, expected):
                        fail(f"{name} inverts {mask_name}: it attends exactly where {mask_name} is False. Our masks say "
                             f"True = may attend; pass {mask_name} to the attention as it is (only PyTorch's layers want ~mask)")
        _parity(out, expected, f"{name} with target and memory masks", f"torch.nn.TransformerDecoderLayer(norm_first={norm_first})",
                PRE_LN_DECODER if norm_first else POST_LN_DECODER)
        _check_dropout_off(lambda p: seeded_parameters(DecoderLayer(d_model, n_heads, d_ff, dropout=p, norm_first=norm_first),
                                                   seed=305).eval(),
                           lambda layer: layer(x, memory, tgt_mask, memory_mask), out, f"your {arrangement} DecoderLayer")
