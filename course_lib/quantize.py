"""Decoding at the speed of memory, chapter 08: bytes per token and weight-only quantization.

A decode step of a batch of B sequences reads every weight once, whatever B, and each sequence's KV
cache; it computes 2 FLOPs per weight and sequence. At small B the time goes to reading the weights, so
storing them in fewer bytes makes decoding faster: int8 with one float32 scale per output channel
(symmetric absmax), bfloat16, or int4 levels with a scale and a minimum per group of inputs (asymmetric, the
layout of llama.cpp's Q4_1: weight ~ scale * q + minimum, q in 0..15).

``bytes_per_token``, ``quantize_int8``, ``dequantize_int8`` and ``int8_linear`` are the reference
solutions of chapter 08's exercises (``tests/grading/test_solution_drift.py`` keeps the notebook's equal to them).
``Int8Linear`` (an ``nn.Linear`` with int8 weights) and ``quantize_model`` (every nn.Linear of a model made
one, in place) are the reference of its build exercise; ``Int8KernelLinear`` rounds the activations to int8 too and
runs PyTorch's int8-by-int8 product,
``quantize_int4`` is the reference of its int4 exercise, ``dequantize_int4`` the weight it stands for, and
``Int4Linear`` a layer on those int4 weights (PyTorch's CPU int4 kernel or a dequantize-and-multiply, whichever
``course_lib.kernels`` measured faster here); ``quantize_weights`` a quantized copy of a course_lib GPT,
``decode_weight_bytes`` the bytes of the weights a decode step of a model reads, counted.

Shapes: B batch, C = n_embd, L = n_layer, V vocabulary; a weight is (out, in), as in ``nn.Linear``.
"""
from __future__ import annotations

import copy
import functools
import itertools
import os

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


#: The two ways ``Int8KernelLinear`` sums its products of int8 levels, both exact: PyTorch's int8 kernel, where it sums
#: exactly on this CPU, else a float64 product (integers below 2^53: exact too, but it reads the weight as float64).
INT8_PRODUCTS = ("torch._int_mm", "float64 matmul")


@functools.cache
def int8_product() -> str:
    """Which of INT8_PRODUCTS ``Int8KernelLinear`` runs here: "torch._int_mm" where it sums int8 products exactly,
    else "float64 matmul".

    ``torch._int_mm`` runs oneDNN's int8 product, exact (int32 sums) on a CPU with VNNI (AVX-512 VNNI, or AVX-VNNI on
    an AVX2 CPU); without it (AVX2 or AVX-512 alone, or oneDNN held to AVX2, AVX512_CORE or SSE4.1 by
    ONEDNN_MAX_CPU_ISA) it adds pairs of products in 16 bits, which saturate: wrong sums, measured. Decided once per
    process, on probes whose pairs of products reach the most a pair can be; a build whose ``torch._int_mm`` raises
    gets the float64 product."""
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 5, 16, 64):
        x = torch.randint(-127, 128, (rows, 256), generator=g, dtype=torch.int8)
        x[0] = 127 * (torch.randint(0, 2, (256,), generator=g) * 2 - 1)
        q = torch.randint(-127, 128, (96, 256), generator=g, dtype=torch.int8)
        q[:2] = x[0].abs() * torch.tensor([[1], [-1]], dtype=torch.int8)
        q[2] = x[0]
        exact = x.double() @ q.double().t()  # every sum below 2^53: exact (an int64 product would be too, but ATen's
        # int64 matrix product leaves the CPU in a state that slows the SSE code of ATEN_CPU_CAPABILITY=default 20-fold)
        try:
            summed = torch._int_mm(x, q.t())
        except RuntimeError:  # a build without the CPU kernel
            return INT8_PRODUCTS[1]
        if not torch.equal(summed.double(), exact):
            return INT8_PRODUCTS[1]
    return INT8_PRODUCTS[0]


def int8_sums(levels, q):
    """The exact sums levels @ q.T of int8 levels (M, in) and an int8 weight (out, in): (M, out), int32 from
    ``torch._int_mm`` (the weight's transpose as a view: no copy), or float64 where ``int8_product`` chose that: the
    same integers either way."""
    if int8_product() == INT8_PRODUCTS[0]:
        return torch._int_mm(levels, q.t())
    return levels.double() @ q.t().double()


#: The widest input ``Int8KernelLinear`` takes: its int32 sums of in products of an activation level (at most 127 in
#: size) and a weight level (at most 128: int8 holds -128) stay exact (127 * 128 * in < 2^31).
INT8_KERNEL_MAX_IN = (2**31 - 1) // (127 * 128)


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
    """``Int8Linear`` whose activations are rounded to int8 too (W8A8, as llama.cpp's q8_0 dot product does), then
    multiplied by the int8 weight in integers: the fast path of section 6.

    Each row of x (a token's activations) is rounded as ``quantize_int8`` rounds a weight row: symmetric absmax, one
    float32 scale per row, max |row| / 127, levels in [-127, 127] (a row whose scale is 0 gives outputs of 0, bias
    aside). The int8 rows times the int8 weight's transpose sum exactly (``torch._int_mm``'s int32 sums, or a float64
    product where that kernel is not exact: ``int8_product``), so the sums are the same on every CPU; then, in float32,
    each sum times its row's scale and its output channel's scale, plus the bias. A row that holds a NaN or an
    infinity has no int8 levels: its outputs are all NaN. forward(x (..., in)) -> (..., out), in x's dtype.
    Besides Int8Linear's checks, ValueError if in exceeds INT8_KERNEL_MAX_IN (the int32 sums could overflow) or x's
    last dimension is not in; on a device other than the CPU it runs ``int8_linear``.
    """

    def __init__(self, q, scale, bias=None):
        super().__init__(q, scale, bias)
        if self.in_features > INT8_KERNEL_MAX_IN:
            raise ValueError(f"q's in = {self.in_features} must be at most {INT8_KERNEL_MAX_IN}: the int32 sums "
                             "could overflow")

    def forward(self, x):
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be (..., in) with in = in_features = {self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            return super().forward(x)
        rows = x.reshape(-1, self.in_features)  # (M, in), M = the tokens of x
        if rows.dtype != torch.float32:  # (a call even where it changes nothing: a step makes 49 of these)
            rows = rows.float()
        row_scale = rows.abs().amax(dim=1, keepdim=True) / 127  # (M, 1); NaN or inf if the row holds one
        # a scale of 0 multiplies the sums by 0 whatever the levels, so its divisor only has to be > 0; a row holding
        # NaN or an infinity gets levels 0 and a scale NaN or inf: its outputs NaN. The clamp acts where the scale is
        # subnormal (rounded to few bits, it can be far below max |row| / 127)
        levels = (rows / row_scale.clamp_min(_SMALLEST)).round_().clamp_(-127, 127).nan_to_num_(0).to(torch.int8)
        sums = int8_sums(levels, self.q)
        scales = row_scale * self.scale  # (M, out): a row's scale times a channel's, float32
        if sums.dtype != torch.int32 or scales.dtype != torch.float32 or (
                self.bias is not None and self.bias.dtype != torch.float32):
            # float64's sums to float32 here; int32's inside the float32 product below: each integer rounded to
            # float32 alike, whichever product ran: the same outputs (buffers made float64, by .double(), would take
            # int32's sums whole)
            sums = sums.float()
        y = sums * scales if self.bias is None else torch.addcmul(self.bias, sums, scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)  # x's dtype, whatever the buffers' (.double()'s: float64)


#: The smallest positive float32.
_SMALLEST = torch.finfo(torch.float32).smallest_normal * 2.0**-23


#: The group sizes ``quantize_int4`` takes: groups of 32 to 128 inputs (llama.cpp's Q4 blocks hold 32, GPTQ's and
#: AWQ's groups usually 128), the sizes PyTorch's int4 kernel takes.
INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int4(weight, group_size=32):
    """Asymmetric int4 quantization of a weight (out, in), one scale and one minimum per group of `group_size`
    consecutive inputs of a row (the layout of llama.cpp's Q4_1; GPTQ and AWQ group the inputs the same way).

    Returns (q (out, in) uint8, scale (out, in // group_size) float32, minimum (out, in // group_size) float32),
    with weight[o, i] ~ q[o, i] * scale[o, g] + minimum[o, g] for the group g = i // group_size: minimum is the
    group's smallest weight and scale = (its largest - its smallest) / 15, so the levels are 0..15, the group's
    smallest entry at 0, its largest at 15, and every entry within half a step (scale / 2) of the weight. A group
    whose float32 scale is 0 (its entries all equal, or so close that the scale underflows) gets scale 0 and q 0,
    never NaN or an infinity. The weight is left unchanged. Raises ValueError naming the argument: weight not 2-D
    or not finite (NaN or an infinity), group_size not one of 32, 64, 128, in not a multiple of group_size.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():  # no scale and minimum stand for NaN or inf
        raise ValueError("weight must be finite: it holds NaN or an infinity")
    if not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:  # 32.0 is not a size
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"weight's in = {in_features} inputs must be a multiple of group_size = {group_size}")
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)  # consecutive inputs
    minimum = groups.amin(dim=2)  # (out, groups)
    scale = (groups.amax(dim=2) - minimum) / 15  # 16 levels, 15 steps
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: 0 / 1, not 0 / 0
    q = torch.round((groups - minimum[..., None]) / divisor[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scale, minimum


def dequantize_int4(q, scale, minimum):
    """The weight (out, in) float32 that (q (out, in), scale and minimum (out, in // group_size)) stand for."""
    out_features, in_features = q.shape
    groups = q.float().reshape(out_features, scale.shape[1], -1)  # (out, groups, group_size)
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).reshape(out_features, in_features)


#: PyTorch's CPU int4 kernel (bfloat16 activations; two levels per byte, a bfloat16 scale and offset per group).
_INT4_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
#: That kernel's packing takes a number of output channels that is a multiple of 16 (others are padded with zeros).
INT4_KERNEL_ROWS = 16
#: The two ways ``Int4Linear`` can compute; which one runs is measured (``COURSE_INT4_KERNEL`` forces one).
INT4_KERNELS = ("int4 kernel", "dequantize + F.linear")


class Int4Linear(nn.Module):
    """A linear layer on int4 weights: ``Int4Linear(q, scale, minimum, bias=None)``, from ``quantize_int4``'s triple.

    forward(x (..., in)) -> (..., out), in x's dtype: F.linear(x, W, bias) with W = ``dequantize_int4(q, scale,
    minimum)``, within the rounding of the kernel that runs, ``self.kernel``: "int4 kernel", PyTorch's
    (``torch._weight_int4pack_mm_for_cpu``: two levels per byte, bfloat16 activations, scales and offsets, the
    output channels padded to a multiple of 16), or "dequantize + F.linear" (float32 levels from uint8,
    one byte per level, float32 scales). ``course_lib.kernels.choose_faster`` measures the two on a one-row product
    of this shape, once per shape and thread count, and the layer keeps only the chosen one's tensors;
    `kernel` (or else ``COURSE_INT4_KERNEL``) forces one: the dequantizing one computes in x's dtype on every CPU
    alike, where a measured choice may differ between machines. ``from_linear(linear, group_size=32,
    quantize_int4=quantize_int4, kernel="auto")``: the layer of an nn.Linear (its bias kept in float32), quantized by
    `quantize_int4` (a learner's, say).
    """

    def __init__(self, q, scale, minimum, bias=None, kernel="auto"):
        super().__init__()
        from .kernels import choose_faster

        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        candidates = {INT4_KERNELS[1]: self._dequantized_buffers(q, scale, minimum)}
        if _INT4_KERNEL and self.group_size in INT4_GROUP_SIZES:
            candidates[INT4_KERNELS[0]] = self._packed_buffers(q, scale, minimum)
        x = torch.zeros(1, self.in_features)
        runs = {name: (lambda buffers=buffers, name=name: self._forward(name, buffers, x))
                for name, buffers in candidates.items()}
        self.kernel = choose_faster(("int4", self.out_features, self.in_features, self.group_size), runs,
                                    os.environ.get("COURSE_INT4_KERNEL", "auto") if kernel == "auto" else kernel)
        for name, t in candidates[self.kernel].items():
            self.register_buffer(name, t)

    @staticmethod
    def _dequantized_buffers(q, scale, minimum) -> dict:
        return {"q": q.detach().to(torch.uint8).contiguous(), "scale": scale.detach().float(),
                "minimum": minimum.detach().float()}

    @staticmethod
    def _packed_buffers(q, scale, minimum) -> dict:
        """The kernel's layout: levels packed two per byte, (out padded, in / 2); per group (scale, minimum + 8 scale),
        (groups, out padded, 2) in bfloat16 (the kernel computes (q - 8) * scale + offset)."""
        pad = -q.shape[0] % INT4_KERNEL_ROWS
        q, scale, minimum = (F.pad(t.detach(), (0, 0, 0, pad)) for t in (q, scale.float(), minimum.float()))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        offsets = torch.stack([scale.t(), (minimum + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
        return {"packed": packed, "scales_and_offsets": offsets}

    def _forward(self, kernel: str, buffers: dict, x):
        if kernel == INT4_KERNELS[0]:
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, buffers["packed"], self.group_size,
                                                           buffers["scales_and_offsets"])[:, :self.out_features]
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, dequantize_int4(buffers["q"], buffers["scale"], buffers["minimum"]).to(x.dtype))
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def forward(self, x):
        names = ("packed", "scales_and_offsets") if self.kernel == INT4_KERNELS[0] else ("q", "scale", "minimum")
        return self._forward(self.kernel, {name: getattr(self, name) for name in names}, x)

    @classmethod
    def from_linear(cls, linear, group_size=32, quantize_int4=quantize_int4, kernel="auto"):
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        return cls(*quantize_int4(linear.weight, group_size), linear.bias, kernel)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, kernel={self.kernel!r}")


#: The group size of ``quantize_weights``' int4: llama.cpp's Q4 block.
INT4_GROUP_SIZE = 32


#: What ``quantize_weights`` can store the weights in.
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")


def quantize_weights(model: nn.Module, weights: str, group_size: int = INT4_GROUP_SIZE, quantize_int4=quantize_int4,
                     kernel: str = "auto") -> nn.Module:
    """A copy of `model` (in eval mode) with its weights stored as `weights`; the model is left as it is.

    "int8": every nn.Linear becomes an ``Int8KernelLinear`` (for a GPT: the blocks' four projections and the LM
    head, whose int8 copy no longer shares storage with the token embedding, which stays float32 for its
    look-ups); LayerNorms, embeddings and biases stay float32. "int4": the same with ``Int4Linear`` layers, groups
    of `group_size` inputs quantized by `quantize_int4` (a learner's, say), on `kernel`
    (``Int4Linear``'s), where the input width is a multiple of group_size (others stay nn.Linear). "bfloat16": every
    parameter and buffer in bfloat16 (the activations and a KV cache made for the model follow). "float32": a plain copy.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights == "int4" and group_size not in INT4_GROUP_SIZES:  # else a size no width divides quantizes nothing
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    quantized = copy.deepcopy(model).eval()
    if weights == "bfloat16":
        return quantized.to(torch.bfloat16)
    if weights in ("int8", "int4"):
        for module in list(quantized.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and weights == "int8":
                    setattr(module, name, Int8KernelLinear.from_linear(child))
                elif isinstance(child, nn.Linear) and child.in_features % group_size == 0:
                    setattr(module, name, Int4Linear.from_linear(child, group_size, quantize_int4, kernel))
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
