"""Chapter 03's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks, encoder_decoder
from course_lib.encoder_decoder import DecoderLayer, EncoderLayer, make_causal_mask, make_padding_mask, make_target_mask


def ln_unbiased(x, weight, bias, eps=1e-5):
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps) * weight + bias


def ln_over_positions(x, weight, bias, eps=1e-5):
    mean, var = x.mean(-2, keepdim=True), x.var(-2, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def ln_eps_outside(x, weight, bias, eps=1e-5):
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / (torch.sqrt(var) + eps) * weight + bias


def ln_no_affine(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def causal_without_diagonal(T, device=None):
    return torch.ones(T, T, dtype=torch.bool).tril(-1)[None, None]


def causal_one_ahead(T, device=None):
    return torch.ones(T, T, dtype=torch.bool).tril(1)[None, None]


def target_without_padding(tgt, pad_id):
    return make_causal_mask(tgt.shape[1]).expand(tgt.shape[0], 1, tgt.shape[1], tgt.shape[1])


def target_is_causal_only(tgt, pad_id):
    return make_causal_mask(tgt.shape[1])


def padding_as_float(tokens, pad_id):
    return (tokens != pad_id).float()[:, None, None, :]


class EncoderWithPyTorchMaskConvention(EncoderLayer):
    def forward(self, x, mask=None):
        return super().forward(x, None if mask is None else ~mask)


class EncoderReturningWeights(EncoderLayer):
    def forward(self, x, mask=None):
        return super().forward(x, mask), None


class DecoderIgnoringMemoryMask(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, memory, tgt_mask, None)


def ln_weight_only(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], eps=eps) * weight


def ln_bias_only(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], eps=eps) + bias


def ln_bias_before_weight(x, weight, bias, eps=1e-5):
    return (F.layer_norm(x, x.shape[-1:], eps=eps) + bias) * weight


class EncoderFunctionalDropout(EncoderLayer):
    """issue 41: dropout by F.dropout, whose training flag defaults to True: on whatever eval() says."""
    def forward(self, x, mask=None):
        if self.norm_first:
            return super().forward(x, mask)
        x = self.norm1(x + F.dropout(self.self_attn(x, x, x, mask)[0], self.dropout1.p))
        return self.norm2(x + F.dropout(self.ffn(x), self.dropout2.p))


class DecoderFunctionalDropout(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        if self.norm_first:
            return super().forward(x, memory, tgt_mask, memory_mask)
        x = self.norm1(x + self.dropout1(self.self_attn(x, x, x, tgt_mask)[0]))
        x = self.norm2(x + self.dropout2(self.cross_attn(x, memory, memory, memory_mask)[0]))
        return self.norm3(x + F.dropout(self.ffn(x), self.dropout3.p))


class EncoderIgnoringMask(EncoderLayer):
    def forward(self, x, mask=None):
        return super().forward(x, None)


class EncoderNormFirstIgnored(EncoderLayer):
    def forward(self, x, mask=None):
        self.norm_first = False  # always post-LN
        return super().forward(x, mask)


class EncoderPreLNResidualNormalised(EncoderLayer):
    def forward(self, x, mask=None):
        if not self.norm_first:
            return super().forward(x, mask)
        x = self.norm1(x)  # the residual now carries the normalised x
        x = x + self.self_attn(x, x, x, mask)[0]
        return x + self.ffn(self.norm2(x))


class EncoderWithRenamedNorm(EncoderLayer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.attention_norm = self.norm1
        del self.norm1

    @property
    def norm1(self):
        return self.attention_norm


class DecoderIgnoringTargetMask(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, memory, None, memory_mask)


class DecoderInvertingTargetMask(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, memory, ~tgt_mask, memory_mask)


class DecoderInvertingMemoryMask(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, memory, tgt_mask, ~memory_mask)


def padding_with_pad_id_zero(tokens, pad_id):
    return (tokens != 0)[:, None, None, :]


def padding_assumed_at_the_end(tokens, pad_id):
    n_real = (tokens != pad_id).sum(1, keepdim=True)
    return (torch.arange(tokens.shape[1]) < n_real)[:, None, None, :]


class DecoderCrossAttendingToItself(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, x, tgt_mask, memory_mask)


class DecoderNormFirstIgnored(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        self.norm_first = False
        return super().forward(x, memory, tgt_mask, memory_mask)


class DecoderNormalisingMemory(DecoderLayer):
    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        return super().forward(x, self.norm2(memory) if self.norm_first else memory, tgt_mask, memory_mask)


MASKS = (make_padding_mask, make_causal_mask, make_target_mask)


@pytest.mark.parametrize("check,args,message", [
    (checks.check_layer_norm, (ln_unbiased,), r"variance 0\.8750 = \(D - 1\) / D = 7/8 instead of 1: you divided by D - 1"),
    (checks.check_layer_norm, (ln_over_positions,), r"out\[\d, \d\] should have mean 0 over its last axis, but it has mean -?\d\.\d+.*dim=-1"),
    (checks.check_layer_norm, (ln_eps_outside,), r"variance \(about 1e-6\) is smaller than eps.*sqrt\(var \+ eps\)"),
    (checks.check_layer_norm, (ln_no_affine,), r"layer_norm\(x, weight, bias\) ignores weight and bias"),
    (checks.check_layer_norm, (ln_weight_only,), r"multiplies by weight but never adds bias"),
    (checks.check_layer_norm, (ln_bias_only,), r"adds bias but never multiplies by weight"),
    (checks.check_layer_norm, (ln_bias_before_weight,), r"adds bias before multiplying by weight"),
    (checks.check_masks, (make_padding_mask, causal_without_diagonal, make_target_mask), r"the diagonal is False: a position must be allowed to attend to itself"),
    (checks.check_masks, (make_padding_mask, causal_one_ahead, make_target_mask), r"a query may see a key in its future"),
    (checks.check_masks, (make_padding_mask, make_causal_mask, target_without_padding), r"combine the padding mask and the causal mask with &"),
    (checks.check_masks, (make_padding_mask, make_causal_mask, target_is_causal_only), r"has shape \(1, 1, 4, 4\), expected \(2, 1, 4, 4\).*with &"),
    (checks.check_masks, (padding_as_float, make_causal_mask, make_target_mask), r"should be a bool tensor \(True = may attend\), got dtype torch.float32"),
    (checks.check_encoder_layer, (EncoderWithPyTorchMaskConvention,), r"post-LN EncoderLayer .* attends to the padding keys only: the mask is inverted"),
    (checks.check_encoder_layer, (EncoderIgnoringMask,), r"same output with and without the padding mask"),
    (checks.check_encoder_layer, (EncoderNormFirstIgnored,), r"pre-LN EncoderLayer \(norm_first=True\) computes post-LN"),
    (checks.check_encoder_layer, (EncoderPreLNResidualNormalised,),
     r"pre-LN EncoderLayer .*the residual adds the un-normalised x\) differs from the expected values in \d+ of 160"),
    (checks.check_encoder_layer, (EncoderWithRenamedNorm,), r"other parameters than its docstring names \(missing: \['norm1\.bias', 'norm1\.weight'\]; "
                                                             r"unexpected: \['attention_norm\.bias', 'attention_norm\.weight'\]\)"),
    (checks.check_encoder_layer, (EncoderReturningWeights,), r"should return one tensor x \(B, T, D\), got a tuple of 2"),
    (checks.check_decoder_layer, (DecoderIgnoringMemoryMask,), r"post-LN DecoderLayer .* ignores memory_mask"),
    # the build exercise's one visible check: both layers, the encoder first, then the decoder
    (checks.check_layers, (EncoderIgnoringMask, DecoderLayer), r"EncoderLayer .* same output with and without the padding mask"),
    (checks.check_layers, (EncoderLayer, DecoderIgnoringTargetMask), r"post-LN DecoderLayer .* ignores tgt_mask"),
    (checks.check_layers, (EncoderLayer, DecoderCrossAttendingToItself), r"raised RuntimeError: .*keys and values are memory"),
    (checks.check_decoder_layer, (DecoderIgnoringTargetMask,), r"post-LN DecoderLayer .* ignores tgt_mask"),
    (checks.check_decoder_layer, (DecoderCrossAttendingToItself,), r"raised RuntimeError: .*keys and values are memory"),
    (checks.check_decoder_layer, (DecoderNormFirstIgnored,), r"pre-LN DecoderLayer \(norm_first=True\) computes post-LN"),
    (checks.check_decoder_layer, (DecoderNormalisingMemory,), r"pre-LN DecoderLayer .* normalises memory too"),
    (checks.check_decoder_layer, (DecoderInvertingTargetMask,), r"post-LN DecoderLayer \(norm_first=False\) inverts tgt_mask"),
    (checks.check_decoder_layer, (DecoderInvertingMemoryMask,), r"post-LN DecoderLayer \(norm_first=False\) inverts memory_mask"),
    (checks.check_encoder_layer, (EncoderFunctionalDropout,), r"post-LN EncoderLayer\(dropout=0.5\) after .eval\(\) gives another output .*F.dropout"),
    (checks.check_layers, (EncoderLayer, DecoderFunctionalDropout), r"post-LN DecoderLayer\(dropout=0.5\) after .eval\(\) gives another output"),
    (checks.check_masks, (padding_with_pad_id_zero, make_causal_mask, make_target_mask),
     r"left-padded tokens .* with pad_id 3.*your mask is tokens != 0: the pad id is hard-coded"),
    (checks.check_masks, (padding_assumed_at_the_end, make_causal_mask, make_target_mask),
     r"left-padded tokens .* with pad_id 3.*it assumes padding at the end"),
])
def test_classic_bugs_get_specific_messages(check, args, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(*args)


def test_torch_attention_mask_inverts_and_flattens_heads():
    real = torch.tensor([[True, True, False]])[:, None, None, :]  # (1, 1, 1, 3)
    blocked = checks.torch_attention_mask(real, n_heads=2, batch=1, n_queries=4, n_keys=3)
    assert blocked.shape == (2, 4, 3) and blocked[:, :, 2].all() and not blocked[:, :, :2].any()


def test_seeded_parameters_is_deterministic_and_perturbs_norm_gains():
    a = checks.seeded_parameters(encoder_decoder.EncoderLayer(8, 2, 16), seed=1)
    b = checks.seeded_parameters(encoder_decoder.EncoderLayer(8, 2, 16), seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert (a.norm1.weight - 1).abs().max() < 1.5 and not torch.equal(a.norm1.weight, torch.ones(8))
