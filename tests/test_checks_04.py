"""Chapter 04's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from course_lib import checks, gpt
from course_lib.gpt import GPT, CausalSelfAttention, GPTConfig, gpt_param_count


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_causal_self_attention(CausalSelfAttention)
    checks.check_gpt_forward(GPT)
    checks.check_gpt_param_count(gpt_param_count)
    assert capsys.readouterr().out.count("all visible checks passed") == 3


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


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_causal_self_attention, attention_with(lambda T: torch.ones(T, T, dtype=torch.bool)),
     r"changing the inputs at positions 3 and 4 changed your outputs at positions 0-2 by up to \d"),
    (checks.check_causal_self_attention, attention_with(lambda T: torch.ones(T, T, dtype=torch.bool).tril(-1)),
     r"your output at position 0 is off by \d.*does your mask leave out the diagonal"),
    (checks.check_causal_self_attention, attention_with(lambda T: torch.ones(T, T, dtype=torch.bool).tril(1)),
     r"shifted up by one"),
    (checks.check_gpt_forward, Untied, r"model.lm_head.weight is not model.transformer.wte.weight"),
    (checks.check_gpt_forward, LossAgainstInputs, r"your loss compared with the mean cross-entropy of the oracle's logits"),
    (checks.check_gpt_forward, NoPositions, r"your logits compared with a float64 oracle differs .* in \d+ of 234 entries"),
    (checks.check_gpt_param_count, lambda config, tied=True: gpt_param_count(config, tied) - config.block_size * config.n_embd,
     r"= 806,528, but the model has 822,912 parameters \(a difference of -16,384; .*block_size\*C = 16,384"),
    (checks.check_gpt_param_count, lambda config, tied=True: float(gpt_param_count(config, tied)), r"should return an int, got float"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_the_param_count_oracle_counts_pytorch_modules_not_our_model():
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert checks.gpt_param_count_oracle(config) == 124_439_808
    assert checks.gpt_param_count_oracle(config, tied=False) == 124_439_808 + 50257 * 768
