"""Decoding at the speed of memory, chapter 08: bytes per token and weight-only quantization.

A decode step of a batch of B sequences reads every weight once, whatever B, and each sequence's KV
cache; it computes 2 FLOPs per weight and sequence. At small B the time goes to reading the weights, so
storing them in fewer bytes makes decoding faster: int8 with one float32 scale per output channel
(symmetric absmax), or bfloat16.

``bytes_per_token``, ``quantize_int8``, ``dequantize_int8`` and ``int8_linear`` are the reference
solutions of chapter 08's exercises (``tests/grading/test_solution_drift.py`` keeps the notebook's equal to them).
``Int8Linear`` (an ``nn.Linear`` with int8 weights) and ``quantize_model`` (every nn.Linear of a model made
one, in place) are the reference of its build exercise; ``Int8KernelLinear`` runs PyTorch's int8 kernel,
``quantize_weights`` a quantized copy of a course_lib GPT, ``decode_weight_bytes`` the bytes of the weights a decode step of a model reads, counted.

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
    """Bytes one decode step of a batch of `batch_size` sequences reads, per token it generates (a number).

    What the step reads in full, as section 1 says: the weights of GPT(config) (the position table left out,
    the tied embedding once) and each sequence's cached keys and values of `context` tokens. dtype: the
    weights'; cache_dtype: the cache's, by default what the course's models cache in (the given code sets
    it). Raises ValueError if batch_size is not an integer >= 1 or context not in [0, block_size]. The tests
    compare with the bytes of a real model's tensors and of a real KV cache, at several batch sizes,
    contexts and dtypes, and with GPT-2 small's parameter count.
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

    Returns (q (out, in) int8, scale (out,) float32), with weight ~ q * scale[:, None]: every entry within
    half a step (scale[o] / 2) of the weight, each row's largest entry at +127 or -127, the levels in
    [-127, 127], zero kept 0. The scale is float32, whatever the weight's float dtype. A row whose float32
    scale is 0 (an all-zero row, or one so small that its scale underflows, such as 1.4e-44) gets scale 0
    and q 0, never NaN. The weight is left unchanged. Raises ValueError if the weight is not 2-D.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (out,): one scale per output channel
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: 0 / 1, not 0 / 0
    q = torch.round(w / divisor[:, None]).clamp(-127, 127).to(torch.int8)  # round, then cast: no truncation
    return q, scale


def dequantize_int8(q, scale):
    """The weight that (q (out, in) int8, scale (out,)) stands for, (out, in) float32: scale[o] belongs to row o."""
    return q.float() * scale.float()[:, None]


def int8_linear(x, q, scale, bias=None):
    """A linear layer on int8 weights, without building the float weight: x (..., in) -> (..., out), x's dtype.

    Equal, within float rounding, to F.linear(x, W, bias) with W the weight (q, scale) stands for; bias
    (out,) or None. The tests compare with float64 F.linear, for several shapes, dtypes and scales.
    """
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)  # (..., out): scale each output channel
    return y if bias is None else y + bias.to(x.dtype)


#: PyTorch's CPU kernel for int8 weights (bfloat16 activations, float32 accumulation), where it exists.
_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")
#: That kernel reads a row 16 weights at a time, without a remainder loop: it needs in_features % 16 == 0.
INT8_KERNEL_MULTIPLE = 16


class Int8Linear(nn.Module):
    """A linear layer whose weight is stored as int8 levels with one float32 scale per output channel.

    ``Int8Linear(q, scale, bias=None)``: q (out, in) int8, scale (out,), bias (out,) or None; kept as the
    buffers ``q`` (int8), ``scale`` (float32) and ``bias`` (float32, or None), with the attributes
    ``in_features`` and ``out_features``. ``Int8Linear.from_linear(linear)``: the layer that stands for an
    nn.Linear, its weight quantized as ``quantize_int8`` does, its bias kept as it is (in float32).
    forward(x (..., in)) -> (..., out), in x's dtype: F.linear(x, W, bias) with W the dequantized weight,
    within float rounding. Raises ValueError naming the argument: q not a 2-D int8 tensor, scale or bias
    not of shape (out,), from_linear given something that is not an nn.Linear.
    The tests check these buffers and outputs against float64 F.linear, on single layers and on a GPT.
    """

    def __init__(self, q, scale, bias=None):
        super().__init__()
        ### BEGIN SOLUTION
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be a 2-D int8 tensor (out, in), got {getattr(q, 'dtype', type(q))} "
                             f"of shape {tuple(getattr(q, 'shape', ()))}")
        out_features, in_features = q.shape
        if tuple(scale.shape) != (out_features,):
            raise ValueError(f"scale must have shape (out,) = ({out_features},), got {tuple(scale.shape)}")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must be None or of shape (out,) = ({out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("q", q.detach().contiguous())
        self.register_buffer("scale", scale.detach().float())  # float32 scales, whatever they came in
        self.register_buffer("bias", None if bias is None else bias.detach().float())  # kept, not quantized
        ### END SOLUTION

    @classmethod
    def from_linear(cls, linear):
        ### BEGIN SOLUTION
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        q, scale = quantize_int8(linear.weight)  # one scale per output channel
        return cls(q, scale, linear.bias)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        return int8_linear(x, self.q, self.scale, self.bias)
        ### END SOLUTION

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_model(model):
    """Quantize `model` in place: every nn.Linear in it, at any depth, becomes an ``Int8Linear``; returns `model`.

    For a course GPT: the four projections of every block and the LM head (whose int8 copy no longer shares
    storage with the token embedding, which stays a float32 table for look-ups); embeddings, LayerNorms and
    biases stay float32. The tests count the Int8Linear modules, check that no nn.Linear is left and that the
    quantized GPT's logits equal, within float rounding, those of the float GPT whose matrices are replaced by
    their dequantized weights. Raises ValueError if `model` is not an nn.Module.
    """
    ### BEGIN SOLUTION
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))
    return model
    ### END SOLUTION


class Int8KernelLinear(Int8Linear):
    """``Int8Linear`` on PyTorch's CPU int8 kernel (``torch._weight_int8pack_mm``): the fast path of section 6.

    The kernel reads the int8 weights as they are, converts the activations to bfloat16 and returns
    bfloat16; the scale and the bias are then applied in float32. Elsewhere it runs ``int8_linear``, as it
    does for an input width the kernel cannot take (not a multiple of 16).
    """

    def forward(self, x):
        if _INT8_KERNEL and x.device.type == "cpu" and self.in_features % INT8_KERNEL_MULTIPLE == 0:
            unit_scales = torch.ones(self.out_features, dtype=torch.bfloat16)  # the kernel's own: ours come after
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (B*T, in)
            y = torch.ops.aten._weight_int8pack_mm(rows, self.q, unit_scales).view(*x.shape[:-1], self.out_features)
            y = y.to(x.dtype) * self.scale if self.bias is None else torch.addcmul(self.bias, y, self.scale)  # float32
            return y.to(x.dtype)
        return super().forward(x)


#: What ``quantize_weights`` can store the weights in.
WEIGHT_FORMATS = ("float32", "bfloat16", "int8")


def quantize_weights(model: nn.Module, weights: str) -> nn.Module:
    """A copy of `model` (in eval mode) with its weights stored as `weights`; the model is left as it is.

    "int8": every nn.Linear becomes an ``Int8KernelLinear`` (for a GPT: the blocks' four projections and the LM
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
                    setattr(module, name, Int8KernelLinear.from_linear(child))
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
