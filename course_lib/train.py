"""Training a GPT on a token stream, chapter 04: AdamW, warm-up + cosine schedule, clipping, a progress bar, history.

Deterministic: batches come from a seeded ``torch.Generator`` and evaluation uses fixed batches
(``fixed_batches``), so the same seed, steps and thread count give the same losses.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .data import get_batch
from .gpt import GPT, estimate_loss


@dataclass
class TrainConfig:
    """Hyper-parameters of ``train_gpt``. The learning rate warms up linearly over warmup_steps, then follows a cosine to min_lr."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")


@dataclass
class TrainHistory:
    """What happened during training: the loss and learning rate of every step, and the periodic evaluations."""

    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "train", "val"}: mean loss on fixed batches
    seconds: float = 0.0


def warmup_cosine_lr(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate at step (0-based): linear warm-up to max_lr over warmup_steps, then a cosine down to min_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def fixed_batches(data: torch.Tensor, block_size: int, batch_size: int, n_batches: int, seed: int) -> list:
    """n_batches (x, y) batches drawn with a generator seeded with seed: the same batches every time."""
    generator = torch.Generator().manual_seed(seed)
    return [get_batch(data, block_size, batch_size, generator) for _ in range(n_batches)]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (embeddings, Linear weights) only, not on biases and LayerNorm gains."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}  # a tied Parameter appears once
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)


#: seeds of the fixed evaluation batches (pretrain records its losses on these; tests recompute them)
TRAIN_EVAL_SEED, VAL_EVAL_SEED = 1000, 2000


def train_gpt(model: GPT, train_data: torch.Tensor, val_data: torch.Tensor, config: TrainConfig, progress: bool = True) -> TrainHistory:
    """Train model on random blocks of train_data; evaluate every eval_every steps (and at the end) on fixed batches."""
    from tqdm.auto import trange

    block_size = model.config.block_size
    generator = torch.Generator().manual_seed(config.seed)
    eval_sets = {"train": fixed_batches(train_data, block_size, config.batch_size, config.eval_batches, TRAIN_EVAL_SEED),
                 "val": fixed_batches(val_data, block_size, config.batch_size, config.eval_batches, VAL_EVAL_SEED)}
    optimizer = make_optimizer(model, config.lr, config.weight_decay, config.betas)
    history = TrainHistory()
    start = time.perf_counter()
    model.train()
    bar = trange(config.steps, disable=not progress, desc="training", mininterval=1.0)
    for step in bar:
        lr = warmup_cosine_lr(step, config.lr, config.min_lr, config.warmup_steps, config.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, block_size, config.batch_size, generator)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        history.losses.append(loss.item())
        history.lrs.append(lr)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            history.evals.append({"step": step + 1, **{name: estimate_loss(model, batches) for name, batches in eval_sets.items()}})
            bar.set_postfix(train=f"{history.evals[-1]['train']:.3f}", val=f"{history.evals[-1]['val']:.3f}")
    history.seconds = time.perf_counter() - start
    model.eval()
    return history
