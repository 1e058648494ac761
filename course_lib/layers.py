"""Building blocks of a transformer layer: the position-wise feed-forward network and LayerNorm (chapter 03),
RMSNorm and the SwiGLU MLP of Llama-style models (chapter 11).

Both act on the last axis only: a tensor of shape ``(..., D)`` (usually ``(B, T, D)``) is
transformed vector by vector, the same way at every position, and no information moves
between positions. Mixing positions is attention's job.

``layer_norm`` is the reference solution of chapter 03's first exercise, ``rms_norm`` and ``swiglu`` those of
chapter 11; the notebooks' solution cells are the same code (``tests/grading/test_solution_drift.py`` checks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .validation import check_positive


def _check_dropout(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear(D, F) -> activation -> Dropout -> Linear(F, D).

    x: (..., D) -> (..., D). The same two-layer MLP is applied to every position separately;
    the original transformer uses F = 4 D and ReLU.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        check_positive("d_model", d_model)
        check_positive("d_ff", d_ff)
        _check_dropout(dropout)
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> (..., D)."""
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


def layer_norm(x, weight, bias, eps=1e-5):
    """Layer normalisation of each vector over the last axis, with gain weight and shift bias.

    x: (..., D)   weight, bias: (D,)   Returns (..., D), equal to torch.nn.functional.layer_norm(x, (D,),
    weight, bias, eps). The tests check that each vector is normalised on its own, that the variance
    is torch.nn.LayerNorm's (biased, dividing by D), that the eps argument is used as torch uses it,
    and that a constant vector gives bias, not NaN.
    """
    mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # (..., 1), divides by D, not D - 1
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


class _GainNorm(nn.Module):
    """What LayerNorm and RMSNorm share: d_model (an integer >= 1) and eps (>= 0) checked, eps kept, and a
    learned gain ``weight`` of d_model ones."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        check_positive("d_model", d_model)
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))


class LayerNorm(_GainNorm):
    """LayerNorm over the last axis with a learned gain (ones) and bias (zeros), like torch.nn.LayerNorm(d_model)."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__(d_model, eps)
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> (..., D)."""
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"x must have size {self.weight.shape[0]} in its last axis, got shape {tuple(x.shape)}")
        return layer_norm(x, self.weight, self.bias, self.eps)


def rms_norm(x, weight, eps=1e-5):
    """Root-mean-square normalisation over the last axis (Zhang and Sennrich, 2019), Llama's RMSNorm.

    x: (..., D), any leading shape   weight: (D,), the learned gain   eps: >= 0   Returns (..., D) in x's dtype.
    Each vector along the last axis is normalised on its own, then scaled by weight; an all-zero vector gives 0,
    not NaN. The hidden tests compare with torch.nn.functional.rms_norm and a float64 reference, on inputs with
    a large mean and on inputs whose root mean square is comparable to sqrt(eps).
    """
    mean_square = x.pow(2).mean(dim=-1, keepdim=True)  # (..., 1): the mean of the squares, not the variance
    return x * torch.rsqrt(mean_square + eps) * weight


class RMSNorm(_GainNorm):
    """RMSNorm over the last axis with a learned gain (ones) and no bias, like Hugging Face's LlamaRMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> (..., D)."""
        return rms_norm(x, self.weight, self.eps)


def swiglu(x, w_gate, w_up, w_down):
    """The SwiGLU MLP of Llama (Shazeer, 2020), with nn.Linear-shaped weights and no biases.

    x: (..., C), any leading shape   w_gate, w_up: (F, C)   w_down: (C, F)   Returns (..., C) in x's dtype.
    Each vector along the last axis is transformed on its own. The hidden tests compare with a float64
    reference of section 3's formula for several widths F != C, and with inputs of different leading shapes.
    """
    gate = F.silu(F.linear(x, w_gate))  # (..., F): the gate, through the nonlinearity
    up = F.linear(x, w_up)  # (..., F): the values it gates, linear
    return F.linear(gate * up, w_down)  # (..., C)


def swiglu_width(n_embd: int, multiple_of: int = 32) -> int:
    """The hidden width F of a SwiGLU MLP that costs what a 4C GELU MLP costs: 3 C F ~ 8 C^2, F ~ 8C/3.

    As in Meta's Llama code: int(8 C / 3) rounded up to a multiple of multiple_of (Llama: 256).
    """
    check_positive("n_embd", n_embd)
    check_positive("multiple_of", multiple_of)
    hidden = int(8 * n_embd / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class SwiGLU(nn.Module):
    """The MLP of a Llama block: gate_proj, up_proj (C -> F) and down_proj (F -> C), no biases. (..., C) -> (..., C)."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        check_positive("n_embd", n_embd)
        check_positive("hidden", hidden)
        self.gate_proj = nn.Linear(n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., C) -> (..., C): ``swiglu`` through the three modules, so that a kernel swapped into them
        (chapter 08's ``kernels.use_fastest_kernels``) runs."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
