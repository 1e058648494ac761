"""Chapter 04's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import checks, gpt
from course_lib.gpt import GPT, CausalSelfAttention, GPTConfig, gpt_param_count

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread, as in the notebook


def attention_with(mask_fn):
    class Buggy(CausalSelfAttention):
        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
            weights = gpt.masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), mask_fn(T))
            return self.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C))
    return Buggy


class Untied(GPT):
    def __init__(self, config):
        super().__init__(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)


class LossAgainstInputs(GPT):
    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, None if targets is None else idx)
        return logits, loss


class NoPositions(GPT):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx)  # the position embedding is never added
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)), None


def attention_scaled_by(scale_of):
    class Buggy(CausalSelfAttention):
        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            weights = gpt.masked_softmax(q @ k.transpose(-2, -1) * scale_of(C, C // self.n_head), causal)
            return self.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C))
    return Buggy


class SplitWithoutTranspose(CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.reshape(B, self.n_head, T, C // self.n_head) for t in self.c_attn(x).split(C, dim=2))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        weights = gpt.masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), causal)
        return self.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C))


class SplitWithPlainReshape(CausalSelfAttention):  # nothing leaks, but position 0 is off (issue 24)
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.reshape(B, self.n_head, T, C // self.n_head) for t in self.c_attn(x).split(C, dim=2))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        weights = gpt.masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), causal)
        return self.c_proj((weights @ v).reshape(B, T, C))


class SplitPerHead(CausalSelfAttention):  # the fused projection read as H chunks of [q | k | v] (issue 24)
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, self.n_head, 3 * C // self.n_head).transpose(1, 2).split(C // self.n_head, dim=-1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        weights = gpt.masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), causal)
        return self.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C))


class WithMaskBuffer(CausalSelfAttention):  # nanoGPT's persistent "bias" buffer: the shipped checkpoint would not load
    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("bias", torch.ones(config.block_size, config.block_size).tril())


class WithPositionBuffer(GPT):
    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("pos", torch.arange(config.block_size))


class TargetsShiftedTwice(GPT):
    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1))


class NoFinalNorm(GPT):
    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(x), None


class ExactGelu(GPT):
    def __init__(self, config):
        super().__init__(config)
        for block in self.transformer.h:
            mlp = block.mlp
            mlp.forward = lambda x, mlp=mlp: mlp.c_proj(F.gelu(mlp.c_fc(x)))  # the exact GELU, not GPT-2's tanh one


class PostLN(GPT):
    def __init__(self, config):
        super().__init__(config)
        for block in self.transformer.h:
            block.forward = lambda x, b=block: b.ln_2(b.ln_1(x + b.attn(x)) + b.mlp(b.ln_1(x + b.attn(x))))


class WithoutConfig(GPT):
    def __init__(self, config):
        super().__init__(config)
        del self.config


def count_with(**wrong):
    """gpt_param_count with one term wrong: e.g. count_with(wpe=0) forgets the position embedding."""
    def count(config, tied=True):
        V, T, L, C, b = config.vocab_size, config.block_size, config.n_layer, config.n_embd, wrong.get("b", config.bias)
        per_layer = wrong.get("per_layer", 12 * C * C) + 2 * C + (11 * C if b else 0)
        head = wrong.get("head", 0 if tied else V * C)
        return V * C + wrong.get("wpe", T * C) + L * per_layer + wrong.get("ln_f", 2 * C if b else C) + head
    return count


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_causal_self_attention, attention_with(lambda T: torch.ones(T, T, dtype=torch.bool)),
     r"changing the inputs at positions 3 and 4 changed your outputs at positions 0-2 by up to \d"),
    (checks.check_causal_self_attention, attention_with(lambda T: torch.ones(T, T, dtype=torch.bool).tril(-1)),
     r"your output at position 0 is off by \d.*does your mask leave out the diagonal"),
    (checks.check_causal_self_attention, attention_with(lambda T: torch.ones(T, T, dtype=torch.bool).tril(1)),
     r"shifted up by one"),
    (checks.check_causal_self_attention, SplitWithoutTranspose, r"heads split without a transpose"),
    (checks.check_causal_self_attention, SplitWithPlainReshape,
     r"off by \d.* in a sequence of 5 tokens, but right for a single token: .*Is the head split wrong\? A plain reshape"),
    (checks.check_causal_self_attention, SplitPerHead,
     r"single token is off by \d.* changes with the q and k weights.*per-head view\(B, T, H, 3 \* Dh\)"),
    (checks.check_causal_self_attention, attention_scaled_by(lambda C, Dh: 1 / math.sqrt(C)),
     r"your scores are scaled by 1/sqrt\(C\) = 1/sqrt\(n_embd\).*scale them by 1/sqrt\(Dh\)"),
    (checks.check_causal_self_attention, attention_scaled_by(lambda C, Dh: 1.0), r"your scores are scaled by nothing"),
    (checks.check_causal_self_attention, WithMaskBuffer,
     r"your CausalSelfAttention's state_dict has the extra entries \['bias'\].*persistent=False"),
    (checks.check_gpt, Untied, r"model.lm_head.weight is not model.transformer.wte.weight"),
    (checks.check_gpt, WithPositionBuffer, r"your GPT's state_dict has the extra entries \['pos'\].*shipped"),
    (checks.check_gpt, LossAgainstInputs, r"your loss is the cross-entropy against the inputs idx, not the targets"),
    (checks.check_gpt, TargetsShiftedTwice, r"your loss is the cross-entropy with the targets shifted a second time"),
    (checks.check_gpt, NoPositions, r"your logits are those of a GPT without the position embedding"),
    (checks.check_gpt, NoFinalNorm, r"your logits are those of a GPT without the final LayerNorm"),
    (checks.check_gpt, ExactGelu, r"your logits are those of a GPT with the exact GELU"),
    (checks.check_gpt, PostLN, r"your logits are those of a GPT of post-LN blocks"),
    (checks.check_gpt, WithoutConfig, r"keep its GPTConfig as model.config"),
    (checks.check_gpt_param_count, count_with(wpe=0),
     r"= 806,528, but the model has 822,912 parameters \(a difference of -16,384: the position embedding wpe"),
    (checks.check_gpt_param_count, count_with(head=103 * 128), r"difference of \+13,184: the LM head counted although it is tied"),
    (checks.check_gpt_param_count, count_with(ln_f=0), r"difference of -256: the final LayerNorm ln_f"),
    (checks.check_gpt_param_count, count_with(b=True), r"bias=False\), tied=True\).*biases counted although config.bias is False"),
    (checks.check_gpt_param_count, count_with(per_layer=6 * 128 * 128 - 3 * 128), r"the MLP made C wide instead of 4C"),
    (checks.check_gpt_param_count, lambda config, tied=True: float(gpt_param_count(config, tied)), r"should return an int, got float"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_count_with_is_the_formula_when_nothing_is_wrong():
    for bias in (True, False):
        config = GPTConfig(vocab_size=103, block_size=128, n_layer=4, n_head=4, n_embd=128, bias=bias)
        assert count_with()(config) == gpt_param_count(config) and count_with()(config, False) == gpt_param_count(config, False)


def test_the_state_dict_names_are_those_of_the_course_gpt_and_the_shipped_checkpoint():
    from course_lib import assets

    model = assets.load("char-gpt")
    assert set(model.state_dict()) == checks.gpt2_state_dict_names(model.config)
    for bias in (True, False):
        config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=bias)
        assert set(GPT(config).state_dict()) == checks.gpt2_state_dict_names(config)
        assert set(CausalSelfAttention(config).state_dict()) == checks.gpt2_state_dict_names(config, "transformer.h.0.attn.")


def test_the_param_count_oracle_counts_pytorch_modules_not_our_model():
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert checks.gpt_param_count_oracle(config) == 124_439_808
    assert checks.gpt_param_count_oracle(config, tied=False) == 124_439_808 + 50257 * 768


def test_the_hugging_face_oracle_and_the_float64_oracle_agree():
    config = GPTConfig(vocab_size=29, block_size=16, n_layer=3, n_head=4, n_embd=32)
    model = checks.randomize_as_gpt2(GPT(config), seed=0)
    idx = torch.randint(0, 29, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(checks.hf_logits(model, idx).double(), checks.gpt_forward_oracle(model, idx), rtol=1e-4, atol=1e-5)


def _redrawn(model, suffix, draw):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                draw(p)
    return model


@pytest.mark.parametrize("redraw,message", [
    (("mlp.c_proj.weight", lambda p: p.normal_(0, 0.02)), r"mlp.c_proj.weight weights .*standard deviation 0.0"),
    (("attn.c_proj.weight", lambda p: p.normal_(0, 0.02 / 2)), r"attn.c_proj.weight weights .*standard deviation 0.0"),
    (("transformer.wpe.weight", lambda p: p.normal_(0, 1)), r"wpe.weight weights .*: (mean|standard deviation)"),
    (("c_attn.weight", lambda p: p.uniform_(-0.02 * 3 ** 0.5, 0.02 * 3 ** 0.5)), r"within one standard deviation of 0; for a normal"),
    (("c_fc.weight", lambda p: p.normal_(0.001, 0.02)), r"c_fc.weight weights .*: mean 0.00099"),
    (("c_fc.bias", lambda p: p.fill_(0.01)), r"c_fc.bias is not all zeros"),
    (("ln_f.weight", lambda p: p.fill_(0.5)), r"ln_f.weight is not all ones"),
])
def test_the_init_check_tells_each_distribution_apart(redraw, message):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=300, block_size=64, n_layer=4, n_head=4, n_embd=64)
    checks.assert_gpt2_init(GPT(config))  # the reference passes
    with pytest.raises(checks.CheckFailed, match=message):
        checks.assert_gpt2_init(_redrawn(GPT(config), *redraw))
