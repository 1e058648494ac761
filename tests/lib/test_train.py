"""course_lib.train: the schedule, the optimizer groups, a deterministic training loop that learns."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib.gpt import GPT, GPTConfig
from course_lib.train import TrainConfig, fixed_batches, make_optimizer, train_gpt, warmup_cosine_lr


def test_warmup_cosine_schedule():
    lrs = [warmup_cosine_lr(s, 1e-3, 1e-4, 10, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way through the cosine
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert warmup_cosine_lr(110, 1e-3, 1e-4, 10, 110) == pytest.approx(1e-4)


def test_train_config_validates():
    with pytest.raises(ValueError, match="warmup_steps must be in"):
        TrainConfig(steps=10, warmup_steps=11)
    with pytest.raises(ValueError, match="need 0 <= min_lr <= lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainConfig(steps=0)


def test_optimizer_decays_matrices_only_and_sees_the_tied_matrix_once():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8))
    decay, no_decay = make_optimizer(model, 1e-3, 0.1).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p is model.transformer.wte.weight for p in decay["params"]) == 1
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in model.parameters())


def _run():
    torch.manual_seed(0)
    data = torch.arange(400) % 5  # a perfectly predictable sequence 0 1 2 3 4 0 1 ...
    model = GPT(GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=2, n_embd=16))
    history = train_gpt(model, data[:300], data[300:], TrainConfig(steps=40, batch_size=8, lr=1e-2, min_lr=1e-3,
                                                                    warmup_steps=5, eval_every=20, eval_batches=2), progress=False)
    return model, history


def test_training_is_deterministic_and_learns_a_predictable_sequence():
    model, history = _run()
    _, again = _run()
    assert history.losses == again.losses and history.evals == again.evals
    assert len(history.losses) == len(history.lrs) == 40 and [e["step"] for e in history.evals] == [20, 40]
    assert history.losses[0] > math.log(5) - 0.3 and history.evals[-1]["val"] < 0.25 * math.log(5)
    assert not model.training and history.seconds > 0


def test_fixed_batches_are_fixed():
    data = torch.arange(100)
    a, b = fixed_batches(data, 8, 4, 3, seed=1), fixed_batches(data, 8, 4, 3, seed=1)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
