"""Decoding at the speed of memory, chapter 08: bytes per token and weight-only quantization.

A decode step of a batch of B sequences reads every weight once, whatever B, and each sequence's KV
cache; it computes 2 FLOPs per weight and sequence. At small B the time goes to reading the weights, so
storing them in fewer bytes makes decoding faster: int8 with one float32 scale per output channel
(symmetric absmax), or bfloat16.

``bytes_per_token``, ``quantize_int8``, ``dequantize_int8`` and ``int8_linear`` are the reference
solutions of chapter 08's exercises (``tests/grading/test_solution_drift.py`` keeps the notebook's equal to them).
``Int8Linear`` is an ``nn.Linear`` with int8 weights, ``quantize_weights`` a quantized copy of a
course_lib GPT, ``decode_weight_bytes`` the bytes of the weights a decode step of a model reads, counted.

Shapes: B batch, C = n_embd, L = n_layer, V vocabulary; a weight is (out, in), as in ``nn.Linear``.
"""
from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPTConfig, gpt_param_count


def bytes_per_token(config: GPTConfig, batch_size: int, context: int, dtype=torch.float32, cache_dtype=None) -> float:
    """Bytes one decode step reads per token it generates: (weights + B * KV cache) / B.

    The step reads every weight once for the whole batch: all parameters of GPT(config) except the
    position table, of which it reads one row per sequence (left out); the tied embedding counts once
    (the LM head reads it in full). Each of the B sequences also reads its cached keys and values of
    `context` tokens: 2 * L * context * C elements. dtype: of the weights; cache_dtype: of the cache,
    by default what the course's models cache in: the weights' dtype if it is a floating-point one (a
    bfloat16 model computes and caches in bfloat16), float32 otherwise (int8 weights: the activations,
    and so the keys and values, stay float32).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(context, int) or not 0 <= context <= config.block_size:
        raise ValueError(f"context must be an integer in [0, block_size = {config.block_size}], got {context!r}")
    if cache_dtype is None:  # the cache holds activations: float32 beside int8 weights
        cache_dtype = dtype if dtype.is_floating_point else torch.float32
    element = torch.empty((), dtype=dtype).element_size()  # bytes per weight
    cache_element = torch.empty((), dtype=cache_dtype).element_size()  # bytes per cached number
    weights = gpt_param_count(config) - config.block_size * config.n_embd  # the position table is not read
    kv_cache = 2 * config.n_layer * context * config.n_embd  # keys and values, every layer, per sequence
    return (weights * element + batch_size * kv_cache * cache_element) / batch_size


def quantize_int8(weight):
    """Symmetric per-output-channel (absmax) int8 quantization of a weight (out, in).

    Row o (output channel o) gets its own scale s_o = max_i |w_oi| / 127 and q_oi = round(w_oi / s_o):
    the row's largest entry becomes +-127, zero stays 0, -128 is never used. The scale is computed in
    float32, whatever the weight's float dtype (convert it first). A row whose float32 scale is 0 gets
    s_o = 0 and q = 0, never a division by 0: an all-zero row, and a row so small that max |w| / 127
    underflows to 0 in float32 (a subnormal max |w| such as 1.4e-44). The weight is left unchanged.
    Returns (q (out, in) int8, scale (out,) float32), with weight ~ q * scale[:, None].
    Raises ValueError if the weight is not 2-D.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (out,): one scale per output channel
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: 0 / 1, not 0 / 0
    q = torch.round(w / divisor[:, None]).clamp(-127, 127).to(torch.int8)  # round, then cast: no truncation
    return q, scale


def dequantize_int8(q, scale):
    """The weight that (q (out, in) int8, scale (out,)) stands for: q * scale[:, None], (out, in) float32."""
    return q.float() * scale.float()[:, None]


def int8_linear(x, q, scale, bias=None):
    """x W^T + bias with W = q * scale[:, None], without building W: (..., in) -> (..., out), x's dtype.

    The scale belongs to an output channel, so it factors out of that channel's dot product:
    y_o = s_o * sum_i x_i q_oi + b_o, one multiplication per output instead of one per weight.
    """
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)  # (..., out): scale each output channel
    return y if bias is None else y + bias.to(x.dtype)


#: PyTorch's CPU kernel for int8 weights (bfloat16 activations, float32 accumulation), where it exists.
_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")
#: That kernel reads a row 16 weights at a time, without a remainder loop: it needs in_features % 16 == 0.
INT8_KERNEL_MULTIPLE = 16


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is stored as int8 with one float32 scale per output channel.

    Buffers: q (out, in) int8, scale (out,) float32, and the float32 bias (out,) if any.
    forward(x (..., in)) -> (..., out). On the CPU it runs PyTorch's int8 kernel
    (``torch._weight_int8pack_mm``), which reads the int8 weights as they are, converts the activations
    to bfloat16 and returns bfloat16; the scale and the bias are then applied in float32. Elsewhere it
    runs ``int8_linear``, as it does for an input width the kernel cannot take (not a multiple of 16).
    """

    def __init__(self, q, scale, bias=None):
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
        if tuple(scale.shape) != (q.shape[0],):
            raise ValueError(f"scale must have shape (out,) = ({q.shape[0]},), got {tuple(scale.shape)}")
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._unit_scales = None  # the kernel's own scales, all 1 (ours are applied in float32): made at first use

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """The int8 version of an nn.Linear (``quantize_int8`` of its weight, its bias kept)."""
        q, scale = quantize_int8(linear.weight)
        return cls(q, scale, linear.bias)

    def forward(self, x):
        if _INT8_KERNEL and x.device.type == "cpu" and self.in_features % INT8_KERNEL_MULTIPLE == 0:
            if self._unit_scales is None:
                self._unit_scales = torch.ones(self.out_features, dtype=torch.bfloat16)
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (B*T, in)
            y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self._unit_scales).view(*x.shape[:-1], self.out_features)
            y = y.to(x.dtype) * self.scale if self.bias is None else torch.addcmul(self.bias, y, self.scale)  # float32
            return y.to(x.dtype)
        y = int8_linear(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


#: What ``quantize_weights`` can store the weights in.
WEIGHT_FORMATS = ("float32", "bfloat16", "int8")


def quantize_weights(model: nn.Module, weights: str) -> nn.Module:
    """A copy of `model` (in eval mode) with its weights stored as `weights`; the model is left as it is.

    "int8": every nn.Linear becomes an ``Int8Linear`` (for a GPT: the blocks' four projections and the LM
    head, whose int8 copy no longer shares storage with the token embedding, which stays float32 for its
    look-ups); LayerNorms, embeddings and biases stay float32. "bfloat16": every parameter and buffer
    in bfloat16 (the activations and a KV cache made for the model follow). "float32": a plain copy.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    quantized = copy.deepcopy(model).eval()
    if weights == "bfloat16":
        return quantized.to(torch.bfloat16)
    if weights == "int8":
        for module in list(quantized.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, Int8Linear.from_linear(child))
    return quantized


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step of a course_lib GPT reads, counted from its tensors.

    Every parameter and buffer once (a tied tensor once), except the embedding tables, of which a step
    reads one row per sequence: the position table never counts, the token embedding only when the LM
    head is that same tensor (tied, float32 or bfloat16), which it then reads in full.
    """
    position_table, token_table = model.transformer.wpe.weight, model.transformer.wte.weight
    head = getattr(model.lm_head, "weight", None)
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}.values()  # tied: once
    return sum(t.numel() * t.element_size() for t in tensors
               if t is not position_table and (t is not token_table or t is head))
