"""``course bench decode``: greedy decoding speed of ours against Hugging Face's ``generate``, same weights.

``bench_decode``: tokens per second of our cached decoding (``course_lib.kv_cache.generate_cached``) with float32,
int8, bfloat16 and int4 weights (``course_lib.quantize``), our uncached decoding (a full forward pass per token), and Hugging
Face's ``generate`` with ``use_cache`` True and False; beside them the memory-bandwidth bound of each weight format
(``read_bandwidth``, which chapter 08 uses too). ``bench_llama_decode``: chapter 11's Llama-style model
(``course_lib.llama.generate_llama``) against Hugging Face's ``LlamaForCausalLM`` with the same weights.
``bench_decode_threads`` (``--thread-counts``): the cached rows at several thread counts side by side, what each buys.
"""
from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn.functional as F

from ..gpt import GPT, GPTConfig, extend, gpt_logits, greedy_choice
from ..kernels import (ONEDNN_AVAILABLE, chosen_among, chosen_kernels, onednn_linear, use_fastest_bf16_kernels,
                       use_fastest_kernels)
from ..kv_cache import generate_cached
from ..quantize import (INT4_GROUP_SIZE, decode_weight_bytes, dequantize_int4, int8_product, quantize_int4, quantize_int8,
                        quantize_weights)
from . import timing
from .hf_adapters import hf_generate

#: Model shapes of ``course bench decode`` (random weights, context 1024 so that 16 + 256 tokens fit).
DECODE_SHAPES = {
    "tiny": dict(vocab_size=103, block_size=1024, n_layer=4, n_head=4, n_embd=128),  # char-gpt's shape
    "gpt2-small": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}
#: New tokens of the uncached rows: a full forward pass per token costs O(context) per step, so the
#: uncached rows generate fewer tokens (tokens/s is compared with HF at the same length, never across lengths)
UNCACHED_TOKENS = {"tiny": 64, "gpt2-small": 16}
#: The shape and batch size whose rows get the memory-bandwidth bound
BOUND_SHAPE, BOUND_BATCH = "gpt2-small", 1
#: The share of its bound each weight format's cached row aims for at BOUND_SHAPE, BOUND_BATCH
BOUND_TARGETS = {"float32": 0.8, "int8": 0.6, "bfloat16": 0.6}
#: New tokens of a warm-up run (at most: fewer where the timed runs generate fewer)
WARMUP_TOKENS = 8
#: Timed repeats by default
REPEATS = 5

#: Llama-style shapes of ``course bench decode`` (random weights): char-llama's, and a 12-layer model of GPT-2 small's
#: width with 4 key/value heads and a 32,000-token vocabulary (Llama's)
LLAMA_DECODE_SHAPES = {
    "tiny": dict(vocab_size=103, block_size=1024, n_layer=4, n_head=4, n_embd=128, n_kv_head=2, intermediate_size=352),
    "llama-small": dict(vocab_size=32000, block_size=1024, n_layer=12, n_head=12, n_embd=768, n_kv_head=4,
                        intermediate_size=2048),
}
#: the Llama shape that `--shapes` runs for each GPT shape (the same width and depth)
LLAMA_FOR_GPT_SHAPE = {"tiny": "tiny", "gpt2-small": "llama-small"}
#: New tokens of the Llama rows at most (``course bench decode --tokens`` beyond it is cut to it)
LLAMA_MAX_TOKENS = 128


@torch.inference_mode()
def greedy_uncached(model, idx, max_new_tokens: int):
    """Greedy decoding without a cache: every step runs the blocks over the whole sequence so far and
    the LM head over its last position only. (B, T) -> (B, T + max_new_tokens)."""
    return extend(idx, max_new_tokens, lambda tokens, new: gpt_logits(model, tokens, at=-1), greedy_choice)


#: The input widths ``read_bandwidths`` reads a tensor as, as a weight (out, in): GPT-2 small's (n_embd, 4 n_embd).
READ_WIDTHS = (768, 3072)


def read_bandwidths(nbytes: int, repeats: int = 3, threads=(1, 2), widths=READ_WIDTHS) -> dict[tuple[str, int], float]:
    """Read bandwidth in bytes/s of each way this machine can read the same float32 tensor of about nbytes bytes.

    The ways: its sum (``tensor.sum()``), and a matrix-vector product with it as a weight (nbytes / 4 / width,
    width), for each width, through ``F.linear`` (MKL's sgemm) and through oneDNN's inner product (the two kernels
    ``course_lib.kernels.linear`` chooses from); each at each thread count: the best of `repeats` timed reads after one
    warm-up. Which way is fastest depends on the CPU and its libraries: on an AMD EPYC a one-thread sum
    outran sgemm, on an Intel Xeon sgemm outran the sum. Returns {(way, threads): bytes/s};
    the thread count is restored.
    """
    buffer = torch.ones(max(1, nbytes // 4))
    ways = {"sum": (buffer.sum, buffer.numel() * 4)}  # name: (read, bytes it reads)
    for width in widths:
        rows = max(1, buffer.numel() // width)
        weight, x = buffer[:rows * width].view(rows, width), torch.ones(1, width)
        ways[f"F.linear, width {width}"] = (lambda weight=weight, x=x: F.linear(x, weight)), weight.numel() * 4
        if ONEDNN_AVAILABLE:
            ways[f"oneDNN, width {width}"] = (lambda weight=weight, x=x: onednn_linear(x, weight)), weight.numel() * 4
    rates = {}
    for n_threads in threads:
        with timing.threads(n_threads):
            for name, (read, read_bytes) in ways.items():
                read()  # warm-up: first-call overheads
                best = math.inf
                for _ in range(repeats):
                    start = time.perf_counter()
                    read()
                    best = min(best, time.perf_counter() - start)
                rates[(name, n_threads)] = read_bytes / best
    return rates


def read_bandwidth(nbytes: int, repeats: int = 3, threads=(1, 2)) -> float:
    """An upper bound on this machine's memory read bandwidth, bytes/s: the fastest of ``read_bandwidths``.

    A decode step that reads nbytes of weights cannot read them faster than the fastest way this machine
    found to read nbytes (timing noise aside), whichever kernel the step runs; a bound from one way only (a
    one-thread sum, say) is beaten on CPUs where another way reads faster.
    """
    return max(read_bandwidths(nbytes, repeats, threads).values())


def _check_arguments(shapes, known: dict, repeats: int, warmup: int, new_tokens: int) -> None:
    """ValueError unless every shape is one of `known`, repeats >= 1, warmup >= 0 and new_tokens >= 1."""
    unknown = sorted(set(shapes) - set(known))
    if unknown:
        raise ValueError(f"shapes must be among {sorted(known)}, got {unknown}")
    if repeats < 1 or warmup < 0 or new_tokens < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, new_tokens >= 1; got {repeats}, {warmup}, {new_tokens}")


def _seeded_pair(model_class, config, convert, seed: int) -> tuple:
    """Our model of `config` with seeded random weights, in eval mode, and Hugging Face's copy of it (``convert``)."""
    torch.manual_seed(seed)
    ours = model_class(config).eval()
    return ours, convert(ours)


def _prompt(vocab_size: int, batch_size: int, prompt_len: int, seed: int):
    """The seeded random prompt of a batch size's rows, (B, prompt_len)."""
    return torch.randint(0, vocab_size, (batch_size, prompt_len), generator=torch.Generator().manual_seed(seed + batch_size))


def int4_reference_model(model, group_size: int = INT4_GROUP_SIZE):
    """A float64 copy of `model` whose every nn.Linear weight (group_size dividing its inputs) is replaced by its
    dequantized int4 weight (``quantize_int4``, ``dequantize_int4``): what int4's greedy tokens are compared with.
    The int4 model itself rounds its activations, scales and offsets to bfloat16 in PyTorch's kernel, so its tokens
    can part from this reference where two logits are within that rounding."""
    reference = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % group_size == 0:
                module.weight = torch.nn.Parameter(dequantize_int4(*quantize_int4(module.weight, group_size)).double())
    return reference


class W8A8Reference(torch.nn.Module):
    """The float64 computation of ``Int8KernelLinear``'s rounding, for a reference model: the weight quantized by
    ``quantize_int8``; each row of x rounded to int8 levels round(x / s), s = max |row| / 127 (a zero row: levels 0);
    the products of levels summed in float64 (integers below 2^53: exact); times s and the channel's scale, plus the
    bias. x (..., in) float64 -> (..., out)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("q", q.double())
        self.register_buffer("scale", scale.double())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().double())

    def forward(self, x):
        s = x.abs().amax(dim=-1, keepdim=True) / 127
        levels = torch.round(x / torch.where(s > 0, s, 1.0)).clamp(-127, 127)
        y = (levels @ self.q.t()) * s * self.scale
        return y if self.bias is None else y + self.bias


def int8_reference_model(model):
    """A float64 copy of `model` whose every nn.Linear is a ``W8A8Reference``: what int8's greedy tokens are compared
    with. The int8 model rounds its activations to int8 from float32 ones, this reference from float64 ones, so a
    level can differ where an activation lies near the middle between two levels, and the tokens part where two logits
    are within what that changes."""
    reference = copy.deepcopy(model).double().eval()
    for module in list(reference.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, W8A8Reference(child))
    return reference


#: A parting of a quantized model's tokens from its float64 reference is called a near-tie when the reference's logits
#: of the two tokens differ by less than this fraction of its largest |logit|: bfloat16 keeps 8 significant bits (2^-8
#: ~ 0.004), and an int8 level is 1/127 of its row's largest.
NEAR_TIE = 1e-2


def parting(tokens, reference, prompt_len: int) -> dict | None:
    """Where a quantized model's greedy tokens (B, prompt_len + n) part from those of `reference`
    (``int8_reference_model``, ``int4_reference_model``) and by how much: None if they are equal, else {"token": the
    first new token that differs, "margin": at that step, the reference's logit of its own choice minus its logit of the
    model's, over its largest |logit| (the largest over the rows that differ)}. A margin under NEAR_TIE is a near-tie
    that the model's rounding can flip; a larger one is more than rounding explains."""
    expected = generate_cached(reference, tokens[:, :prompt_len], tokens.shape[1] - prompt_len)
    part = first_difference(tokens[:, prompt_len:], expected[:, prompt_len:])
    if part is None:
        return None
    step = prompt_len + part
    rows = (tokens[:, step] != expected[:, step]).nonzero().flatten()
    with torch.no_grad():
        logits = reference(tokens[rows, :step])[0][:, -1, :].double()  # the reference's view of that step
    ours, theirs = logits.gather(1, tokens[rows, step, None]), logits.gather(1, expected[rows, step, None])
    return {"token": part, "margin": ((theirs - ours).flatten() / logits.abs().amax(dim=1)).max().item()}


def first_difference(a, b) -> int | None:
    """The first position (along the tokens, any row) at which two (B, T) token tensors differ; None if equal."""
    differ = (a != b).any(dim=0).nonzero()
    return None if differ.numel() == 0 else int(differ[0])


def _time_runs(runs: dict, warmup: int, repeats: int, after_round=None) -> dict:
    """Time each run {name: (run(n new tokens), n)} alternately after warmup runs of at most WARMUP_TOKENS tokens
    (``timing.alternate``); returns {name: its Runs}, whose last result holds its last run's tokens."""
    return timing.alternate({name: (lambda run=run, n=n: run(n)) for name, (run, n) in runs.items()}, repeats, warmup,
                            warm={name: (lambda run=run, n=n: run(min(n, WARMUP_TOKENS))) for name, (run, n) in runs.items()},
                            after_round=after_round)


#: weight format -> the row of our cached model in it (``_cached_models``)
CACHED_ROWS = {"float32": "ours, cached", "int8": "ours int8, cached", "bfloat16": "ours bf16, cached",
               "int4": "ours int4, cached"}


def _cached_models(ours) -> dict:
    """{row of CACHED_ROWS: our GPT `ours` in that weight format}: `ours` itself (float32), and its int8, bfloat16
    (oneDNN packed where faster here) and int4 copies."""
    copies = {"int8": quantize_weights(ours, "int8"),
              "bfloat16": use_fastest_bf16_kernels(quantize_weights(ours, "bfloat16")),
              "int4": quantize_weights(ours, "int4")}
    return {impl: copies.get(weights, ours) for weights, impl in CACHED_ROWS.items()}


def bench_decode(shapes=("tiny", "gpt2-small"), batch_sizes=(1, 8), new_tokens: int = 256, prompt_len: int = 16,
                 uncached_tokens: dict | None = None, threads: int = 2, warmup: int = 1, repeats: int = REPEATS,
                 seed: int = 0) -> dict:
    """Greedy decoding speed of ours (cached with float32, int8, bfloat16 and int4 weights; uncached) and of
    Hugging Face's generate (use_cache True, False), float32.

    For each shape and batch size: random weights (seeded), one converted copy for Hugging Face (identical
    weights) and our int8, bfloat16 and int4 copies (``quantize_weights``; int4: groups of INT4_GROUP_SIZE, each
    layer on the kernel ``course_lib.kernels`` measured faster), a random prompt of prompt_len tokens;
    each implementation generates new_tokens (cached) or uncached_tokens[shape] (uncached) tokens, warmup
    times untimed, then repeats times, alternating between implementations; the median time gives
    tokens/s = B * new tokens / seconds; "vs HF" divides by HF's float32 row of the same caching. For the
    GPT-2-small shape at batch 1, the memory-bandwidth bound of each weight format: the measured read
    bandwidth (``read_bandwidth``, with one thread, two and `threads`, measured after each repeat's runs; the
    fastest of them, so that no run beats it) / the bytes of the weights a step reads. Tokens: ours float32 against
    HF's (equal, the same float32 weights); int8's and int4's against a float64 model doing the same rounding
    (``int8_reference_model``, ``int4_reference_model``), ``parting``: where they part, by what logit margin (None:
    equal), each row's "partings" {"int8": ..., "int4": ...}. Returns {"rows": [...], "bound": {...} or None,
    "kernels": the float32 kernels chosen, "kernel_choices": the int4 and bfloat16 kernels chosen (``chosen_among``),
    ...}.
    """
    from ..hf import to_hf

    _check_arguments(shapes, DECODE_SHAPES, repeats, warmup, new_tokens)
    uncached_tokens = {**UNCACHED_TOKENS, **(uncached_tokens or {})}
    rows, bound = [], None
    with timing.threads(threads):
        for shape in shapes:
            config = GPTConfig(**DECODE_SHAPES[shape])
            ours, theirs = _seeded_pair(GPT, config, to_hf, seed)
            formats = _cached_models(ours)
            references = {"int8": int8_reference_model(ours), "int4": int4_reference_model(ours)}
            use_fastest_kernels(ours, rows=batch_sizes)  # float32: the faster kernel per weight, measured here
            n_uncached = min(uncached_tokens[shape], new_tokens)
            for B in batch_sizes:
                prompt = _prompt(config.vocab_size, B, prompt_len, seed)
                runs = {
                    **{impl: (lambda n, model=model: generate_cached(model, prompt, n), new_tokens)
                       for impl, model in formats.items()},
                    "ours, uncached": (lambda n: greedy_uncached(ours, prompt, n), n_uncached),
                    "HF generate, use_cache=True": (lambda n: hf_generate(theirs, prompt, n, True), new_tokens),
                    "HF generate, use_cache=False": (lambda n: hf_generate(theirs, prompt, n, False), n_uncached),
                }
                measure_bound = shape == BOUND_SHAPE and B == BOUND_BATCH
                bandwidths = []

                def measure():  # the bandwidth too, between the same runs: memory is shared with the machine's other work
                    if measure_bound:
                        bandwidths.append(read_bandwidth(decode_weight_bytes(ours), threads=sorted({1, 2, threads})))

                timed = _time_runs(runs, warmup, repeats, after_round=measure)
                same = torch.equal(timed["ours, cached"].results[-1], timed["HF generate, use_cache=True"].results[-1])
                partings = {weights: parting(timed[f"ours {weights}, cached"].results[-1], reference, prompt_len)
                            for weights, reference in references.items()}
                for name, (_, n) in runs.items():
                    seconds = timed[name].median
                    rows.append({"shape": shape, "batch_size": B, "impl": name, "new_tokens": n, "seconds": seconds,
                                 "tokens_per_s": B * n / seconds, "times": timed[name].seconds, "same_tokens_as_hf": same,
                                 "partings": partings})
                these = rows[-len(runs):]
                for row in these:
                    cached = row["impl"].endswith((" cached", "True"))
                    hf_row = next(r for r in these if r["impl"] == f"HF generate, use_cache={cached}")
                    row["ratio_to_hf"] = row["tokens_per_s"] / hf_row["tokens_per_s"]
                if measure_bound:
                    bandwidth = max(bandwidths)  # a bound: the fastest read of the whole run
                    bound = {"bandwidth": bandwidth, "bandwidths": bandwidths, "formats": {}}
                    for weights, impl in CACHED_ROWS.items():
                        weight_bytes = decode_weight_bytes(formats[impl])
                        row = next(r for r in these if r["impl"] == impl)
                        bound["formats"][weights] = {"weight_bytes": weight_bytes, "tokens_per_s": bandwidth / weight_bytes,
                                                     "fraction": row["tokens_per_s"] * weight_bytes / bandwidth}
    return {"rows": rows, "bound": bound, "threads": threads, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len,
            "kernels": chosen_kernels(), "kernel_choices": chosen_among(), "int8_product": int8_product()}


def bench_decode_threads(shapes=("gpt2-small",), batch_sizes=(1,), thread_counts=(1, 2), new_tokens: int = 64,
                         prompt_len: int = 16, warmup: int = 1, repeats: int = REPEATS, seed: int = 0) -> dict:
    """What more threads buy: the cached rows of ``bench_decode`` (ours with float32, int8, bfloat16 and int4 weights,
    Hugging Face's generate, float32), each run at each of `thread_counts`, all timed alternately in one loop (side by
    side: background load hits every count alike).

    The float32 kernels are measured at every thread count before the timed runs (``use_fastest_kernels``); the
    bfloat16 packing and the int4 kernels are chosen once, at the largest count (as ``bench_decode`` chooses them at
    its). Returns {"rows": [{"shape", "batch_size", "impl", "threads", "new_tokens", "seconds" (median),
    "tokens_per_s", "gain": tokens/s over the same row's at thread_counts[0]}], "thread_counts", ...}. ValueError
    for a thread count below 1 or repeated.
    """
    from ..hf import to_hf

    _check_arguments(shapes, DECODE_SHAPES, repeats, warmup, new_tokens)
    counts = check_thread_counts(thread_counts)
    rows = []
    for shape in shapes:
        config = GPTConfig(**DECODE_SHAPES[shape])
        with timing.threads(max(counts)):
            ours, theirs = _seeded_pair(GPT, config, to_hf, seed)
            models = _cached_models(ours)
        for n in counts:
            with timing.threads(n):
                use_fastest_kernels(ours, rows=batch_sizes)
        for B in batch_sizes:
            prompt = _prompt(config.vocab_size, B, prompt_len, seed)
            runs = {}
            for n in counts:
                for name, model in models.items():
                    runs[name, n] = (lambda k, model=model, n=n: _with_threads(n, generate_cached, model, prompt, k),
                                     new_tokens)
                runs["HF generate, use_cache=True", n] = (
                    lambda k, n=n: _with_threads(n, hf_generate, theirs, prompt, k, True), new_tokens)
            timed = _time_runs(runs, warmup, repeats)
            for (name, n), runs_ in timed.items():
                rows.append({"shape": shape, "batch_size": B, "impl": name, "threads": n, "new_tokens": new_tokens,
                             "seconds": runs_.median, "tokens_per_s": B * new_tokens / runs_.median})
            for row in rows[-len(runs):]:
                first = next(r for r in rows[-len(runs):] if r["impl"] == row["impl"] and r["threads"] == counts[0])
                row["gain"] = row["tokens_per_s"] / first["tokens_per_s"]
    return {"rows": rows, "thread_counts": counts, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len}


def check_thread_counts(thread_counts) -> tuple:
    """`thread_counts` as a tuple; ValueError naming thread_counts unless they are distinct integers >= 1 (at least
    one)."""
    counts = tuple(thread_counts)
    if not counts or any(not isinstance(n, int) or n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise ValueError(f"thread_counts must be distinct integers >= 1, got {thread_counts!r}")
    return counts


def _with_threads(n: int, run, *args):
    """run(*args) on n torch threads."""
    with timing.threads(n):
        return run(*args)


def format_decode_threads(result: dict) -> str:
    """The table of ``bench_decode_threads``: tokens/s per thread count, and each count's gain over the first."""
    counts = result["thread_counts"]
    lines = [f"what more threads buy: the cached rows at {', '.join(map(str, counts))} threads, timed side by side, "
             f"median of {result['repeats']} runs after {result['warmup']} warm-up run(s) "
             "(measure on a quiet machine: on a busy one a second thread waits for a descheduled one)",
             f"{'shape':11s} {'B':>2s}  {'implementation':29s} " + " ".join(f"{f'{n} thr tok/s':>12s}" for n in counts)
             + "".join(f" {f'{n} / {counts[0]}':>7s}" for n in counts[1:])]
    by_row: dict[tuple, dict[int, dict]] = {}
    for row in result["rows"]:
        by_row.setdefault((row["shape"], row["batch_size"], row["impl"]), {})[row["threads"]] = row
    for (shape, B, impl), at in by_row.items():
        lines.append(f"{shape:11s} {B:>2d}  {impl:29s} " + " ".join(f"{at[n]['tokens_per_s']:>12.1f}" for n in counts)
                     + "".join(f" {at[n]['gain']:>6.2f}x" for n in counts[1:]))
    return "\n".join(lines)


def _format_rows(rows: list) -> list[str]:
    """The header and a line per row of a decode table (``bench_decode``'s or ``bench_llama_decode``'s)."""
    lines = [f"{'shape':11s} {'B':>2s}  {'implementation':29s} {'new':>4s} {'ms/step':>8s} {'tokens/s':>9s} {'vs HF':>6s}"]
    for row in rows:
        lines.append(f"{row['shape']:11s} {row['batch_size']:>2d}  {row['impl']:29s} {row['new_tokens']:>4d} "
                     f"{row['seconds'] / row['new_tokens'] * 1e3:>8.2f} {row['tokens_per_s']:>9.1f} {row['ratio_to_hf']:>5.2f}x")
    return lines


def _format_agreement(rows: list) -> str:
    """Per (shape, batch size): whether ours generated the same tokens as Hugging Face."""
    agree = {(r["shape"], r["batch_size"]): r["same_tokens_as_hf"] for r in rows}
    return ", ".join(f"{s} B={b}: {'yes' if v else 'NO'}" for (s, b), v in agree.items())


def format_decode(result: dict) -> str:
    """The table `course bench decode` prints."""
    lines = [f"greedy decoding from a {result['prompt_len']}-token prompt, random weights, {result['threads']} threads, "
             f"median of {result['repeats']} runs after {result['warmup']} warm-up run(s); tokens/s = B x new tokens / seconds",
             *_format_rows(result["rows"])]
    lines.append("ours cached == HF cached, same tokens: " + _format_agreement(result["rows"]))
    for weights, what in (("int8", "the same int8 rounding of weights and activations"),
                          ("int4", "int4's dequantized weights")):
        parts = {(r["shape"], r["batch_size"]): r.get("partings", {}).get(weights) for r in result["rows"]}
        lines.append(f"ours {weights} == a float64 model with {what}, same tokens: " + ", ".join(
            f"{s} B={b}: " + ("yes" if p is None else f"from token {p['token']} on, where the reference's two logits "
                              f"differ by {p['margin']:.1e} of its largest (" + (
                                  "a near-tie: within the model's rounding)" if p["margin"] < NEAR_TIE else
                                  "NOT a near-tie: more than rounding explains)"))
            for (s, b), p in parts.items()))
    lines.append("(vs HF: our cached rows / HF use_cache=True float32, ours uncached / HF use_cache=False; "
                 "targets: float32 >= 1.3x, int8 >= 2.5x at gpt2-small)")
    bound = result.get("bound")
    if bound:
        spread = ", ".join(f"{b / 1e9:.1f}" for b in sorted(bound["bandwidths"]))
        lines.append(f"memory-bandwidth bound, gpt2-small B=1: measured read bandwidth {bound['bandwidth'] / 1e9:.1f} GB/s "
                     f"(the fastest of [{spread}] GB/s: read_bandwidth, the fastest way this machine read a float32 tensor "
                     "the size of the float32 weights, measured between the repeats) / weights read per step:")
        for weights, b in bound["formats"].items():
            lines.append(f"  {weights:8s} {b['weight_bytes'] / 1e6:6.1f} MB -> {b['tokens_per_s']:6.1f} tokens/s; "
                         f"ours cached reaches {b['fraction']:.0%} of it" + (f" (target >= {BOUND_TARGETS[weights]:.0%})"
                                                                            if weights in BOUND_TARGETS else "")
                         + (" - ABOVE the bound: this machine read faster than read_bandwidth measured (a cache holding "
                            "these weights, or the bound measured at a busy moment)" if b["fraction"] > 1.1 else ""))
    lines.append(format_kernels(result.get("kernels", {})))
    if "int8_product" in result:
        lines.append(f"int8 sums (course_lib.quantize.int8_product, exact either way): {result['int8_product']}")
    for kind, what in (("int4", "groups of"), ("bfloat16", "bias")):
        chosen = sorted({(key[1:4], name) for key, name in result.get("kernel_choices", {}).items() if key[0] == kind})
        if chosen:
            lines.append(f"{kind} kernels chosen (course_lib.kernels, measured): " +
                         "; ".join(f"({o}, {i}) {what} {g}: {name}" for (o, i, g), name in chosen))
    return "\n".join(lines)


def format_kernels(kernels: dict) -> str:
    """One line: which kernel ``course_lib.kernels`` chose for our float32 weights, per number of rows."""
    by_rows: dict[int, dict[str, int]] = {}
    for choice, name in sorted(kernels.items()):
        by_rows.setdefault(choice.rows, {}).setdefault(name, 0)
        by_rows[choice.rows][name] += 1
    return ("kernels chosen for our float32 weights (course_lib.kernels, measured on this machine): " +
            "; ".join(f"{rows} row(s): " + ", ".join(f"{name} x{count}" for name, count in names.items())
                      for rows, names in by_rows.items()))


def bench_llama_decode(shapes=("tiny", "llama-small"), batch_sizes=(1, 8), new_tokens: int = LLAMA_MAX_TOKENS,
                       prompt_len: int = 16, threads: int = 2, warmup: int = 1, repeats: int = REPEATS, seed: int = 0) -> dict:
    """Greedy decoding speed of our Llama-style model (``generate_llama``, KV cache) and of Hugging Face's
    LlamaForCausalLM ``generate`` (use_cache=True) with the same weights (``llama_to_hf``), float32.

    For each shape and batch size: random weights (seeded), a random prompt of prompt_len tokens, new_tokens new
    tokens, warmup untimed runs, then repeats timed runs alternating between the two; the median gives
    tokens/s = B * new_tokens / seconds, and "vs HF" = ours / HF. Returns {"rows": [...], ...}.
    """
    from ..hf import llama_to_hf
    from ..llama import Llama, LlamaConfig, generate_llama

    _check_arguments(shapes, LLAMA_DECODE_SHAPES, repeats, warmup, new_tokens)
    rows = []
    with timing.threads(threads):
        for shape in shapes:
            config = LlamaConfig(**LLAMA_DECODE_SHAPES[shape])
            ours, theirs = _seeded_pair(Llama, config, llama_to_hf, seed)
            use_fastest_kernels(ours, rows=batch_sizes)  # the faster kernel per weight, measured here
            for B in batch_sizes:
                prompt = _prompt(config.vocab_size, B, prompt_len, seed)
                runs = {"ours (generate_llama)": (lambda n: generate_llama(ours, prompt, n), new_tokens),
                        "HF LlamaForCausalLM generate": (lambda n: hf_generate(theirs, prompt, n, True), new_tokens)}
                timed = _time_runs(runs, warmup, repeats)
                same = torch.equal(*(t.results[-1] for t in timed.values()))
                these = [{"shape": shape, "batch_size": B, "impl": name, "new_tokens": new_tokens,
                          "seconds": timed[name].median, "times": timed[name].seconds, "same_tokens_as_hf": same}
                         for name in runs]
                for row in these:
                    row["tokens_per_s"] = B * new_tokens / row["seconds"]
                for row in these:
                    row["ratio_to_hf"] = row["tokens_per_s"] / these[-1]["tokens_per_s"]
                rows.extend(these)
    return {"rows": rows, "threads": threads, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len,
            "kernels": chosen_kernels()}


def format_llama_decode(result: dict) -> str:
    """The Llama table `course bench decode` prints."""
    lines = [f"Llama-style (chapter 11): greedy decoding from a {result['prompt_len']}-token prompt, random weights, "
             f"{result['threads']} threads, median of {result['repeats']} runs after {result['warmup']} warm-up run(s)",
             *_format_rows(result["rows"])]
    lines.append("ours == HF, same tokens: " + _format_agreement(result["rows"]))
    lines.append("(vs HF: ours / Hugging Face's LlamaForCausalLM.generate, same weights, use_cache=True; floor >= 1.0x)")
    lines.append(format_kernels(result.get("kernels", {})))
    return "\n".join(lines)
