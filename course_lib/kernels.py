"""The faster matrix-vector kernel for each weight, and the faster thread count for a pass, measured on this machine.

A decode step multiplies a few rows (one new token per sequence) by every weight matrix, so it costs
about the time to read the weights. PyTorch ships two CPU kernels for the float32 product ``x W^T + b``:
``F.linear``, which calls MKL's ``sgemm``, and oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``).
Which reads a given weight faster depends on the CPU, on the weight's shape, on the number of rows and on
the thread count: on an AMD EPYC, oneDNN read GPT-2 small's LM head about twice as fast as ``sgemm``
with two threads; on an Intel Xeon, ``sgemm`` reads near the bandwidth limit. No
rule chosen on one machine holds on the other, so ``linear`` measures both the first time it meets a
(weight shape, bias or not, rows, threads, model size) combination and keeps the faster one for the process.

``use_fastest_kernels(model)`` makes every ``nn.Linear`` of a model run through ``linear`` (the model's
parameters, state dict and outputs stay the same, within float32 rounding): the benchmarks and the chapters
that time decoding against Hugging Face call it on our models. Chapter 05's KV cache reads as the cache
alone; it runs whatever its model's linear layers do.

Set ``COURSE_LINEAR_KERNEL`` to ``F.linear`` or ``oneDNN`` to force one kernel (``auto``, the default,
measures). Everything that is not a float32 product on the CPU of 1 to ``MEASURED_ROWS`` rows, with no
gradient to track (backward or forward), no autocast, no ``torch.func`` transform and no ``torch.compile`` (training,
other dtypes, other devices, a prefill of many tokens), runs ``F.linear``. Which kernel a product runs is measured,
so two runs may round differently (within float32 rounding): compare outputs with a tolerance, and tokens only where
the winning logit leads by a margin.

The thread count is chosen the same way, by measuring (chapter 12's engine asks before each pass): ``ThreadChoice``
times one thread against the caller's on a probe and keeps the answer until it goes stale. ``threads(n)`` is the
library's one way to run a block on n torch threads.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

from .validation import check_positive

#: Products of more rows than this (a long prefill) are compute-bound, and run ``F.linear`` unmeasured.
MEASURED_ROWS = 64
#: The seconds of timed calls of each kernel (at least one call) in each of ``ROUNDS`` rounds of a measurement.
BUDGET_S = 0.002
ROUNDS = 3
#: The most bytes a measurement cycles through (more than a CPU's caches: each read then comes from memory),
#: and what it cycles through when it does not know the model's size.
COLD_BYTES = 128 * 2**20

ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
KERNEL_NAMES = ("F.linear", "oneDNN")


def onednn_linear(x, weight, bias=None):
    """oneDNN's inner product: the same (..., in) -> (..., out) product as ``F.linear`` (float32, CPU)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


KERNELS = {"F.linear": F.linear, "oneDNN": onednn_linear}


class Choice(NamedTuple):
    """What a kernel choice is kept under, for this process."""
    out_features: int
    in_features: int
    bias: bool
    rows: int  # the bucket: 1, 2, 4, 8, ... up to MEASURED_ROWS
    threads: int
    cycle_bytes: int  # the bytes cycled through while measuring (at most COLD_BYTES)


_chosen: dict[Choice, str] = {}  # -> kernel name
_chosen_among: dict[tuple, str] = {}  # ``choose_faster``'s: (*key, threads) -> name
#: This process's choices until the next ``forget_choices`` (which makes a new one): part of the signature a module's
#: kept kernel holds under. An object, not a count: a module pickled or deep-copied keeps a copy, equal to no era, so a
#: module saved by another process (another machine, another COURSE_LINEAR_KERNEL) asks ``choose`` again
_era = object()


def _forced() -> str:
    forced = os.environ.get("COURSE_LINEAR_KERNEL", "auto")
    if forced not in ("auto", *KERNEL_NAMES):
        raise ValueError(f"COURSE_LINEAR_KERNEL must be 'auto', 'F.linear' or 'oneDNN', got {forced!r}")
    return forced


def rows_bucket(rows: int) -> int:
    """The power of two at or above `rows`: the products of 5 to 8 rows share one measurement."""
    return 1 << max(0, rows - 1).bit_length()


def _seconds(run, calls: int = 1) -> float:
    """Seconds per call of `calls` calls of run."""
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def measure(weight, bias, x, cycle_bytes: int = COLD_BYTES) -> dict[str, float]:
    """Seconds per call of each kernel on this product: {kernel name: seconds}, the best of ROUNDS rounds in
    which the kernels take turns (so that a burst of background load hits both).

    A decode step reads each weight once, then all the model's other weights before it reads this one again:
    from memory when the model outsizes the caches, from a cache when it is small. A loop over one weight would
    always read it from a cache, and could rank the kernels by a speed no decode step of a large model sees.
    So each timed call reads the next of several copies of the weight, cycle_bytes in all (the model's weights),
    or COLD_BYTES if fewer (enough to come from memory); at least one copy.
    """
    copies = max(1, math.ceil(min(cycle_bytes, COLD_BYTES) / (weight.numel() * weight.element_size())))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    with torch.no_grad():
        for kernel in KERNELS.values():
            kernel(x, weight, bias)  # warm-up: first-call overheads (one copy: what is timed is a read from memory)
        runs = {name: (lambda kernel=kernel: [kernel(x, w, bias) for w in weights]) for name, kernel in KERNELS.items()}
        return {name: seconds / copies for name, seconds in _best_of_rounds(runs).items()}


def _best_of_rounds(runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds per call of each of `runs` ({name: a call}), warmed up: the best of ROUNDS rounds in which the runs take
    turns, each timed for about BUDGET_S (at least one call). A first probe of one call each sets the calls per round;
    where every run gets one call, the probe is the first round (a round of a large model's copies is not repeated)."""
    probe = {name: _seconds(run) for name, run in runs.items()}  # one call each, in turn
    calls = {name: max(1, min(1000, int(BUDGET_S / max(seconds, 1e-7)))) for name, seconds in probe.items()}
    if all(n == 1 for n in calls.values()):
        times, rounds = dict(probe), ROUNDS - 1
    else:
        times, rounds = {name: math.inf for name in runs}, ROUNDS
    for _ in range(rounds):
        for name, run in runs.items():
            times[name] = min(times[name], _seconds(run, calls[name]))
    return times


def _transformed() -> bool:
    """Whether forward-mode gradients (a ``torch.autograd.forward_ad`` dual level, ``torch.func.jvp``), another
    ``torch.func`` transform (vmap, grad) or ``torch.compile``'s tracing is active: oneDNN's op has no forward
    derivative (it drops the tangent, silently), no batching rule, and Inductor cannot lower it as ``onednn_linear``
    calls it."""
    return (forward_ad._current_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None
            or torch.compiler.is_compiling())


def _eligible(weight, bias, x) -> bool:
    """A float32 product of dense tensors on the CPU (oneDNN's op takes no sparse ones), with no gradient to track
    (oneDNN's op has no backward), no autocast and no ``_transformed`` state."""
    tensors = (weight, x) if bias is None else (weight, bias, x)
    return (ONEDNN_AVAILABLE and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.layout == torch.strided
                                     for t in tensors)
            and weight.dim() == 2 and x.dim() >= 2 and x.numel() > 0
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.is_autocast_enabled("cpu") and not _transformed())


def choose(weight, bias, x, cycle_bytes: int = COLD_BYTES) -> str:
    """The kernel ``linear`` runs for this product: "F.linear" or "oneDNN" (measured once per combination, as
    ``measure`` does with cycle_bytes: the bytes of the model the weight belongs to)."""
    rows = x.numel() // max(1, x.shape[-1])
    if not _eligible(weight, bias, x) or rows > MEASURED_ROWS:
        return "F.linear"
    forced = _forced()
    if forced != "auto":
        return forced
    cycle = min(cycle_bytes, COLD_BYTES)
    key = Choice(*weight.shape, bias is not None, rows_bucket(rows), torch.get_num_threads(), cycle)
    if key not in _chosen:
        times = measure(weight, bias, x, cycle)
        _chosen[key] = min(times, key=times.get)
    return _chosen[key]


def _signature(module: nn.Linear, weight, bias, x) -> tuple:
    """What ``choose``'s answer for this product depends on, but COURSE_LINEAR_KERNEL: the tensors' shapes, dtypes,
    devices, layouts and gradient needs, gradient mode, autocast, forward gradients and transforms (``_transformed``),
    threads, the bytes cycled, ``forget_choices`` and the process (``_era``). A tuple built in about 3 us (a busy
    2-core machine, one thread), where ``choose`` takes about 8 (it reads the environment)."""
    return (x.shape, x.dtype, x.device, x.layout, x.requires_grad, weight.shape, weight.dtype, weight.device,
            weight.layout, weight.requires_grad,
            None if bias is None else (bias.dtype, bias.device, bias.layout, bias.requires_grad),
            torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), _transformed(), torch.get_num_threads(),
            getattr(module, "cycle_bytes", COLD_BYTES), _era)


def linear(module: nn.Linear, x):
    """``module(x)`` through the faster kernel for its shape on this machine: (..., in) -> (..., out).

    The module keeps its last product's kernel under that product's ``_signature`` (a decode step's products repeat
    theirs), and asks ``choose`` again when the signature differs: a weight replaced or changed in shape, dtype or
    device, another number of rows, gradients (forward ones too), threads, ``forget_choices``, another process (a module
    unpickled). A COURSE_LINEAR_KERNEL set while the process runs holds for the modules from the next
    ``forget_choices``."""
    weight, bias = module.weight, module.bias
    signature = _signature(module, weight, bias, x)
    kept = module.__dict__.get("_kernel_kept")
    if kept is None or kept[0] != signature:
        kernel = choose(weight, bias, x, getattr(module, "cycle_bytes", COLD_BYTES))
        kept = module.__dict__["_kernel_kept"] = (signature, KERNELS[kernel])
    return kept[1](x, weight, bias)


def chosen_kernels() -> dict[Choice, str]:
    """What ``linear`` chose so far: {Choice(out, in, bias?, rows bucket, threads, bytes cycled): kernel name}."""
    return dict(_chosen)


def forget_choices() -> None:
    """Measure again from the next call (after the machine's load or thread count, or COURSE_LINEAR_KERNEL, changed)."""
    global _era
    _chosen.clear()
    _chosen_among.clear()
    _era = object()  # what ``linear``'s modules kept is stale


def choose_faster(key: tuple, runs: dict[str, Callable[[], object]], forced: str = "auto") -> str:
    """The name of the fastest of `runs` ({name: a call of one kernel on one product}), measured the first time
    `key` (what the product is: its shapes, format, ...) is met at this thread count, and kept for the process.

    ``measure``'s way for the other kernel choices (int4's: PyTorch's int4 kernel or a dequantize-and-multiply;
    bfloat16's: F.linear or oneDNN packed): one warm-up call each, then ``_best_of_rounds``.
    forced: "auto" measures; a name of `runs` is returned unmeasured (ValueError for any other)."""
    if forced != "auto":
        if forced not in runs:
            raise ValueError(f"forced must be 'auto' or one of {sorted(runs)}, got {forced!r}")
        return forced
    full_key = (*key, torch.get_num_threads())
    if full_key not in _chosen_among:
        with torch.no_grad():
            for run in runs.values():
                run()  # warm-up: first-call overheads
            times = _best_of_rounds(runs)
        _chosen_among[full_key] = min(times, key=times.get)
    return _chosen_among[full_key]


def chosen_among() -> dict[tuple, str]:
    """What ``choose_faster`` chose so far: {(*key, threads): name}."""
    return dict(_chosen_among)


class FastLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs ``linear``: the same parameters and state dict, the faster kernel."""

    def forward(self, x):
        return linear(self, x)


def use_fastest_kernels(model: nn.Module, rows=(1,)) -> nn.Module:
    """Make every plain ``nn.Linear`` of `model` a ``FastLinear``, in place, and measure now, for products of each
    number of `rows`, which kernel each of its weights runs (so that no later timed run pays for it); returns the model.

    The parameters are the same objects (tied weights stay tied), the state dict is unchanged, and so is every
    output, within float32 rounding. rows: the row counts to measure now, e.g. the batch sizes of the decode
    steps to come; others are measured when first met.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
    fast = [m for m in model.modules() if isinstance(m, FastLinear)]
    weights = {id(m.weight): m.weight for m in fast}  # a tied weight once
    model_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    for module in fast:
        module.cycle_bytes = model_bytes  # what a decode step reads between two reads of this weight
    with torch.no_grad():  # the decode steps to come run without gradients
        for module in fast:
            for n in rows:
                x = torch.zeros(n, module.in_features, dtype=module.weight.dtype, device=module.weight.device)
                choose(module.weight, module.bias, x, model_bytes)
    return model


#: The two products a bfloat16 nn.Linear can run; ``use_fastest_bf16_kernels`` measures which is faster here.
BF16_KERNELS = ("F.linear", "oneDNN packed")
BF16_PACKED_AVAILABLE = ONEDNN_AVAILABLE and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """A bfloat16 nn.Linear for inference through oneDNN's inner product on its weight reordered once into oneDNN's
    blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the way ``torch.compile`` packs CPU weights):
    x (..., in) -> (..., out), F.linear's product within bfloat16 rounding, no gradient. The reordered weight is the
    buffer ``packed`` (the same bytes as the weight, in another order), the bias ``bias``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@functools.cache
def bf16_packing_runs() -> bool:
    """Whether this CPU can run ``PackedLinear``: oneDNN's op exists and reorders a bfloat16 weight here (it refuses
    on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, or with oneDNN held below them by ONEDNN_MAX_CPU_ISA)."""
    if not BF16_PACKED_AVAILABLE:
        return False
    try:
        PackedLinear(nn.Linear(16, 16, dtype=torch.bfloat16))(torch.zeros(1, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def use_fastest_bf16_kernels(model: nn.Module) -> nn.Module:
    """Make every bfloat16 nn.Linear of `model` a ``PackedLinear``, in place, where ``choose_faster`` measured the packed
    layers faster than F.linear on one-row products (a decode step's) at this thread count; returns the model.

    One choice per weight shape (out, in, bias or not): the runs compared are one row through every layer of the
    model of that shape in turn, as a step reads them (a loop over one weight would read it from a cache, and can rank
    the kernels by a speed no step of a large model sees). ``COURSE_BF16_KERNEL`` ("auto", or one of BF16_KERNELS)
    forces the choice. Where ``bf16_packing_runs`` is False, F.linear stays everywhere. For inference only."""
    forced = os.environ.get("COURSE_BF16_KERNEL", "auto")
    if forced not in ("auto", *BF16_KERNELS):
        raise ValueError(f"COURSE_BF16_KERNEL must be 'auto' or one of {list(BF16_KERNELS)}, got {forced!r}")
    if not bf16_packing_runs():
        return model
    shapes: dict[tuple, list] = {}  # (out, in, bias?) -> [(parent, name, layer)]
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:  # a FastLinear too
                shapes.setdefault((child.out_features, child.in_features, child.bias is not None), []).append(
                    (module, name, child))
    for (out_features, in_features, bias), layers in shapes.items():
        plain = [child for _, _, child in layers]
        packed = [PackedLinear(child) for child in plain]
        x = torch.zeros(1, in_features, dtype=torch.bfloat16)
        runs = {BF16_KERNELS[0]: lambda plain=plain, x=x: [m(x) for m in plain],
                BF16_KERNELS[1]: lambda packed=packed, x=x: [m(x) for m in packed]}
        if choose_faster(("bfloat16", out_features, in_features, bias), runs, forced) == BF16_KERNELS[1]:
            for (module, name, _), layer in zip(layers, packed):
                setattr(module, name, layer)
    return model


# ----------------------------------------------------------------------------------------------------
# threads


@contextlib.contextmanager
def threads(n: int):
    """Run the block with n torch threads (n >= 1), then restore the count it found, even on an error, and even if the
    block set another; yields n.

    The count is set only if it differs (a step's small operations ask for the count they already have)."""
    check_positive("threads", n)
    previous = torch.get_num_threads()
    if n != previous:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


#: Multiply-adds of one layer's linear products in a pass (tokens x 12 C^2) below which the pass runs on one thread.
#: Intra-op threads pay only when an operation's work outweighs waking and joining them; a decode step of a small
#: model is hundreds of operations of microseconds, and each parallel one waits for every thread, on a busy machine
#: for a descheduled thread's time slice (measured here: the course model's engine 25 times slower at 2 threads
#: than at 1 on a loaded 2-core machine). Above it (GPT-2 small's width from 3 tokens) ``ThreadChoice`` measures.
ONE_THREAD_WORK = 2 ** 24


@dataclass
class ThreadProbe:
    """One probe of ``ThreadChoice``: the thread count it chose for passes of its rows, and what it cost."""

    rows: int
    threads: int
    seconds: float  # what the whole probe took, both counts' calls
    credit: float = 0.0  # seconds the model's passes have taken since
    fastest: dict = field(default_factory=dict)  # rows -> the fewest seconds per token of a pass it decided, since
    slow: int = 0  # the passes in a row it decided that were slow (see ``ThreadChoice.record``)


class ThreadChoice:
    """Whether one thread or the caller's n run a model's passes faster now (it depends on the pass's size and on the
    machine's load, which changes): a timed probe decides, and holds until the passes' time or a stall makes it stale.

    Probes are kept per model and caller's thread count (``pick``'s `model`, `n`); `clock`: seconds (a test's fake).
    """

    def __init__(self, explore: float = 20.0, calls: int = 5, margin: float = 1.2, stall: float = 2.0,
                 stall_passes: int = 2, clock: Callable[[], float] = time.perf_counter):
        self.explore, self.calls, self.margin, self.stall, self.stall_passes = explore, calls, margin, stall, stall_passes
        self.clock = clock
        self.probes: dict = {}  # (model, n) -> {rows: its latest ThreadProbe}

    def pick(self, model: tuple, rows: int, n: int, probe: Callable[[], object]) -> ThreadProbe:
        """The probe that decides a pass of `rows` rows of `model` (its ``threads``: 1 or n), probed now if need be.

        A fresh probe speaks for its rows, and also for fewer if it chose one thread, for more if it chose n (a
        larger pass gains more from threads); the nearest in rows decides. If none speaks, ``probe()`` (one block of
        the model on the pass's rows) runs at 1 and n threads in turn, up to ``calls`` times: n threads win a call if
        ``margin`` times their seconds beat one thread's; n are chosen if they win more than half of the calls, one
        thread otherwise, and the probing stops as soon as that is decided."""
        kept = self.probes.setdefault((model, n), {})
        speaks = [p for p in kept.values() if p.credit < self.explore * p.seconds
                  and (p.rows == rows or (p.rows > rows and p.threads == 1) or (p.rows < rows and p.threads > 1))]
        if speaks:
            return min(speaks, key=lambda p: abs(math.log2(p.rows / rows)))
        start, wins = self.clock(), 0
        for calls in range(1, self.calls + 1):
            seconds = {}
            for count in (1, n):
                with threads(count):
                    begin = self.clock()
                    probe()
                    seconds[count] = self.clock() - begin
            wins += seconds[n] * self.margin < seconds[1]
            if 2 * wins > self.calls or 2 * (calls - wins) >= self.calls:
                break
        kept[rows] = ThreadProbe(rows, n if 2 * wins > self.calls else 1, self.clock() - start)
        return kept[rows]

    def record(self, model: tuple, n: int, decided_by: ThreadProbe, rows: int, tokens: int, seconds: float) -> None:
        """A pass of `model` (caller's count n) of `tokens` tokens (`rows`: rounded up to a power of two) took
        `seconds` on the thread count `decided_by` chose.

        Probes go stale two ways: once the model's passes have taken ``explore`` times what a probe took (probing
        then costs about 1 / explore of the time, and a machine that became quiet is noticed); and on a stall:
        ``stall_passes`` passes in a row on n threads, each ``stall`` times slower per token than the fastest pass of
        its rows the same probe decided, stale every probe of the model that chose n (load has come). Passes are
        compared with passes, not with the probe, which reads no cache and runs no LM head; and more than one,
        as one burst, or one pass of another mix of prompt chunks and decodes, can be that slow."""
        kept = self.probes.get((model, n), {})
        for p in kept.values():
            p.credit += seconds
        if decided_by.threads > 1:
            per_token, fastest = seconds / tokens, decided_by.fastest.get(rows, math.inf)
            decided_by.slow = decided_by.slow + 1 if per_token > self.stall * fastest else 0
            if decided_by.slow >= self.stall_passes:
                for p in kept.values():
                    if p.threads > 1:
                        p.credit = math.inf
            decided_by.fastest[rows] = min(fastest, per_token)


THREAD_CHOICE = ThreadChoice()  # the process's measurements (chapter 12's ``paged_forward`` asks it)
