"""Visible checks of chapter 08 (decoding at the speed of memory), and the independent oracles they compare against.

Oracles: bytes counted on real tensors (``bytes_per_token_oracle``: the parameters of a ``GPT(config)``, the
position table left out and the tied embedding once, plus the ``nbytes`` of a chapter 05 ``KVCache`` of
``context`` slots, in the dtype the model caches in); int8 quantization as its float64 formula (``int8_reference``: scale = max |w| / 127 per
row, q = round(w / scale), a scale that underflows to 0 in float32 taken as 0) and its properties (int8 levels in -127..127, every entry within half a step of
the weight, each row's largest entry at +-127); the dequantized weight and the int8 layer as float64
products (``q * scale[:, None]``, ``F.linear``); a quantized GPT against a float64 copy whose matrices are the
oracle's dequantized weights (``dequantized_copy``); int4 with groups as its float64 formula
(``int4_reference``: minimum and (max - min) / 15 per group of consecutive inputs, q = round((w - minimum) / scale));
never course_lib.quantize's reference solutions.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .core import ATOL, RTOL, assert_close, assert_shape, assert_tensor, call_learner, fail, passed, unpack_pair

__all__ = ["check_bytes_per_token", "check_quantize_int8", "check_dequantize_int8", "check_int8_linear",
           "check_quantize_model", "check_quantize_int4", "dequantized_copy", "int4_reference",
           "bytes_per_token_oracle", "default_cache_dtype", "int8_reference", "int8_rounding_ties"]


# ---------------------------------------------------------------------------------------------------------
# exercise 1: bytes per token


def default_cache_dtype(dtype):
    """The dtype of the KV cache of a course GPT whose weights are stored in `dtype`: the dtype its activations
    are computed in. A floating-point dtype's own (the whole model converted, ``model.to(dtype)``), float32 for
    int8 weights (only the linear layers' weights are int8; the embeddings, the activations and the cache stay
    float32). tests/chapters/ch08/test_checks_08.py checks this against the caches ``KVCache.for_model`` makes."""
    return dtype if dtype.is_floating_point else torch.float32


def _decode_parts(config, batch_size: int, context: int, dtype, cache_dtype) -> dict:
    """The numbers a decode step reads, counted on tensors: elements of the weights (position table left out,
    the tied embedding once), of the position table and of the token embedding, and of one sequence's cache;
    bytes per weight (`dtype`) and per cached number (`cache_dtype`)."""
    from ..gpt import GPT  # the model whose decoding chapter 08 costs (chapter 04)
    from ..kv_cache import KVCache  # the cache it decodes with (chapter 05)

    with torch.random.fork_rng(devices=[]):  # its random initialisation leaves the learner's random state as it was
        model = GPT(config)
    params = dict(model.named_parameters())  # a tied Parameter appears once, under its first name
    element = torch.empty((), dtype=dtype).element_size()
    cache_element = torch.empty((), dtype=cache_dtype).element_size()
    cache = 0
    if context > 0:  # a KVCache holds at least one slot
        cache = KVCache(config.n_layer, batch_size, config.n_head, config.n_embd // config.n_head, max_len=context,
                        dtype=cache_dtype).nbytes // (batch_size * cache_element)
    return {"element": element, "cache_element": cache_element, "cache": cache,
            "position": params["transformer.wpe.weight"].numel(), "embedding": params["transformer.wte.weight"].numel(),
            "weights": sum(p.numel() for name, p in params.items() if name != "transformer.wpe.weight")}


def bytes_per_token_oracle(config, batch_size: int, context: int, dtype=torch.float32, cache_dtype=None) -> float:
    """Bytes one decode step reads per token generated, counted: (weights + batch_size x one sequence's cache) / batch_size.

    The weights are every parameter of ``GPT(config)`` (a tied one once) except ``transformer.wpe.weight``, in
    `dtype`; the cache is a chapter 05 ``KVCache(n_layer, batch_size, n_head, n_embd // n_head, max_len=context)``,
    whose ``nbytes`` covers the whole batch, in `cache_dtype` (by default ``default_cache_dtype(dtype)``).
    """
    cache_dtype = default_cache_dtype(dtype) if cache_dtype is None else cache_dtype
    parts = _decode_parts(config, batch_size, context, dtype, cache_dtype)
    return (parts["weights"] * parts["element"] + batch_size * parts["cache"] * parts["cache_element"]) / batch_size


def _number(value, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        fail(f"{what} should be a number, got a tensor of shape {tuple(value.shape)}")
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        fail(f"{what} should be a number (bytes), got {type(value).__name__}")
    if not math.isfinite(number):
        fail(f"{what} should be finite, got {number}")
    return number


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _describe(config, batch_size: int, context: int, dtype, cache_dtype=None) -> str:
    bias = "" if config.bias else ", bias=False"
    cache = "" if cache_dtype is None else f", cache_dtype={cache_dtype}"
    return (f"GPTConfig(vocab_size={config.vocab_size}, block_size={config.block_size}, n_layer={config.n_layer}, "
            f"n_head={config.n_head}, n_embd={config.n_embd}{bias}), batch_size={batch_size}, context={context}, "
            f"dtype={dtype}{cache}")


def _bytes_mistakes(config, B: int, context: int, dtype, cache_dtype, parts: dict):
    """(value, explanation) of the classic wrong formulas, for one case."""
    e, ce, W, K = parts["element"], parts["cache_element"], parts["weights"], parts["cache"]
    P, E = parts["position"], parts["embedding"]
    L, C = config.n_layer, config.n_embd
    mistakes = []
    if K:
        mistakes += [
            (W * e / B, (f"that is the weights alone ({W * e:,} bytes / batch {B}): each sequence also reads its own KV "
                         f"cache, 2 x n_layer x context x n_embd = 2 x {L} x {context} x {C} = {K:,} numbers "
                         f"({K * ce:,} bytes) per token generated")),
            ((W * e + B * K * ce / 2) / B, (f"you counted {K // 2:,} cached numbers per sequence, the keys only: the "
                                            "cache holds a key AND a value per token and layer, 2 x n_layer x context x "
                                            f"n_embd = {K:,} numbers")),
        ]
        if ce != e:
            mistakes.append(((W + B * K) * e / B, (f"you counted the cache in the weights' dtype ({e} byte(s) per "
                                                   f"number), but it is stored in {cache_dtype}, {ce} byte(s) per number: "
                                                   "the cache holds activations (keys and values), which stay float32 "
                                                   "beside int8 weights; use cache_dtype, which defaults to that")))
    if B > 1:
        mistakes += [
            (W * e + B * K * ce, (f"that is what the whole step reads; the step generates one token per sequence, "
                                  f"B = {B} tokens: divide by the batch size")),
            (W * e + K * ce, (f"you counted the weights in full for every token ({W * e:,} bytes): the step reads them "
                              f"once for the whole batch and makes B = {B} tokens, so per token they cost weights / B = "
                              f"{W * e / B:,.6g} bytes (per step is not per token). The KV cache, each sequence's own, "
                              "counts in full")),
        ]
        if K:
            mistakes.append(((W * e + K * ce) / B, ("you divided the KV cache by the batch size too, as if it were "
                                                    "shared: the weights are shared by the batch, but each sequence has "
                                                    "its own cache, and every token generated reads its sequence's "
                                                    f"{K * ce:,} bytes of keys and values in full")))
    total = W * e + B * K * ce  # the bytes of the whole step
    mistakes += [
        (total / B + P * e / B, (f"you counted the position table transformer.wpe (block_size x n_embd = "
                                 f"{config.block_size} x {C} = {P:,} numbers): a decode step reads one row of it per "
                                 "sequence, not the table: leave it out")),
        (total / B + E * e / B, ("you counted the LM head and the token embedding separately: they are one tensor "
                                 "(weight tying: lm_head.weight is transformer.wte.weight), read once, vocab_size x "
                                 f"n_embd = {config.vocab_size} x {C} = {E:,} numbers")),
    ]
    if total % B:
        mistakes.append((total // B, (f"you divided with //, which rounds down to a whole number: the step's "
                                      f"{total:,} bytes shared by B = {B} tokens are {total / B:,.6g} bytes per token; "
                                      "divide with /")))
    mistakes += [((W + B * K) * size / B, (f"you counted {size} byte(s) per number, but a {dtype} weight takes {e} "
                                           "(torch.empty((), dtype=dtype).element_size()) and a cached number of "
                                           f"{cache_dtype} {ce}: the weights are stored in dtype, the cache in "
                                           "cache_dtype"))
                 for size in (1, 2, 4, 8) if (size, size) != (e, ce)]
    return mistakes


def check_bytes_per_token(bytes_per_token) -> None:
    """Visible checks for chapter 08, exercise 1: two small GPTs (with and without biases), batches 1, 7, 8 and 64,
    contexts 0 to block_size, weights in float32, bfloat16, float16 and int8 (whose cache stays float32), and a
    cache dtype given explicitly, against bytes counted on tensors."""
    from ..gpt import GPTConfig  # the model's sizes (chapter 04), not a chapter 08 solution

    small = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=8)
    no_bias = GPTConfig(vocab_size=37, block_size=24, n_layer=3, n_head=4, n_embd=16, bias=False)
    cases = [(small, 1, 0, None, None), (small, 1, 16, torch.float32, None), (small, 8, 5, torch.bfloat16, None),
             (no_bias, 64, 24, torch.float16, None), (no_bias, 8, 10, torch.int8, None),
             (no_bias, 1, 7, torch.float32, None), (small, 7, 9, torch.float32, None),
             (small, 4, 12, torch.bfloat16, torch.float32), (no_bias, 3, 5, torch.float32, torch.float16)]
    for config, B, context, dtype, cache_dtype in cases:
        if dtype is None:  # the default dtype
            name = _describe(config, B, context, "the default torch.float32")
            got = _number(bytes_per_token(config, B, context), f"bytes_per_token({name})")
            dtype = torch.float32
        elif cache_dtype is None:  # the default cache dtype
            name = _describe(config, B, context, dtype)
            got = _number(bytes_per_token(config, B, context, dtype=dtype), f"bytes_per_token({name})")
        else:
            name = _describe(config, B, context, dtype, cache_dtype)
            got = _number(call_learner(lambda: bytes_per_token(config, B, context, dtype=dtype, cache_dtype=cache_dtype),
                                       f"bytes_per_token({name})", "keep the signature's cache_dtype argument",
                                       TypeError), f"bytes_per_token({name})")
        cache_dtype = default_cache_dtype(dtype) if cache_dtype is None else cache_dtype
        parts = _decode_parts(config, B, context, dtype, cache_dtype)
        expected = (parts["weights"] * parts["element"] + B * parts["cache"] * parts["cache_element"]) / B
        if _same(got, expected):
            continue
        for value, explanation in _bytes_mistakes(config, B, context, dtype, cache_dtype, parts):
            if _same(got, value):
                fail(f"for {name}: you computed {got:,.6g} bytes per token, expected {expected:,.6g}: {explanation}")
        fail(f"for {name}: you computed {got:,.6g} bytes per token, expected {expected:,.6g} = (weights "
             f"{parts['weights'] * parts['element']:,} bytes, read once for the batch, + {B} x one sequence's KV cache "
             f"{parts['cache'] * parts['cache_element']:,} bytes in {cache_dtype}) / {B} (ratio {got / expected:.4g})")
    passed("bytes_per_token")


# ---------------------------------------------------------------------------------------------------------
# exercises 2 to 4: int8 weights


def int8_reference(weight):
    """The oracle of chapter 08's quantization checks: symmetric per-output-channel int8, as its float64 formula.

    weight (out, in) -> (q (out, in) int8, scale (out,) float64): scale[o] = max_i |w[o, i]| / 127 and
    q = round(w / scale[:, None]) (half to even), computed in float64. A row whose scale is 0 in float32 gets
    scale 0 and q 0: an all-zero row, and a row so small that max |w| / 127 underflows to 0 in float32 (max |w|
    = 1.4e-44, a subnormal: in float64 its scale would be 1.1e-46 and its levels +-127).
    Code that works in float32 may round the other way where w / scale is within float32 rounding of a
    half-integer: ``int8_rounding_ties`` marks those entries, where q may differ by 1.
    """
    w = weight.detach().double()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(_float32_scale(absmax) > 0, absmax / 127, 0.0)
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None])
    return q.to(torch.int8), scale


def _float32_scale(absmax):
    """max |w| / 127 computed in float32, as the exercise's contract says (absmax (out,) -> (out,) float32)."""
    return absmax.float() / 127


def int8_rounding_ties(weight, slack: float = 1e-4):
    """Entries of weight (out, in) whose w / scale (float64) lies within `slack` of a half-integer: (out, in) bool.

    There either rounding is right (a float32 computation of w / scale may land on either side of the tie)."""
    _, scale = int8_reference(weight)
    ratio = (weight.detach().double() / torch.where(scale > 0, scale, 1.0)[:, None]).abs()
    return ((ratio - ratio.floor()) - 0.5).abs() < slack


_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _non_finite(t) -> str | None:
    """'NaN' or 'an infinity' if the floating-point tensor t holds one, else None."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
        return "NaN" if t.isnan().any() else "an infinity"
    return None


class _NonFiniteWatch(TorchFunctionMode):
    """Watches the torch operations run inside it: ``first``, the first whose floating-point result holds a NaN or
    an infinity (name, kind); ``infinity``, the first whose result holds an infinity (name); ``cast``, the first
    that turned a NaN or an infinity into integers (name, kind: undefined, 0 on one CPU and anything on another).

    ``garbage(t)``: whether t holds such integers still, i.e. comes from that cast through operations that do not
    replace entries (a later ``torch.where``, ``masked_fill`` or in-place write counts as a fix)."""

    _FIXES = {"where", "masked_fill", "nan_to_num", "setitem", "index_put"}

    def __init__(self):
        super().__init__()
        self.first = None
        self.infinity = None
        self.cast = None
        self._tainted: set[int] = set()  # data pointers of integer tensors that hold a cast NaN or infinity

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        name = getattr(func, "__name__", str(func))
        for t in outs:
            kind = _non_finite(t)
            if kind:
                self.first = self.first or (name, kind)
                if torch.isinf(t).any():
                    self.infinity = self.infinity or name
        integer_out = [t for t in outs if t.dtype in _INTEGER_DTYPES]
        cast = next((_non_finite(a) for a in inputs if _non_finite(a)), None)
        touches = any(a.data_ptr() in self._tainted for a in inputs)
        if name.strip("_") in self._FIXES or (name.endswith("_") and not name.startswith("__")):
            self._tainted -= {a.data_ptr() for a in inputs}  # entries replaced: assume the code fixed them
        elif integer_out and (cast or touches):
            self.cast = self.cast or (name, cast)
            self._tainted |= {t.data_ptr() for t in integer_out}
        return out

    def garbage(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.data_ptr() in self._tainted


def _scale_dtype_message(dtype, name: str) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        bits = 1 - round(math.log2(torch.finfo(dtype).eps))  # significant bits: 8 (bfloat16), 11 (float16)
        return (f"scale should be float32, got {dtype} ({name}): {dtype} keeps {bits} significant bits, so the scale "
                f"is off from max |w| / 127 by up to {100 * 2.0 ** -bits:.2g}%, an error every weight of the row "
                "inherits (a trade-off some libraries make; this exercise's contract is a float32 scale: scale.float())")
    return (f"scale should be float32, got {dtype} ({name}): one float32 per output channel is all the precision a "
            "scale needs (a float64 one is 8 bytes; was the weight float64, or the arithmetic?). Return scale.float()")


def _check_quantized(quantize_int8, weight, name: str) -> None:
    """One matrix: every property of symmetric per-output-channel int8, with a specific message for each classic bug."""
    original = weight.clone()
    watch = _NonFiniteWatch()
    with watch:
        result = quantize_int8(weight)
    q, scale = unpack_pair(result, "quantize_int8(weight)", ("q", "scale"))
    assert_tensor(q, f"q ({name})")
    assert_tensor(scale, f"scale ({name})")
    if not torch.equal(weight, original):
        fail(f"quantize_int8 changed the weight it was given ({name}): compute new tensors, do not modify it in place")
    out, inp = weight.shape
    w = weight.double()
    absmax = w.abs().amax(dim=1)  # (out,) float64
    zero_rows = (absmax == 0).nonzero().flatten().tolist()
    tiny_rows = ((absmax > 0) & (_float32_scale(absmax) == 0)).nonzero().flatten().tolist()  # scale underflows to 0
    if q.dtype != torch.int8:
        hint = (": round, then store the levels as 8-bit integers, q.to(torch.int8)" if q.is_floating_point()
                else ": uint8 holds 0..255, no negative levels" if q.dtype == torch.uint8 else "")
        fail(f"q should be int8 (torch.int8), got {q.dtype} ({name}){hint}")
    assert_shape(q, (out, inp), f"q ({name}), one level per weight (out, in)")
    if scale.numel() == 1 and out > 1:
        r = int(absmax.argmin())
        levels = round(127 * absmax[r].item() / absmax.max().item())
        fail(f"scale has shape {tuple(scale.shape)} ({name}): one scale for the whole matrix (per-tensor). Each output "
             f"channel, a row of the (out, in) weight, needs its own: scale[o] = max |w[o, :]| / 127, shape (out,) = "
             f"({out},). With one scale, row {r} (largest |w| {absmax[r].item():.3g}, against {absmax.max().item():.3g} "
             f"in the matrix) would " + ("round to 0 everywhere" if levels == 0 else
                                          f"use only the levels -{levels}..{levels} of -127..127"))
    if tuple(scale.shape) == (out, 1):
        fail(f"scale has shape ({out}, 1) ({name}): return it as (out,) = ({out},), e.g. amax(dim=1) without keepdim "
             "(index it as scale[:, None] where it must broadcast)")
    if tuple(scale.shape) == (inp,) and inp != out:
        fail(f"scale has shape ({inp},) = (in,) ({name}): one scale per input channel, the max over dim 0 (the "
             f"columns). The scale belongs to an output channel, a row of the (out, in) weight: max |w[o, :]| over "
             f"dim 1, shape (out,) = ({out},)")
    assert_shape(scale, (out,), f"scale ({name}), one per output channel (out,)")
    if scale.dtype != torch.float32:
        fail(_scale_dtype_message(scale.dtype, name))
    if not torch.isfinite(scale).all():
        r = int((~torch.isfinite(scale)).nonzero()[0])
        zero = " (that row is all zeros: give it scale 0, and q 0)" if r in zero_rows else ""
        fail(f"scale[{r}] is {scale[r].item()} ({name}){zero}")
    if out > 1 and bool((scale == scale[0]).all()) and absmax.max() > 1.5 * absmax.min():
        fail(f"every row got the same scale, {scale[0].item():.4g} ({name}), though the rows' largest |w| range from "
             f"{absmax.min().item():.3g} to {absmax.max().item():.3g}: that is one scale for the whole matrix "
             "(per-tensor). Each output channel needs its own, scale[o] = max |w[o, :]| / 127")
    for r in zero_rows:
        if scale[r] != 0:
            fail(f"row {r} of this weight is all zeros ({name}): its scale should be max |w| / 127 = 0, got "
                 f"{scale[r].item():.4g} (did you clamp the scale to a small minimum? Keep it 0 and guard the "
                 "division instead: torch.where(scale > 0, scale, 1))")
        if (q[r] != 0).any():
            computed = f" (your code computed {watch.first[1]} in {watch.first[0]})" if watch.first else ""
            fail(f"row {r} of this weight is all zeros ({name}), but your q has {int((q[r] != 0).sum())} nonzero "
                 f"level(s) there, e.g. {int(q[r][q[r] != 0][0])}{computed}: 0 / 0 is NaN, and a NaN cast to int8 is "
                 "undefined. Give an all-zero row scale 0 and divide it by 1 instead: torch.where(scale > 0, scale, 1)")
    for r in tiny_rows:
        top = absmax[r].item()
        row = (f"row {r}'s largest |w| is {top:.2g} ({name}): its scale max |w| / 127 = {top / 127:.2g} is far below "
               "the smallest positive float32 (1.4e-45), so in float32 it underflows to 0")
        if scale[r] != 0:
            fail(f"{row}, and scale[{r}] should be that 0, got {scale[r].item():.4g} (did you clamp the scale to a small "
                 "minimum? Keep it 0 and guard the division instead: torch.where(scale > 0, scale, 1))")
        if (q[r] != 0).any():
            example = int(q[r][q[r] != 0][0])
            if watch.infinity:
                fail(f"{row}, and your q has {int((q[r] != 0).sum())} nonzero level(s) there, e.g. {example} (your "
                     f"code computed an infinity in {watch.infinity}): a division by a zero scale, {top:.2g} / 0 "
                     f"= inf (and 127 / {top:.2g} overflows to inf too). Guard the division by the scale itself, "
                     "torch.where(scale > 0, scale, 1), not by whether the row is all zeros: a row whose scale is 0 "
                     "quantizes to zeros, like an all-zero row")
            fail(f"{row}, and your q has {int((q[r] != 0).sum())} nonzero level(s) there, e.g. {example}, with that "
                 f"scale 0: you divided by a scale kept in higher precision (in float64 it is {top / 127:.2g}, not 0) "
                 "than the one you return. Compute the scale in float32, the precision you return, and guard the "
                 "division by that one: a row whose float32 scale is 0 quantizes to zeros, like an all-zero row")
    if watch.garbage(q):
        fail(f"your code turned {watch.cast[1]} into integers ({watch.cast[0]}) ({name}): casting NaN or an infinity "
             "to int8 is undefined (0 on one CPU, any level on another). It came from a division by a zero scale: "
             "0 / 0 for an all-zero row, w / 0 = inf for a row whose scale underflows to 0. Guard the division: "
             "torch.where(scale > 0, scale, 1)")
    if (q == -128).any():
        r, c = (int(i) for i in (q == -128).nonzero()[0])
        per_128 = torch.allclose(scale.double(), absmax / 128, rtol=1e-5, atol=0)
        cause = ("your scale is max |w| / 128, so the row's largest entry becomes +-128; +128 does not fit in int8 "
                 "(it wraps around to -128). Divide by 127" if per_128 else
                 "clamp to (-127, 127), not (-128, 127), with scale = max |w| / 127")
        fail(f"q[{r}, {c}] = -128 ({name}): symmetric int8 uses the levels -127..127 only, so that -w quantizes to "
             f"-q and zero is exactly 0; {cause}")
    expected_scale = torch.where(_float32_scale(absmax) > 0, absmax / 127, 0.0)
    bad = (scale.double() - expected_scale).abs() > 1e-6 * expected_scale
    if bad.any():
        r = int(bad.nonzero()[0])
        got, want = scale[r].item(), expected_scale[r].item()
        factor = got / want if want else math.inf
        if abs(factor * 128 / 127 - 1) < 1e-5:
            hint = ": that is max |w| / 128; symmetric int8 divides by 127, its largest level"
        elif abs(factor * 255 / 127 - 1) < 1e-5:
            hint = ": that is max |w| / 255, the range of an asymmetric (zero-point) scheme; symmetric uses 127"
        elif abs(factor / 127 - 1) < 1e-5:
            hint = ": that is max |w| itself; divide it by 127, the largest level"
        elif abs(got - w[r].amax().item() / 127) <= 1e-6 * abs(want):
            hint = f": that is max w[{r}, :] / 127; take the largest magnitude, max |w[{r}, :]|, negative entries count too"
        elif inp == out and abs(got - w[:, r].abs().amax().item() / 127) <= 1e-6 * abs(want):
            hint = f": that is max |w[:, {r}]| / 127, over column {r} (an input channel); output channel {r} needs the max over row {r}"
        else:
            hint = ""
        fail(f"scale[{r}] should be max |w[{r}, :]| / 127 = {want:.6g}, got {got:.6g} ({name}){hint}")
    s = scale.double()
    error = (q.double() * s[:, None] - w).abs()
    too_far = (error > s[:, None] * (0.5 + 2e-4) + 1e-12 * w.abs()) & (s[:, None] > 0)  # a zero scale: q 0, checked
    ratio = w / torch.where(s > 0, s, 1.0)[:, None]
    ties = int8_rounding_ties(weight)
    if too_far.any():
        r, c = (int(i) for i in too_far.nonzero()[0])
        near_integer = (ratio - ratio.round()).abs() < 1e-4  # truncating or rounding: either may land there
        if bool(((q.double() == ratio.trunc()) | ties | near_integer).all()):
            frac = ratio.abs() - ratio.abs().floor()
            r, c = (int(i) for i in (frac > 0.5).nonzero()[0])
            fail(f"q looks truncated toward zero, not rounded ({name}): w[{r}, {c}] / scale = {ratio[r, c].item():.4g} "
                 f"became {int(q[r, c])}, an error of {frac[r, c].item():.2f} of a step. .to(torch.int8) truncates: "
                 "round first, torch.round(w / scale[:, None])")
        fail(f"q[{r}, {c}] = {int(q[r, c])} stands for q x scale = {q[r, c].item() * s[r].item():.6g}, but w[{r}, {c}] = "
             f"{w[r, c].item():.6g} ({name}): off by {error[r, c].item() / s[r].item():.3g} steps, more than half a step. "
             f"q should be round(w / scale) = round({ratio[r, c].item():.4g})")
    top = q.abs().amax(dim=1).int()
    short = (top != 127) & (expected_scale > 0)
    if short.any():
        r = int(short.nonzero()[0])
        fail(f"the largest |q| of row {r} is {int(top[r])}, expected 127 ({name}): each row's largest entry maps to "
             "+-127, the full range")
    q_ref, _ = int8_reference(weight)
    differ = (q != q_ref) & ~ties
    if differ.any():
        r, c = (int(i) for i in differ.nonzero()[0])
        fail(f"q[{r}, {c}] = {int(q[r, c])}, expected round(w / scale) = round({ratio[r, c].item():.6g}) = "
             f"{int(q_ref[r, c])} ({name})")


def check_quantize_int8(quantize_int8) -> None:
    """Visible checks for chapter 08, exercise 2: a (6, 10) weight whose rows differ in size by up to 2000x, a
    (4, 8) weight with an all-zero row and a row whose float32 scale underflows to 0 (largest |w| 1.4e-44), a
    float64 and a bfloat16 weight (the scale float32 for both), against the float64 formula and its properties."""
    g = torch.Generator().manual_seed(802)
    rows = torch.tensor([1.0, 0.02, 3.0, 0.5, 40.0, 0.1])
    weight = torch.randn(6, 10, generator=g) * rows[:, None]
    _check_quantized(quantize_int8, weight, "a (6, 10) float32 weight")
    weight = torch.randn(4, 8, generator=g)
    weight[2] = 0.0
    weight[3] = 1.4e-44 * torch.tensor([1.0, -0.5, 0.0, 1.0, 0.5, -1.0, 0.0, 0.5])  # float32 subnormals
    _check_quantized(quantize_int8, weight, "a (4, 8) float32 weight whose row 2 is all zeros and row 3 tiny, "
                     "largest |w| 1.4e-44")
    weight = torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.05
    _check_quantized(quantize_int8, weight, "a (5, 7) float64 weight")
    weight = (torch.randn(4, 6, generator=g) * 0.05).bfloat16()  # a bfloat16 scale would err by up to 0.4%
    _check_quantized(quantize_int8, weight, "a (4, 6) bfloat16 weight")
    passed("quantize_int8")


def _int8_pair(g, out: int, inp: int):
    """A random int8 weight (out, in) with levels -127..127, and float32 scales in [0.002, 0.02)."""
    q = torch.randint(-127, 128, (out, inp), generator=g, dtype=torch.int8)
    q[0, 0], q[-1, -1] = 127, -127  # the extremes
    return q, 0.002 + 0.018 * torch.rand(out, generator=g)


def _close(actual, expected) -> bool:
    if tuple(actual.shape) != tuple(expected.shape):
        return False
    return bool(((actual.double() - expected).abs() <= _atol(expected) + RTOL * expected.abs()).all())


def _atol(expected) -> float:
    """The course's atol, scaled by the outputs' magnitude when above 1 (the products are summed in float32)."""
    return ATOL * max(1.0, expected.abs().max().item())


def check_dequantize_int8(dequantize_int8) -> None:
    """Visible checks for chapter 08, exercise 3: a (5, 5) and a (6, 10) int8 weight, against the float64 product."""
    g = torch.Generator().manual_seed(803)
    for out, inp in ((5, 5), (6, 10)):
        q, scale = _int8_pair(g, out, inp)
        name = f"dequantize_int8(q, scale) for q ({out}, {inp})"
        w = call_learner(lambda: dequantize_int8(q, scale), name,
                         "scale has one entry per row of q, an output channel: broadcast it as scale[:, None]", Exception)
        assert_tensor(w, name)
        if not w.is_floating_point():
            fail(f"{name} returned {w.dtype}: the dequantized weight is real numbers, float32: "
                 "q.float() * scale[:, None] (do not cast the product back to q's dtype)")
        if w.dtype != torch.float32:
            fail(f"{name} returned {w.dtype}, expected torch.float32 (q.float() * scale[:, None])")
        assert_shape(w, (out, inp), name)
        expected = q.double() * scale.double()[:, None]
        if not _close(w, expected) and _close(w, q.double() * scale.double()[None, :]):
            fail(f"{name}: you scaled the columns, q * scale[None, :]: scale[o] belongs to output channel o, row o "
                 "of q: q * scale[:, None]")
        assert_close(w, expected, f"{name}, compared with q * scale[:, None] in float64")
    passed("dequantize_int8")


def check_int8_linear(int8_linear) -> None:
    """Visible checks for chapter 08, exercise 4: square and (6, 10) int8 weights, with and without a bias, inputs
    (5, in) and (2, 3, in), float32 and float64, against F.linear with the dequantized weight in float64."""
    g = torch.Generator().manual_seed(804)
    q, scale = _int8_pair(g, 8, 8)
    bias, x = torch.randn(8, generator=g), torch.randn(4, 8, generator=g)
    y = int8_linear(x, q, scale, bias)
    name = "int8_linear(x, q, scale, bias) for x (4, 8) and a square (8, 8) weight"
    assert_tensor(y, name)
    if y.dtype != x.dtype:
        fail(f"{name} returned {y.dtype} for x in {x.dtype}: the output should be in x's dtype (compute in it, "
             "q.to(x.dtype), or cast the result back)")
    assert_shape(y, (4, 8), name)
    xd, qd, sd, bd = x.double(), q.double(), scale.double(), bias.double()
    expected = F.linear(xd, qd * sd[:, None], bd)
    if not _close(y, expected):
        for wrong, explanation in (
            (F.linear(xd * sd, qd, bd), ("you multiplied x by the scale, along the input axis (or scaled the columns of "
                                         "q): scale[o] belongs to output channel o, row o of q. Scale the outputs, "
                                         "(x @ q.T) * scale, or the rows, q * scale[:, None]")),
            ((F.linear(xd, qd) + bd) * sd, ("you multiplied the bias by the scale too: the scale undoes the int8 "
                                            "levels of the weight, the bias is not quantized. Add it after scaling: "
                                            "(x @ q.T) * scale + bias")),
            (F.linear(xd, qd, bd), ("your output is x @ q.T + bias, without the scale: the int8 levels q stand for "
                                    "the weight q * scale[:, None]")),
            (xd @ (qd * sd[:, None]) + bd, ("you computed x @ W, not x @ W.T: a weight is (out, in), as in nn.Linear, "
                                            "so y = x @ W.T (F.linear(x, W))")),
            (xd @ qd * sd + bd, ("you computed x @ q, not x @ q.T: a weight is (out, in), as in nn.Linear, so "
                                 "y = (x @ q.T) * scale + bias")),
        ):
            if _close(y, wrong):
                fail(f"{name}: {explanation}")
    assert_close(y, expected, f"{name}, compared with F.linear(x, q * scale[:, None], bias) in float64",
                 atol=_atol(expected))
    q, scale = _int8_pair(g, 6, 10)
    bias = torch.randn(6, generator=g)
    for x, b, what, hint in (
        (torch.randn(5, 10, generator=g), bias, "x (5, 10) and a (6, 10) weight",
         "scale (out,) = (6,) goes with the outputs, not with x's 10 inputs: (x @ q.T) * scale"),
        (torch.randn(5, 10, generator=g), None, "x (5, 10) and bias=None",
         "a layer may have no bias (nn.Linear(..., bias=False), GPTConfig(bias=False)): add it only when it is not None"),
        (torch.randn(2, 3, 10, generator=g), bias, "x (2, 3, 10)",
         "x may have any number of leading dimensions (..., in): use @ or F.linear, which broadcast, not torch.mm"),
        (torch.randn(5, 10, generator=g, dtype=torch.float64), bias, "a float64 x (5, 10)", ""),
    ):
        name = f"int8_linear(x, q, scale, {'bias' if b is not None else 'None'}) for {what}"
        y = call_learner(lambda: int8_linear(x, q, scale, b), name, hint, Exception)
        assert_tensor(y, name)
        if y.dtype != x.dtype:
            fail(f"{name} returned {y.dtype}: the output should be in x's dtype, {x.dtype} (compute in it, "
                 "q.to(x.dtype), or cast the result back)")
        assert_shape(y, (*x.shape[:-1], 6), f"{name}, (..., out)")
        expected = F.linear(x.double(), q.double() * scale.double()[:, None], None if b is None else b.double())
        assert_close(y, expected, f"{name}, compared with F.linear(x, q * scale[:, None], bias) in float64",
                     atol=_atol(expected))
    passed("int8_linear")


# ---------------------------------------------------------------------------------------------------------
# exercise 5: an int8 model (Int8Linear and quantize_model)


def dequantized_copy(model):
    """The oracle of the int8 model: a float64 copy of `model` whose every nn.Linear weight is replaced by the
    float64 dequantized weight of ``int8_reference`` (biases, embeddings, LayerNorms as they are)."""
    oracle = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        for module in oracle.modules():
            if isinstance(module, torch.nn.Linear):
                q, scale = int8_reference(module.weight)
                module.weight = torch.nn.Parameter(q.double() * scale[:, None])  # untied from the embedding
    return oracle


def _small_gpt(seed: int):
    """A small course GPT with biases, its biases drawn large (N(0, 3)): float32, eval mode."""
    from course_lib.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=True)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 3.0)
    return model


def _check_int8_layer(layer, linear, name: str) -> None:
    """One quantized layer against the oracle: int8 buffers, per-channel absmax scales, rounding, bias, forward."""
    q, scale, bias = getattr(layer, "q", None), getattr(layer, "scale", None), getattr(layer, "bias", "missing")
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        fail(f"{name}: expected a buffer `q` holding the int8 levels, got {getattr(q, 'dtype', type(q).__name__)} "
             "(register_buffer('q', ...) with the int8 tensor of quantize_int8)")
    assert_shape(q, tuple(linear.weight.shape), f"{name}.q, (out, in)")
    kept = set(layer.state_dict())
    plain = [n for n in ("q", "scale", "bias") if n not in kept and (n != "bias" or linear.bias is not None)]
    if plain:
        what = "registered buffers" if len(plain) > 1 else "a registered buffer"
        fail(f"{name}: {', '.join(plain)} should be {what} (self.register_buffer({plain[0]!r}, ...)), not plain "
             "attributes: a plain attribute is not in the layer's state_dict (saving and loading the model lose it), "
             "and .to() or .double() leaves it behind")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        fail(f"{name}: expected a float32 buffer `scale`, got {getattr(scale, 'dtype', type(scale).__name__)}")
    w = linear.weight.detach().double()
    expected_q, expected_scale = int8_reference(linear.weight)
    if tuple(scale.shape) != (w.shape[0],) or (scale.numel() > 1 and bool((scale == scale.flatten()[0]).all())
                                                and not torch.allclose(scale.double(), expected_scale)):
        fail(f"{name}.scale: one scale for the whole matrix (shape {tuple(scale.shape)}); each output channel (row) "
             f"gets its own, max |row| / 127: shape ({w.shape[0]},)")
    if torch.allclose(scale.double(), w.abs().mean(dim=1) / 127, rtol=1e-5):
        fail(f"{name}.scale is mean |row| / 127: the scale comes from the row's largest weight, max |row| / 127, "
             "so that no weight is clipped")
    if not torch.allclose(scale.double(), expected_scale, rtol=1e-6, atol=0):
        fail(f"{name}.scale should be max |row| / 127 per output channel, {expected_scale[:3].tolist()}..., got "
             f"{scale[:3].tolist()}...")
    error = (q.double() * scale.double()[:, None] - w).abs()
    if not (error <= scale.double()[:, None] / 2 * (1 + 1e-5)).all():
        below = w - q.double() * scale.double()[:, None]  # >= 0 everywhere: every weight rounded down
        slack = 1e-4 * scale.double()[:, None]
        hint = (" (every weight was rounded down, q = floor(w / scale): round to the nearest level)" if (below >= -slack).all()
                else " (every weight was rounded towards zero: round to the nearest level, do not truncate)"
                if (below * w.sign() >= -slack).all() else " (round to the nearest level)")
        fail(f"{name}: a weight comes back {(error / (scale.double()[:, None] / 2)).max().item():.2f} half-steps "
             f"away, more than half a step{hint}")
    if linear.bias is None:
        if bias is not None:
            fail(f"{name}: the nn.Linear has no bias, so its Int8Linear should have bias None, got {bias!r}")
    else:
        if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
            fail(f"{name}: expected the bias kept as a float32 buffer `bias`, got "
                 f"{getattr(bias, 'dtype', type(bias).__name__)}: only the weight is quantized")
        if not torch.equal(bias, linear.bias.detach().float()):
            fail(f"{name}.bias differs from the nn.Linear's bias by up to {(bias - linear.bias).abs().max().item():.3g}: "
                 "the bias is not quantized, keep it as it is (in float32)")
    x = torch.randn(3, 2, linear.in_features)
    y = call_learner(lambda: layer(x), f"{name}(x) for x (3, 2, {linear.in_features})", "", Exception)
    assert_tensor(y, f"{name}(x)")
    expected = F.linear(x.double(), expected_q.double() * expected_scale[:, None],
                        None if linear.bias is None else linear.bias.double())
    assert_shape(y, tuple(expected.shape), f"{name}(x), (..., out)")
    if y.dtype != x.dtype:
        fail(f"{name}(x) returned {y.dtype} for a {x.dtype} x: the output should be in x's dtype")
    assert_close(y, expected, f"{name}(x), compared with F.linear(x, q * scale[:, None], bias) in float64",
                 atol=_atol(expected))
    y64 = call_learner(lambda: layer(x.double()), f"{name}(x) for a float64 x (3, 2, {linear.in_features})", "", Exception)
    assert_tensor(y64, f"{name}(x) for a float64 x")
    if y64.dtype != torch.float64:
        fail(f"{name}(x) returned {y64.dtype} for a float64 x: the output should be in x's dtype (cast q, scale and "
             "bias to x.dtype, not x to float32)")


def check_quantize_model(quantize_model) -> None:
    """Visible check for chapter 08, exercise 5: a small GPT with large biases quantized in place: no nn.Linear
    left, every replacement against the float64 oracle (int8 buffers, scales, rounding, bias, outputs), and the
    logits against a float64 copy whose matrices are the dequantized weights."""
    model = _small_gpt(805)
    original = {name: m for name, m in copy.deepcopy(model).named_modules() if isinstance(m, torch.nn.Linear)}
    oracle = dequantized_copy(model)
    result = call_learner(lambda: quantize_model(model), "quantize_model(gpt)", "", Exception)
    if result is not model:
        fail(f"quantize_model(gpt) returned {type(result).__name__}, not the model it was given: it quantizes in "
             "place and returns the same model")
    modules = dict(model.named_modules())
    left = [name for name, m in modules.items() if isinstance(m, torch.nn.Linear)]
    if left:
        fail(f"quantize_model left {len(left)} of the {len(original)} nn.Linear layers unquantized: {', '.join(left)}. "
             "Replace every nn.Linear, at any depth (model.modules() and setattr on each parent), the LM head too")
    for name, linear in original.items():
        if name not in modules:
            fail(f"after quantize_model, the model has no module {name!r}: replace each nn.Linear under its own name")
        _check_int8_layer(modules[name], linear, f"the quantized {name}")
    stored = sum(modules[name].q.numel() * modules[name].q.element_size() for name in original)
    weights = sum(linear.weight.numel() for linear in original.values())
    if stored != weights:
        fail(f"the int8 levels take {stored} bytes, expected one per weight, {weights}")
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    with torch.no_grad():
        logits, _ = call_learner(lambda: model(idx), "the quantized GPT's forward", "", Exception)
        expected, _ = oracle(idx)
    assert_close(logits, expected, "the quantized GPT's logits, compared with a float64 GPT whose matrices are "
                 "the dequantized weights", atol=_atol(expected))
    passed("quantize_model")


# ---------------------------------------------------------------------------------------------------------
# exercise 5: int4 with a scale and a minimum per group of inputs


def int4_reference(weight, group_size: int):
    """The float64 formula of asymmetric int4 with groups of `group_size` consecutive inputs of each row:
    minimum = the group's smallest weight, scale = (largest - smallest) / 15 (0 where it is 0 in float32),
    q = round((w - minimum) / scale) in 0..15 (0 where the scale is 0). Returns (q (out, in) int64, scale, minimum
    (out, in // group_size) float64)."""
    out, inp = weight.shape
    groups = weight.double().reshape(out, inp // group_size, group_size)
    minimum = groups.amin(dim=2)
    scale = (groups.amax(dim=2) - minimum) / 15
    scale = torch.where(scale.float() > 0, scale, torch.zeros_like(scale))
    ratio = (groups - minimum[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]
    return ratio.round().clamp(0, 15).long().reshape(out, inp), scale, minimum


def _int4_scale_in(weight, group_size: int):
    """(max - min) / 15 per group computed in the weight's own dtype (a bfloat16 learner's slip), as float32 numbers."""
    out, inp = weight.shape
    groups = weight.reshape(out, inp // group_size, group_size)
    return ((groups.amax(dim=2) - groups.amin(dim=2)) / 15).float()


def _int4_ratio(weight, group_size: int):
    """(w - minimum) / scale per entry, float64, (out, in): where it is within 1e-4 of a half, rounding may go either way."""
    _, scale, minimum = int4_reference(weight, group_size)
    out, inp = weight.shape
    groups = weight.double().reshape(out, inp // group_size, group_size)
    return ((groups - minimum[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]).reshape(out, inp)


def _int4_weight(g, out: int, inp: int, group_size: int, dtype=torch.float32):
    """A random weight whose groups differ in size by up to 10^3 (across a row and across rows), shifted off zero
    (so a group's minimum is not minus its largest), with one all-zero group and one constant group."""
    n = inp // group_size
    sizes = torch.logspace(-2, 1, out * n, dtype=torch.float64)[torch.randperm(out * n, generator=g)].reshape(out, n, 1)
    w = (torch.randn(out, n, group_size, generator=g, dtype=torch.float64) + 0.7) * sizes
    w[0, n - 1] = 0.0  # an all-zero group
    w[out - 1, 0] = 0.25  # a constant group: scale 0, its minimum the value
    if dtype == torch.float32:  # a group spanning 7e-45: (max - min) / 15 underflows to a float32 scale of 0
        w[out - 2, 0] = 7e-45 * (torch.arange(group_size) % 2)
    return w.reshape(out, inp).to(dtype)


def _check_int4_errors(quantize_int4) -> None:
    weight = torch.randn(4, 96)
    for group_size, what in ((16, "group_size 16 (below 32)"), (256, "group_size 256 (above 128)"),
                             (48, "group_size 48 (not one of 32, 64, 128)")):
        try:
            quantize_int4(weight, group_size)
        except ValueError as error:
            if "group_size" not in str(error):
                fail(f"quantize_int4(weight, {group_size}) raised ValueError({str(error)!r}), which does not name the "
                     "argument: say which argument is wrong, group_size, and what it may be (32, 64 or 128)")
            continue
        except Exception as error:  # noqa: BLE001 - any other error is the learner's to see
            fail(f"quantize_int4(weight, {group_size}) raised {type(error).__name__}: {error}; expected a ValueError "
                 f"naming group_size for {what}")
        fail(f"quantize_int4(weight, {group_size}) returned without an error: {what}; raise ValueError naming "
             "group_size and the sizes it may be (32, 64, 128)")
    try:
        quantize_int4(torch.randn(4, 80), 32)
    except ValueError as error:
        if "group_size" not in str(error) and "weight" not in str(error):
            fail(f"quantize_int4(weight (4, 80), 32) raised ValueError({str(error)!r}), which names neither weight "
                 "nor group_size: say that the weight's 80 inputs are not a multiple of group_size 32")
        return
    except Exception as error:  # noqa: BLE001
        fail(f"quantize_int4(weight (4, 80), 32) raised {type(error).__name__}: {error}; expected a ValueError: 80 inputs "
             "are not a multiple of group_size 32 (a last group of 16 would break the (out, in // group_size) layout)")
    fail("quantize_int4(weight (4, 80), 32) returned without an error: 80 inputs are not a multiple of group_size 32; "
         "raise ValueError naming weight or group_size")


def _check_int4(quantize_int4, weight, group_size: int, name: str) -> None:
    """One matrix: every property of asymmetric grouped int4, with a specific message for each classic mistake."""
    original = weight.clone()
    watch = _NonFiniteWatch()
    with watch:
        result = call_learner(lambda: quantize_int4(weight, group_size), f"quantize_int4(weight, {group_size})", "",
                              Exception)
    if not isinstance(result, tuple) or len(result) != 3:
        fail(f"quantize_int4 should return a tuple (q, scale, minimum), got {type(result).__name__}")
    q, scale, minimum = result
    for t, what in ((q, "q"), (scale, "scale"), (minimum, "minimum")):
        assert_tensor(t, f"{what} ({name})")
    if not torch.equal(weight, original):
        fail(f"quantize_int4 changed the weight it was given ({name}): compute new tensors, do not modify it in place")
    out, inp = weight.shape
    n = inp // group_size
    q_ref, s_ref, m_ref = int4_reference(weight, group_size)
    w = weight.double()
    assert_shape(q, (out, inp), f"q ({name}), one level per weight (out, in)")
    for t, what in ((scale, "scale"), (minimum, "minimum")):
        shape = tuple(t.shape)
        if shape in ((out,), (out, 1)):
            fail(f"{what} has shape {shape} ({name}): one {what} per row. Each group of {group_size} consecutive inputs of "
                 f"a row gets its own, shape (out, in // group_size) = ({out}, {n}): a row's groups differ in size here "
                 "by up to 10^3, and one scale per row leaves its small groups a level or two")
        if shape == (out // group_size, inp) or shape == (n, out):
            fail(f"{what} has shape {shape} ({name}): your groups run across the output axis (or the result is "
                 f"transposed). A group is {group_size} consecutive inputs of one row, w.reshape(out, in // group_size, "
                 f"group_size), reduced over its last axis: shape ({out}, {n})")
        if shape == (out, group_size) and group_size != n:
            fail(f"{what} has shape {shape} ({name}): you reduced over the wrong axis of w.reshape(out, in // group_size, "
                 "group_size): reduce within each group, over the last axis (dim=2), to get (out, in // group_size) = "
                 f"({out}, {n})")
        assert_shape(t, (out, n), f"{what} ({name}), one per group (out, in // group_size)")
        if t.dtype != torch.float32:
            fail(f"{what} should be float32, got {t.dtype} ({name}): return {what}.float()")
        if not torch.isfinite(t).all():
            fail(f"{what} has non-finite entries ({name}), e.g. {t[~torch.isfinite(t)][0].item()}")
    if not q.is_floating_point() and (q < 0).any():
        r, c = (int(i) for i in (q < 0).nonzero()[0])
        fail(f"q[{r}, {c}] = {int(q[r, c])} ({name}): negative levels, as in the symmetric scheme (llama.cpp's Q4_0: "
             "levels -8..7, scale max |w| / 8, no minimum). This exercise is the asymmetric one: levels 0..15 from the "
             "group's minimum, q = round((w - minimum) / scale) with scale = (max - min) / 15, stored as uint8")
    if q.dtype != torch.uint8:
        hint = (": round, then store the levels as unsigned bytes, .to(torch.uint8)" if q.is_floating_point() else
                ": the levels 0..15 are unsigned; store them as torch.uint8")
        fail(f"q should be uint8 (torch.uint8), got {q.dtype} ({name}){hint}")
    if (q > 15).any():
        r, c = (int(i) for i in (q > 15).nonzero()[0])
        wrapped = " (a uint8 cast wraps negative levels around to 255, 254, ...)" if int(q[r, c]) >= 240 else ""
        fail(f"q[{r}, {c}] = {int(q[r, c])} ({name}): 4 bits hold the levels 0..15 only{wrapped}. With the group's "
             "minimum at level 0 and scale = (max - min) / 15, q = round((w - minimum) / scale) lies in 0..15 "
             "(clamp to (0, 15) before the cast; a symmetric -8..7 scheme is llama.cpp's Q4_0, not this contract)")
    groups = w.reshape(out, n, group_size)
    m, s = minimum.double(), scale.double()
    if out > 1 and n > 1:
        per_row = (m == m[:, :1]).all() and (s == s[:, :1]).all()
        if per_row and not torch.allclose(s_ref, s_ref[:, :1].expand(-1, n)):
            fail(f"every group of a row got the same scale and minimum ({name}): one per row, not per group. Each group of "
                 f"{group_size} consecutive inputs gets its own: here a row's groups differ in size by up to 10^3")
    strided = w.reshape(out, group_size, n)  # every n-th input: groups that interleave
    if not torch.allclose(m, m_ref, rtol=1e-6, atol=1e-30) and torch.allclose(m, strided.amin(dim=1), rtol=1e-6, atol=1e-30):
        fail(f"minimum ({name}) is the minimum of every {n}-th input of the row (w.reshape(out, group_size, in // "
             "group_size) reduced over dim 1): a group is group_size CONSECUTIVE inputs, w.reshape(out, in // group_size, "
             "group_size) reduced over dim 2 (the layout llama.cpp, GPTQ and AWQ use)")
    bad = (m - m_ref).abs() > 1e-6 * m_ref.abs() + 1e-30
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        hint = (": you took the smallest magnitude, min |w|; the minimum is the smallest value, negative entries "
                "included" if abs(m[r, c] - groups[r, c].abs().min()) <= 1e-6 * abs(m_ref[r, c]) + 1e-30 else
                ": that is minus the largest |w|, a symmetric range; this scheme is asymmetric: the group's own "
                "smallest value, so no level is wasted on values the group does not have"
                if abs(m[r, c] + groups[r, c].abs().max()) <= 1e-6 * abs(m_ref[r, c]) + 1e-30 else
                ": that is a zero point in levels, round(-minimum / scale), as GPTQ and AWQ store it; this contract "
                "stores the minimum itself, a float32 weight" if s_ref[r, c] > 0 and m[r, c] == torch.round(
                    -m_ref[r, c] / s_ref[r, c]) and m[r, c] != m_ref[r, c] else "")
        fail(f"minimum[{r}, {c}] should be the smallest weight of group {c} of row {r}, {m_ref[r, c].item():.6g}, got "
             f"{m[r, c].item():.6g} ({name}){hint}")
    span = groups.amax(dim=2) - m_ref
    bad = ((s - s_ref).abs() > 1e-6 * (s_ref + (groups.abs().amax(dim=2)) / 15)) & (s_ref > 0)
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        got, want = s[r, c].item(), s_ref[r, c].item()
        hint = (": that is (max - min) / 16; 16 levels have 15 steps between them, divide by 15"
                if abs(got * 16 / 15 / want - 1) < 1e-5 else
                ": that is max |w| / 7.5 or / 7, a symmetric scale; here the scale spans the group's own range, "
                "(max - min) / 15" if min(abs(got * 7.5 / groups[r, c].abs().max().item() - 1),
                                          abs(got * 7 / groups[r, c].abs().max().item() - 1)) < 1e-5 else
                ": that is max - min itself; divide it by 15, the number of steps" if abs(got / want / 15 - 1) < 1e-5 else
                f": that is (max - min) / 15 computed in {weight.dtype}, rounded to its few bits of precision; convert "
                "the weight to float32 first (weight.float()), then reduce and divide"
                if weight.dtype in (torch.bfloat16, torch.float16) and got == _int4_scale_in(weight, group_size)[r, c] else "")
        fail(f"scale[{r}, {c}] should be (max - min) / 15 of group {c} of row {r} = {want:.6g}, got {got:.6g} ({name}){hint}")
    for r, c in ((scale == 0) & (s_ref > 0)).nonzero().tolist():
        fail(f"scale[{r}, {c}] is 0 ({name}) though that group's weights differ")
    constant = s_ref == 0
    for r, c in constant.nonzero().tolist():
        levels = q[r, c * group_size:(c + 1) * group_size]
        if scale[r, c] != 0 or (levels != 0).any():
            values = sorted(set(groups[r, c].tolist()))
            what = (f"holds one value, {values[0]:.4g}, {group_size} times: its scale (max - min) / 15 is 0" if len(values) == 1
                    else f"spans only {values[-1] - values[0]:.2g}: its scale (max - min) / 15 underflows to 0 in float32")
            fail(f"group {c} of row {r} {what} ({name}), so it should get scale 0 and q 0 (its minimum stands for "
                 f"the group); got scale {scale[r, c].item():.4g} and levels {sorted(set(levels.tolist()))}. Dividing by "
                 "that zero scale gives 0 / 0 = NaN or x / 0 = inf: divide such a group by 1 instead, "
                 "torch.where(scale > 0, scale, 1), a guard on the float32 scale itself")
    if watch.garbage(q):
        fail(f"your code turned {watch.cast[1]} into integers ({watch.cast[0]}) ({name}): casting NaN or an infinity "
             "to uint8 is undefined (0 on one CPU, any level on another). It came from a division by a zero scale, "
             "0 / 0 in a group whose entries are all equal: divide such a group by 1, torch.where(scale > 0, scale, 1)")
    ratio = _int4_ratio(weight, group_size)
    ties = ((ratio - ratio.floor()) - 0.5).abs() < 1e-4
    back = (q.double().reshape(out, n, group_size) * s[..., None] + m[..., None]).reshape(out, inp)
    step = s.repeat_interleave(group_size, dim=1)
    too_far = ((back - w).abs() > step * (0.5 + 2e-4) + 1e-6 * w.abs()) & (step > 0)
    if too_far.any():
        r, c = (int(i) for i in too_far.nonzero()[0])
        near_integer = (ratio - ratio.round()).abs() < 1e-4  # truncating or rounding: either may land there
        if bool(((q.long() == ratio.floor().clamp(0, 15).long()) | ties | near_integer
                 | constant.repeat_interleave(group_size, 1)).all()):
            frac = ratio - ratio.floor()
            r, c = (int(i) for i in ((frac > 0.5) & ~ties).nonzero()[0])
            fail(f"q looks truncated, not rounded ({name}): (w - minimum) / scale = {ratio[r, c].item():.4g} at [{r}, {c}] "
                 f"became {int(q[r, c])}, an error of {frac[r, c].item():.2f} of a step. .to(torch.uint8) truncates: "
                 "round first, torch.round((w - minimum) / scale)")
        fail(f"q[{r}, {c}] = {int(q[r, c])} stands for q x scale + minimum = {back[r, c].item():.6g}, but w[{r}, {c}] = "
             f"{w[r, c].item():.6g} ({name}): more than half a step away. q should be round((w - minimum) / scale) = "
             f"round({ratio[r, c].item():.4g})")
    differ = (q.long() != q_ref) & ~ties
    if differ.any():
        r, c = (int(i) for i in differ.nonzero()[0])
        fail(f"q[{r}, {c}] = {int(q[r, c])}, expected round((w - minimum) / scale) = {int(q_ref[r, c])} ({name})")
    for level, where in ((0, "smallest"), (15, "largest")):
        hit = (q.reshape(out, n, group_size) == level).any(dim=2) | constant
        if not hit.all():
            r, c = (int(i) for i in (~hit).nonzero()[0])
            fail(f"no weight of group {c} of row {r} got level {level} ({name}): the group's {where} weight maps to "
                 f"{level}, so that its 16 levels span its range")


def check_quantize_int4(quantize_int4) -> None:
    """Visible checks for chapter 08, exercise 5: weights whose groups differ in size by 10^3, with an all-zero and a
    constant group, in float32, float64 and bfloat16, groups of 32 and 64, against the float64 formula
    (``int4_reference``); and a ValueError naming group_size for 16, 48, 256, and for inputs not a multiple of it."""
    g = torch.Generator().manual_seed(805)
    for (out, inp, group_size, dtype) in ((6, 128, 32, torch.float32), (4, 128, 64, torch.float64),
                                          (3, 64, 32, torch.bfloat16)):
        weight = _int4_weight(g, out, inp, group_size, dtype)
        _check_int4(quantize_int4, weight, group_size, f"a ({out}, {inp}) {str(dtype)[6:]} weight, groups of {group_size}")
    _check_int4_errors(quantize_int4)
    passed("quantize_int4")
