"""``course bench train`` and ``course bench decode``: our GPT against Hugging Face's GPT2LMHeadModel.

``train``: one training step.
Both models have the same config and the same weights (``course_lib.hf.to_hf``), see the same
batches and compute the same loss (the mean cross-entropy of every position's logits against the
next token); each step is forward, loss, backward, gradient clipping and an AdamW update. The two
are timed alternately in one process (so background load hits both alike), after a warm-up, and
the median of the repeats is reported. A benchmark, not a test: it prints, it asserts nothing.

``decode``: greedy tokens per second of our cached decoding (``course_lib.kv_cache.generate_cached``)
with float32, int8 and bfloat16 weights (``course_lib.quantize``), our uncached decoding (a full forward
pass per token), and Hugging Face's ``generate`` with ``use_cache`` True and False, on the same weights;
beside them the memory-bandwidth bound of each weight format; see ``bench_decode``. Then chapter 11's
Llama-style model (``course_lib.llama.generate_llama``) against Hugging Face's ``LlamaForCausalLM`` with the
same weights; see ``bench_llama_decode``.

``serve``: many requests at once (chapter 12). On the same seeded request trace
(``course_lib.serving.make_trace``) and the same weights: our continuous batching over a paged KV cache
(``serving.Engine``), our static batching (``serving.static_batching``) and Hugging Face's continuous
batching (the manager behind ``generate_batch``, with its paged cache); throughput, time to first token,
time per output token, KV bytes allocated per byte used; see ``bench_serve``. Then chapter 12's load sweep, timed:
request rates with Poisson arrivals and token budgets, ours only (``bench_serve_load``).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from .data import CharTokenizer, default_corpus, get_batch
from .gpt import GPT, GPTConfig, extend, gpt_layers
from .kernels import ONEDNN_AVAILABLE, chosen_kernels, onednn_linear, use_fastest_kernels
from .kv_cache import generate_cached
from .quantize import decode_weight_bytes, quantize_weights


def _step_ours(model, optimizer, x, y):
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def _step_hf(model, optimizer, x, y):
    logits = model(input_ids=x).logits  # (B, T, V); the same loss as ours, on every position
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def bench_train(batch_size: int = 12, block_size: int = 64, n_layer: int = 4, n_embd: int = 128, n_head: int = 4,
                threads: int = 2, warmup: int = 5, repeats: int = 7, steps_per_repeat: int = 10, seed: int = 0) -> dict:
    """Median seconds per training step of ours and of Hugging Face's GPT-2, and their ratio (ours / HF)."""
    from .hf import to_hf

    if repeats < 1 or steps_per_repeat < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, steps_per_repeat >= 1, warmup >= 0; got {repeats}, {steps_per_repeat}, {warmup}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokenizer = CharTokenizer(default_corpus())
        data = torch.tensor(tokenizer.encode(default_corpus()[:200_000]))
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        ours = GPT(config).train()
        theirs = to_hf(ours).train()
        batches = [get_batch(data, block_size, batch_size, torch.Generator().manual_seed(seed + i)) for i in range(8)]
        runs = {"ours": (ours, _step_ours), "hf": (theirs, _step_hf)}
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, (model, _) in runs.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for name, (model, step) in runs.items():  # warm-up: allocator, first-call overheads
            for i in range(warmup):
                step(model, optimizers[name], *batches[i % len(batches)])
        for _ in range(repeats):
            for name, (model, step) in runs.items():  # alternate, so that background load affects both
                start = time.perf_counter()
                for i in range(steps_per_repeat):
                    step(model, optimizers[name], *batches[i % len(batches)])
                times[name].append((time.perf_counter() - start) / steps_per_repeat)
    finally:
        torch.set_num_threads(previous_threads)
    ours_s, hf_s = statistics.median(times["ours"]), statistics.median(times["hf"])
    return {"ours_s": ours_s, "hf_s": hf_s, "ratio": ours_s / hf_s, "times": times,
            "attn_implementation": theirs.config._attn_implementation, "config": config,
            "batch_size": batch_size, "threads": threads}


#: Model shapes of ``course bench decode`` (random weights, context 1024 so that 16 + 256 tokens fit).
DECODE_SHAPES = {
    "tiny": dict(vocab_size=103, block_size=1024, n_layer=4, n_head=4, n_embd=128),  # char-gpt's shape
    "gpt2-small": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}
#: New tokens of the uncached rows: a full forward pass per token costs O(context) per step, so the
#: uncached rows generate fewer tokens (tokens/s is compared with HF at the same length, never across lengths)
UNCACHED_TOKENS = {"tiny": 64, "gpt2-small": 16}


@torch.inference_mode()
def greedy_uncached(model, idx, max_new_tokens: int):
    """Greedy decoding without a cache: every step runs the blocks over the whole sequence so far and
    the LM head over its last position only. (B, T) -> (B, T + max_new_tokens)."""
    tr = model.transformer

    def next_logits(tokens, new):
        x = tr.wte(tokens) + tr.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        return model.lm_head(gpt_layers(model, x)[:, -1])

    return extend(idx, max_new_tokens, next_logits)


def hf_generate(model, idx, max_new_tokens: int, use_cache: bool = True):
    """Greedy decoding with Hugging Face's generate: exactly max_new_tokens new tokens, no padding. (B, T) -> (B, T + n)."""
    with torch.inference_mode():
        return model.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, use_cache=use_cache,
                              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)


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
    previous_threads = torch.get_num_threads()
    rates = {}
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for name, (read, read_bytes) in ways.items():
                read()  # warm-up: first-call overheads
                best = math.inf
                for _ in range(repeats):
                    start = time.perf_counter()
                    read()
                    best = min(best, time.perf_counter() - start)
                rates[(name, n_threads)] = read_bytes / best
    finally:
        torch.set_num_threads(previous_threads)
    return rates


def read_bandwidth(nbytes: int, repeats: int = 3, threads=(1, 2)) -> float:
    """An upper bound on this machine's memory read bandwidth, bytes/s: the fastest of ``read_bandwidths``.

    A decode step that reads nbytes of weights cannot read them faster than the fastest way this machine
    found to read nbytes (timing noise aside), whichever kernel the step runs; a bound from one way only (a
    one-thread sum, say) is beaten on CPUs where another way reads faster.
    """
    return max(read_bandwidths(nbytes, repeats, threads).values())


def bench_decode(shapes=("tiny", "gpt2-small"), batch_sizes=(1, 8), new_tokens: int = 256, prompt_len: int = 16,
                 uncached_tokens: dict | None = None, threads: int = 2, warmup: int = 1, repeats: int = 5,
                 seed: int = 0) -> dict:
    """Greedy decoding speed of ours (cached with float32, int8 and bfloat16 weights; uncached) and of
    Hugging Face's generate (use_cache True, False), float32.

    For each shape and batch size: random weights (seeded), one converted copy for Hugging Face (identical
    weights) and our int8 and bfloat16 copies (``quantize_weights``), a random prompt of prompt_len tokens;
    each implementation generates new_tokens (cached) or uncached_tokens[shape] (uncached) tokens, warmup
    times untimed, then repeats times, alternating between implementations; the median time gives
    tokens/s = B * new tokens / seconds; "vs HF" divides by HF's float32 row of the same caching. For the
    GPT-2-small shape at batch 1, the memory-bandwidth bound of each weight format: the measured read
    bandwidth (``read_bandwidth``, with one thread, two and `threads`, measured after each repeat's runs; the
    fastest of them, so that no run beats it) / the bytes of the weights a step reads. Returns {"rows": [...], "bound": {...} or None, ...}.
    """
    from .hf import to_hf

    unknown = sorted(set(shapes) - set(DECODE_SHAPES))
    if unknown:
        raise ValueError(f"shapes must be among {sorted(DECODE_SHAPES)}, got {unknown}")
    if repeats < 1 or warmup < 0 or new_tokens < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, new_tokens >= 1; got {repeats}, {warmup}, {new_tokens}")
    uncached_tokens = {**UNCACHED_TOKENS, **(uncached_tokens or {})}
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows, bound = [], None
    try:
        for shape in shapes:
            torch.manual_seed(seed)
            config = GPTConfig(**DECODE_SHAPES[shape])
            ours = GPT(config).eval()
            theirs = to_hf(ours)
            ours_int8, ours_bf16 = quantize_weights(ours, "int8"), quantize_weights(ours, "bfloat16")
            use_fastest_kernels(ours, rows=batch_sizes)  # float32: the faster kernel per weight, measured here
            n_uncached = min(uncached_tokens[shape], new_tokens)
            for B in batch_sizes:
                prompt = torch.randint(0, config.vocab_size, (B, prompt_len), generator=torch.Generator().manual_seed(seed + B))
                runs = {
                    "ours, cached": (lambda n: generate_cached(ours, prompt, n), new_tokens),
                    "ours int8, cached": (lambda n: generate_cached(ours_int8, prompt, n), new_tokens),
                    "ours bf16, cached": (lambda n: generate_cached(ours_bf16, prompt, n), new_tokens),
                    "ours, uncached": (lambda n: greedy_uncached(ours, prompt, n), n_uncached),
                    "HF generate, use_cache=True": (lambda n: hf_generate(theirs, prompt, n, True), new_tokens),
                    "HF generate, use_cache=False": (lambda n: hf_generate(theirs, prompt, n, False), n_uncached),
                }
                outputs = {}
                for name, (run, n) in runs.items():  # warm-up: allocator, first-call overheads
                    for _ in range(warmup):
                        outputs[name] = run(min(n, 8))
                times: dict[str, list[float]] = {name: [] for name in runs}
                measure_bound = shape == "gpt2-small" and B == 1
                bandwidths = []
                for _ in range(repeats):
                    for name, (run, n) in runs.items():  # alternate, so that background load hits all alike
                        start = time.perf_counter()
                        outputs[name] = run(n)
                        times[name].append(time.perf_counter() - start)
                    if measure_bound:  # the bandwidth too, between the same runs: memory is shared with the machine's other work
                        bandwidths.append(read_bandwidth(decode_weight_bytes(ours), threads=sorted({1, 2, threads})))
                same = torch.equal(outputs["ours, cached"], outputs["HF generate, use_cache=True"])
                for name, (_, n) in runs.items():
                    seconds = statistics.median(times[name])
                    rows.append({"shape": shape, "batch_size": B, "impl": name, "new_tokens": n, "seconds": seconds,
                                 "tokens_per_s": B * n / seconds, "times": times[name], "same_tokens_as_hf": same})
                these = rows[-len(runs):]
                for row in these:
                    cached = row["impl"].endswith((" cached", "True"))
                    hf_row = next(r for r in these if r["impl"] == f"HF generate, use_cache={cached}")
                    row["ratio_to_hf"] = row["tokens_per_s"] / hf_row["tokens_per_s"]
                if measure_bound:
                    bandwidth = max(bandwidths)  # a bound: the fastest read of the whole run
                    bound = {"bandwidth": bandwidth, "bandwidths": bandwidths, "formats": {}}
                    for weights, model, impl in (("float32", ours, "ours, cached"), ("int8", ours_int8, "ours int8, cached"),
                                                 ("bfloat16", ours_bf16, "ours bf16, cached")):
                        weight_bytes = decode_weight_bytes(model)
                        row = next(r for r in these if r["impl"] == impl)
                        bound["formats"][weights] = {"weight_bytes": weight_bytes, "tokens_per_s": bandwidth / weight_bytes,
                                                     "fraction": row["tokens_per_s"] * weight_bytes / bandwidth}
    finally:
        torch.set_num_threads(previous_threads)
    return {"rows": rows, "bound": bound, "threads": threads, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len,
            "kernels": chosen_kernels()}


def format_decode(result: dict) -> str:
    """The table `course bench decode` prints."""
    lines = [f"greedy decoding from a {result['prompt_len']}-token prompt, random weights, {result['threads']} threads, "
             f"median of {result['repeats']} runs after {result['warmup']} warm-up run(s); tokens/s = B x new tokens / seconds",
             f"{'shape':11s} {'B':>2s}  {'implementation':29s} {'new':>4s} {'ms/step':>8s} {'tokens/s':>9s} {'vs HF':>6s}"]
    for row in result["rows"]:
        lines.append(f"{row['shape']:11s} {row['batch_size']:>2d}  {row['impl']:29s} {row['new_tokens']:>4d} "
                     f"{row['seconds'] / row['new_tokens'] * 1e3:>8.2f} {row['tokens_per_s']:>9.1f} {row['ratio_to_hf']:>5.2f}x")
    agree = {(r["shape"], r["batch_size"]): r["same_tokens_as_hf"] for r in result["rows"]}
    lines.append("ours cached == HF cached, same tokens: " + ", ".join(f"{s} B={b}: {'yes' if v else 'NO'}" for (s, b), v in agree.items()))
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
                         f"ours cached reaches {b['fraction']:.0%} of it" + (" (target >= 50%)" if weights == "float32" else ""))
    lines.append(format_kernels(result.get("kernels", {})))
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


#: Models of ``course bench serve``: the course's model (chapter 04's shipped char-gpt checkpoint) and the
#: GPT-2-small shape of ``DECODE_SHAPES`` with seeded random weights
SERVE_MODELS = ("char-gpt", "gpt2-small")
#: Requests in the trace of each model by default (the GPT-2-small shape costs about 40 times more per token)
SERVE_REQUESTS = {"char-gpt": 32, "gpt2-small": 16}
#: The systems of ``course bench serve``. Printed ours first (continuous, capped, static, static reserving the context),
#: then Hugging Face's: the last two were added later, our engine capped at static batching's batch size
#: (max_num_seqs) and static batching reserving the model's context in every row
SERVE_SYSTEMS = ("ours continuous + paged", "ours static batching", "HF continuous + paged", "ours continuous, capped",
                 "ours static, context")


def serve_model(name: str, seed: int = 0) -> GPT:
    """Our GPT for ``bench_serve``: the shipped char-gpt checkpoint, or a shape of ``DECODE_SHAPES`` with seeded random weights."""
    if name == "char-gpt":
        from . import assets

        return assets.load("char-gpt")
    if name not in DECODE_SHAPES:
        raise ValueError(f"models must be among {list(SERVE_MODELS)}, got {name!r}")
    torch.manual_seed(seed)
    return GPT(GPTConfig(**DECODE_SHAPES[name])).eval()


def _ours_run(results: dict, trace) -> dict:
    """One run of ours (``Engine.run`` or ``static_batching``) in the form ``bench_serve`` compares."""
    served = [r for r in results.values() if r.error is None]
    return {"tokens": {r.name: list(r.tokens) for r in served}, "seconds": trace.seconds,
            "ttft": [r.ttft for r in served], "tpot": [r.tpot for r in served if r.tpot is not None],
            "allocated": sum(trace.allocated), "used": sum(trace.used), "errors": len(results) - len(served)}


def _collect_hf(manager, outputs: dict, n: int) -> None:
    """Wait for Hugging Face's continuous batching manager to finish n requests; outputs[request_id] = each one."""
    while len(outputs) < n:
        output = manager.get_result(timeout=60)
        if output is None:
            raise RuntimeError(f"Hugging Face's continuous batching returned {len(outputs)} of {n} requests")
        if output.is_finished():
            outputs[output.request_id] = output


def hf_serve(hf_model, requests: list, num_blocks: int, block_size: int, token_budget: int) -> dict:
    """Serve `requests` greedily with Hugging Face's continuous batching over its paged cache; every request is
    added at once (``Request.arrival``, a step of our engine's clock, means nothing to it: ``bench_serve_wall``
    feeds it arrivals in seconds instead).

    It drives the manager that ``generate_batch`` wraps (``continuous_batching_context_manager``) and adds each
    request with its own max_new_tokens (``generate_batch`` takes one max_new_tokens for all). Its cache: pages of
    block_size tokens, num_blocks of them, at most token_budget tokens per forward pass, block sharing off (so that
    no finished request's blocks are kept for reuse and every block held belongs to a live request). After every
    step it records the KV bytes held (the distinct blocks in its allocators' block tables) and the bytes holding a
    cached token (each live request's position_offset). Returns the dict ``_ours_run`` returns, plus the attention
    implementation and the torch threads of the generation thread.
    """
    from .hf import _transformers

    transformers = _transformers()
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1,
                                                      max_new_tokens=max(r.max_new_tokens for r in requests))
    cb_config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=token_budget,
                                         allow_block_sharing=False, use_async_batching=False)
    allocated, used, threads = [], [], []
    outputs = {}
    with hf_model.continuous_batching_context_manager(generation_config=generation_config, warmup=True,
                                                      continuous_batching_config=cb_config) as manager:
        processor = manager.batch_processor  # made by the warm-up, reused by the generation thread
        cache, update_batch = processor.cache, processor.update_batch

        def update_and_count():  # runs in the generation thread, after each forward pass
            update_batch()
            held = cached = 0
            for allocator in cache.cache_allocators.values():
                blocks = {b for table in allocator.block_table.values() for b in table}
                held += len(blocks) * allocator.bytes_per_block
                per_token = allocator.bytes_per_block // allocator.tokens_per_page  # one token, every layer
                cached += per_token * sum(s.position_offset for s in processor.scheduler.active_requests.values())
            allocated.append(held)
            used.append(cached)
            threads.append(torch.get_num_threads())

        processor.update_batch = update_and_count
        start = time.perf_counter()
        for r in requests:
            manager.add_request(r.prompt, request_id=r.name, max_new_tokens=r.max_new_tokens, record_timestamps=True)
        _collect_hf(manager, outputs, len(requests))
    served = [o for o in outputs.values() if o.error is None]
    ttft = [o.timestamps[0] - o.created_time for o in served]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in served if len(o.timestamps) > 1]
    return {"tokens": {o.request_id: list(o.generated_tokens) for o in served},
            "seconds": max(o.timestamps[-1] for o in served) - start, "ttft": ttft, "tpot": tpot,
            "allocated": sum(allocated), "used": sum(used), "errors": len(outputs) - len(served),
            "attn_implementation": hf_model.config._attn_implementation, "threads": sorted(set(threads))}


def _percentile(values: list, q: float) -> float:
    """The q-quantile (0 < q <= 1) of values by the nearest-rank rule: the smallest value with a fraction q at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def bench_serve(models=SERVE_MODELS, n_requests: dict | int | None = None, block_size: int = 8, token_budget: int = 64,
                max_batch_size: int = 8, mean_gap: float = 0.5, threads: int = 1, warmup: int = 1, repeats: int = 3,
                seed: int = 0) -> dict:
    """Serving speed and KV memory of our continuous batching over a paged cache, our static batching and Hugging
    Face's continuous batching, on the same seeded trace and the same weights.

    For each model (``serve_model``): a trace of n_requests[model] requests (``make_trace``: prompts of 4..48
    tokens, log-normal output lengths of median 12, the notebook's settings), served greedily two ways:

    * "all at 0": every request arrives at step 0, by all three systems (Hugging Face has no step clock;
      ``bench_serve_wall`` replays arrivals in seconds for all three);
    * "trace": the trace's arrivals (exponential gaps of mean mean_gap engine steps), by our two systems only.

    Ours continuous: ``Engine`` with a pool that holds every request at once (no preemption), blocks of block_size
    tokens, token_budget tokens per step; ours continuous, capped: the same with max_num_seqs = max_batch_size (no
    more requests at once than static batching runs); static: ``static_batching`` with batches of max_batch_size,
    rows sized by the requests' true output lengths (an oracle); static, context: the same reserving the
    model's context in every row (``reserve="context"``: the same tokens and steps, more memory); Hugging Face:
    ``hf_serve`` with the same pool, page size and budget. warmup untimed runs on the first 4 requests, then repeats
    runs, alternating between the systems. Per system: generated tokens/s (median of the runs), time to first token
    and time per output token (every request of every run: median and 95th percentile), KV bytes allocated per byte
    holding a cached token (summed over the steps of the last run), and whether its tokens equal ours continuous.
    threads: torch threads of all three (1 by default: a serving step is many small ops, and on a machine shared
    with other work a 2-thread op waits whenever its second thread is descheduled). Returns {"rows": [...], ...}.
    """
    from .hf import to_hf
    from .serving import Engine, make_trace, static_batching

    unknown = sorted(set(models) - set(SERVE_MODELS))
    if unknown:
        raise ValueError(f"models must be among {list(SERVE_MODELS)}, got {unknown}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, warmup >= 0; got {repeats}, {warmup}")
    counts = dict(SERVE_REQUESTS) if n_requests is None else (
        {m: n_requests for m in SERVE_MODELS} if isinstance(n_requests, int) else {**SERVE_REQUESTS, **n_requests})
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for name in models:
            ours = serve_model(name, seed)
            theirs = to_hf(ours)
            use_fastest_kernels(ours, rows=[1 << i for i in range(7)])  # a step's rows: 1 .. token_budget
            V, context = ours.config.vocab_size, ours.config.block_size
            trace = make_trace(counts[name], seed=seed, context=context, vocab=list(range(V)), mean_gap=mean_gap)
            at_once = make_trace(counts[name], seed=seed, context=context, vocab=list(range(V)), mean_gap=mean_gap)
            for r in at_once:
                r.arrival = 0
            num_blocks = sum(math.ceil((len(r.prompt) + r.max_new_tokens) / block_size) for r in trace)
            engine = Engine(ours, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget)
            capped = Engine(ours, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget,
                            max_num_seqs=max_batch_size)
            for arrivals, requests in (("all at 0", at_once), ("trace", trace)):
                systems = {
                    SERVE_SYSTEMS[0]: lambda reqs: _ours_run(*engine.run(reqs)),
                    SERVE_SYSTEMS[3]: lambda reqs: _ours_run(*capped.run(reqs)),
                    SERVE_SYSTEMS[1]: lambda reqs: _ours_run(*static_batching(ours, reqs, max_batch_size)),
                    SERVE_SYSTEMS[4]: lambda reqs: _ours_run(*static_batching(ours, reqs, max_batch_size, reserve="context")),
                }
                if arrivals == "all at 0":
                    systems[SERVE_SYSTEMS[2]] = lambda reqs: hf_serve(theirs, reqs, num_blocks, block_size, token_budget)
                for run in systems.values():  # warm-up: allocator, first-call overheads
                    for _ in range(warmup):
                        run(requests[:4])
                runs: dict[str, list] = {system: [] for system in systems}
                for _ in range(repeats):
                    for system, run in systems.items():  # alternate, so that background load hits all alike
                        runs[system].append(run(requests))
                reference = runs[SERVE_SYSTEMS[0]][-1]["tokens"]
                for system, these in runs.items():
                    last = these[-1]
                    ttft = [t for run in these for t in run["ttft"]]
                    tpot = [t for run in these for t in run["tpot"]]
                    per_s = [sum(len(t) for t in run["tokens"].values()) / run["seconds"] for run in these]
                    rows.append({
                        "model": name, "arrivals": arrivals, "system": system, "requests": len(requests),
                        "tokens": sum(len(t) for t in last["tokens"].values()), "errors": last["errors"],
                        "tokens_per_s": statistics.median(per_s), "runs_tokens_per_s": per_s,
                        "ttft_median": statistics.median(ttft), "ttft_p95": _percentile(ttft, 0.95),
                        "tpot_median": statistics.median(tpot), "tpot_p95": _percentile(tpot, 0.95),
                        "kv_ratio": last["allocated"] / last["used"], "same_tokens": last["tokens"] == reference,
                        "attn_implementation": last.get("attn_implementation"), "hf_threads": last.get("threads"),
                    })
    finally:
        torch.set_num_threads(previous_threads)
    return {"rows": rows, "threads": threads, "repeats": repeats, "warmup": warmup, "block_size": block_size,
            "token_budget": token_budget, "max_batch_size": max_batch_size, "mean_gap": mean_gap}


def serve_ratios(rows: list) -> list:
    """Ours continuous / each other system, per model and arrivals: throughput and the median latencies."""
    ratios = []
    for row in rows:
        if row["system"] == SERVE_SYSTEMS[0]:
            continue
        ours = next(r for r in rows if r["model"] == row["model"] and r["arrivals"] == row["arrivals"]
                    and r["system"] == SERVE_SYSTEMS[0])
        ratios.append({"model": row["model"], "arrivals": row["arrivals"], "versus": row["system"],
                       "tokens_per_s": ours["tokens_per_s"] / row["tokens_per_s"],
                       "ttft_median": ours["ttft_median"] / row["ttft_median"],
                       "tpot_median": ours["tpot_median"] / row["tpot_median"],
                       "kv_ratio": ours["kv_ratio"] / row["kv_ratio"]})
    return ratios


def format_serve(result: dict) -> str:
    """The table `course bench serve` prints."""
    r = result
    lines = [f"serving a seeded request trace (course_lib.serving.make_trace: prompts 4..48 tokens, output lengths "
             f"log-normal, median 12), greedy, float32, {r['threads']} threads; tokens/s: median of {r['repeats']} runs "
             f"after {r['warmup']} warm-up run(s); TTFT, TPOT: every request of every run",
             f"ours continuous: Engine, blocks of {r['block_size']} tokens, a pool that holds every request at once (no "
             f"preemption), {r['token_budget']} tokens per step; capped: the same, at most {r['max_batch_size']} requests "
             f"at once (max_num_seqs); static: batches of {r['max_batch_size']}, cache preallocated for the longest prompt "
             f"+ longest output (read from the true output lengths: an oracle); static, context: the model's context "
             f"in every row; HF: the same pool, page size and token budget",
             f"{'model':10s} {'arrivals':8s}  {'system':24s} {'req':>3s} {'tokens':>6s} {'tokens/s':>8s} "
             f"{'TTFT ms med':>11s} {'p95':>6s} {'TPOT ms med':>11s} {'p95':>6s} {'KV alloc/used':>13s} {'same':>4s}"]
    for row in r["rows"]:
        lines.append(f"{row['model']:10s} {row['arrivals']:8s}  {row['system']:24s} {row['requests']:>3d} {row['tokens']:>6d} "
                     f"{row['tokens_per_s']:>8.1f} {row['ttft_median'] * 1e3:>11.1f} {row['ttft_p95'] * 1e3:>6.1f} "
                     f"{row['tpot_median'] * 1e3:>11.2f} {row['tpot_p95'] * 1e3:>6.2f} {row['kv_ratio']:>13.2f} "
                     f"{'yes' if row['same_tokens'] else 'NO':>4s}")
    lines.append("ratios, ours continuous / the other (throughput > 1: ours faster; TTFT, TPOT, KV < 1: ours lower):")
    for q in serve_ratios(r["rows"]):
        lines.append(f"  {q['model']:10s} {q['arrivals']:8s} / {q['versus']:24s} tokens/s {q['tokens_per_s']:5.2f}x  "
                     f"TTFT median {q['ttft_median']:5.2f}x  TPOT median {q['tpot_median']:5.2f}x  KV alloc/used {q['kv_ratio']:5.2f}x")
    hf = [row for row in r["rows"] if row["system"] == SERVE_SYSTEMS[2]]
    if hf:
        lines.append(f"HF: transformers' continuous batching (the manager behind generate_batch; attention "
                     f"{hf[0]['attn_implementation']}, torch threads in its generation thread {hf[0]['hf_threads']}), each "
                     "request added with its own max_new_tokens (generate_batch takes one for all), block sharing off.")
        lines.append("HF has no notion of arrival time (requests are added, then served), so the HF rows, and ours beside "
                     "them, have every request arriving at step 0 ('all at 0'); the 'trace' rows use the trace's arrivals "
                     f"(exponential gaps of mean {r['mean_gap']} engine steps), for ours only.")
        lines.append("KV alloc/used: bytes of the blocks held / bytes holding a cached token, summed over the steps; HF's: "
                     "the distinct blocks in its allocators' block tables / each live request's cached tokens (position_offset).")
    lines.append("same: every request's tokens equal ours continuous's (greedy, so they should; float rounding may flip a near tie)")
    return "\n".join(lines)


#: ``course bench serve``'s load sweep: request rates (requests per engine step, Poisson arrivals), and the token
#: budgets tried at the highest rate (the notebook's, chapter 12 section 8)
SWEEP_RATES = (0.2, 0.4, 0.8, 1.6)
SWEEP_BUDGETS = (8, 16, 32, 64)


def bench_serve_load(rates=SWEEP_RATES, budgets=SWEEP_BUDGETS, n_requests: int = 32, block_size: int = 8,
                     token_budget: int = 64, max_batch_size: int = 8, threads: int = 1, repeats: int = 3,
                     seed: int = 3) -> dict:
    """Chapter 12's load sweep on the course model, timed: ``serving.load_sweep`` in seconds as well as steps.

    Traces: ``make_trace(n_requests, seed, mean_gap=1 / rate)`` per rate. Systems: static batching (batches of
    max_batch_size) sized by the true output lengths (the oracle) and reserving the context; the engine (a pool of
    max_batch_size x the context, the notebook's) capped at max_batch_size running requests and uncapped; and, at
    the highest rate, the uncapped engine with each token budget. Each round runs every (trace, system) once, in
    order (so that background load hits all alike); a row holds, per field of ``serving_stats``, the median over
    the rounds (the step counts are the same in every round). Hugging Face's continuous batching has no arrival
    times, so it is not swept: ``bench_serve`` compares it with every request arriving at once."""
    from .serving import Engine, load_sweep, make_trace, static_batching

    if repeats < 1 or not rates or not budgets:
        raise ValueError(f"need repeats >= 1 and at least one rate and one budget; got {repeats}, {rates}, {budgets}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = serve_model("char-gpt")
        use_fastest_kernels(model, rows=[1 << i for i in range(8)])
        V, context = model.config.vocab_size, model.config.block_size
        traces = {rate: make_trace(n_requests, seed=seed, context=context, vocab=list(range(V)), mean_gap=1 / rate)
                  for rate in rates}
        pool = max_batch_size * context // block_size
        systems = {
            "static, oracle": lambda reqs: static_batching(model, reqs, max_batch_size),
            "static, context": lambda reqs: static_batching(model, reqs, max_batch_size, reserve="context"),
            f"engine, capped {max_batch_size}": Engine(model, pool, block_size, token_budget, max_num_seqs=max_batch_size).run,
            "engine": Engine(model, pool, block_size, token_budget).run,
        }
        by_budget = {f"engine, budget {b}": Engine(model, pool, block_size, b).run for b in budgets}
        top = {max(rates): traces[max(rates)]}
        load_sweep(systems, {rates[0]: traces[rates[0]][:4]})  # warm-up: allocator, first-call overheads
        rounds = [(load_sweep(systems, traces), load_sweep(by_budget, top)) for _ in range(repeats)]
    finally:
        torch.set_num_threads(previous_threads)

    def medians(runs):
        return [{k: (statistics.median(run[i][k] for run in runs) if isinstance(v, float) else v)
                 for k, v in row.items()} for i, row in enumerate(runs[0])]

    return {"rates": medians([r[0] for r in rounds]), "budgets": medians([r[1] for r in rounds]),
            "threads": threads, "repeats": repeats, "n_requests": n_requests, "token_budget": token_budget,
            "max_batch_size": max_batch_size}


def format_serve_load(result: dict) -> str:
    """The load sweep's table, as `course bench serve` prints it."""
    r = result
    lines = [f"load sweep (chapter 12): char-gpt, {r['n_requests']} requests per trace, Poisson arrivals at each rate "
             f"(requests per engine step), {r['threads']} thread(s), medians of {r['repeats']} rounds; steps: the same on "
             "any machine; ms: this machine, now",
             f"{'rate':>4s} {'system':18s} {'tok/step':>8s} {'tok/s':>6s} {'TTFT steps p50':>14s} {'p95':>4s} "
             f"{'TTFT ms p50':>11s} {'p95':>6s} {'TPOT ms p50':>11s} {'p95':>6s} {'step tokens p50':>15s} {'p95':>5s}"]
    for row in r["rates"] + r["budgets"]:
        lines.append(f"{row['trace']:4.1f} {row['system']:18s} {row['tokens_per_step']:8.2f} {row['tokens_per_s']:6.0f} "
                     f"{row['ttft_steps_p50']:14.0f} {row['ttft_steps_p95']:4.0f} {row['ttft_s_p50'] * 1e3:11.1f} "
                     f"{row['ttft_s_p95'] * 1e3:6.1f} {row['tpot_s_p50'] * 1e3:11.2f} {row['tpot_s_p95'] * 1e3:6.2f} "
                     f"{row['step_tokens_p50']:15.1f} {row['step_tokens_p95']:5.1f}")
    lines.append("step tokens: the tokens computed in the steps between a request's tokens (its own and everyone else's); "
                 "the budget rows: the uncapped engine at the highest rate with that token budget")
    lines.append("Hugging Face is not swept here: it has no step clock (see the 'all at 0' rows above, and the wall-clock "
                 "sweep below)")
    return "\n".join(lines)


#: ``course bench serve``'s wall-clock sweep: request rates in requests per second (Poisson arrivals), on the course model
WALL_RATES = (20.0, 40.0, 80.0, 160.0)
#: its systems, in the order of its rows (each round of the sweep starts with the next one)
WALL_SYSTEMS = ("static batching", "ours continuous + paged", "HF continuous + paged")


def poisson_arrivals(n: int, rate: float, seed: int) -> list:
    """n arrival times in seconds from 0, a Poisson process of `rate` requests per second: the first at 0, the gaps
    exponential with mean 1 / rate, drawn from ``random.Random(seed)`` (the same schedule for every system)."""
    import random

    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    rng, times, clock = random.Random(seed), [], 0.0
    for _ in range(n):
        times.append(clock)
        clock += rng.expovariate(rate)
    return times


def _sleep_until(start: float, at: float) -> None:
    """Wait until `at` seconds after the perf_counter reading `start`."""
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _replay_engine(engine, requests: list, arrivals: list) -> dict:
    """Replay `requests` arriving at `arrivals` (seconds) in real time against ``Engine``'s online API: each request
    is added once its arrival has passed (between steps), ``step`` runs while work remains. Returns {name: (tokens,
    token times in seconds since the replay began)}."""
    engine.reset()
    start, pending = engine.start_time, list(zip(arrivals, requests))
    while pending or engine.waiting or engine.running:
        while pending and pending[0][0] <= time.perf_counter() - start:
            engine.add_request(pending.pop(0)[1])
        if engine.waiting or engine.running:
            engine.step()
        else:
            _sleep_until(start, pending[0][0])
    return {name: (r.tokens, r.token_times) for name, r in engine.results.items()}


def _replay_static(model, requests: list, arrivals: list, max_batch_size: int) -> dict:
    """The same replay against static batching: when no batch runs, the requests that have arrived (first come, at
    most max_batch_size) form the next batch, served by ``static_batching`` to its end; a request arriving meanwhile
    waits for the batch after. Returns what ``_replay_engine`` returns."""
    import dataclasses

    from .serving import static_batching

    out, start, pending = {}, time.perf_counter(), list(zip(arrivals, requests))
    while pending:
        _sleep_until(start, pending[0][0])
        now = time.perf_counter() - start
        batch = [r for at, r in pending[:max_batch_size] if at <= now]
        pending = pending[len(batch):]
        began = time.perf_counter() - start  # static_batching's own clock starts just after: its times + began
        results, _ = static_batching(model, [dataclasses.replace(r, arrival=0) for r in batch], max_batch_size)
        out.update({name: (r.tokens, [began + t for t in r.token_times]) for name, r in results.items()})
    return out


def _replay_hf(hf_model, requests: list, arrivals: list, num_blocks: int, block_size: int, token_budget: int,
               seen: dict) -> dict:
    """The same replay against Hugging Face's continuous batching (the manager behind ``generate_batch``, configured
    as ``hf_serve`` does): its generation thread runs the steps while this thread adds each request at its arrival
    time (``add_request`` with its own max_new_tokens), then collects the results. Records in `seen` the attention
    implementation it runs and (a set) the torch threads of its generation thread. Returns what ``_replay_engine`` returns (token times from its timestamps)."""
    from .hf import _transformers

    transformers = _transformers()
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1,
                                                      max_new_tokens=max(r.max_new_tokens for r in requests))
    cb_config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=token_budget,
                                         allow_block_sharing=False, use_async_batching=False)
    outputs = {}
    with hf_model.continuous_batching_context_manager(generation_config=generation_config, warmup=True,
                                                      continuous_batching_config=cb_config) as manager:
        processor = manager.batch_processor
        update_batch = processor.update_batch
        seen["attention"] = hf_model.config._attn_implementation  # the one it switched to for continuous batching

        def update_and_note():  # runs in the generation thread, after each forward pass
            update_batch()
            seen.setdefault("threads", set()).add(torch.get_num_threads())

        processor.update_batch = update_and_note
        start = time.perf_counter()
        for at, r in zip(arrivals, requests):
            _sleep_until(start, at)
            manager.add_request(r.prompt, request_id=r.name, max_new_tokens=r.max_new_tokens, record_timestamps=True)
        _collect_hf(manager, outputs, len(requests))
    failed = [o.request_id for o in outputs.values() if o.error is not None]
    if failed:
        raise RuntimeError(f"Hugging Face's continuous batching failed requests {failed}")
    return {o.request_id: (list(o.generated_tokens), [t - start for t in o.timestamps]) for o in outputs.values()}


def bench_serve_wall(rates=WALL_RATES, n_requests: int = 32, block_size: int = 8, token_budget: int = 64,
                     max_batch_size: int = 8, threads: int = 1, warmup: int = 1, repeats: int = 3, seed: int = 3) -> dict:
    """The load sweep on the wall clock, Hugging Face included: the same requests arriving as a Poisson process at each
    rate (requests per second), replayed in real time against static batching, our engine and Hugging Face's.

    Requests: ``make_trace(n_requests, seed, mean_gap=0)`` on the course model (its arrivals unused); arrival times:
    ``poisson_arrivals(n_requests, rate, seed)`` per rate, the same for the three systems. Static batching:
    ``_replay_static`` (batches of max_batch_size, rows sized by the true output lengths: the oracle); ours:
    ``Engine`` with a pool that holds every request at once, blocks of block_size tokens, token_budget tokens per
    step, driven by ``_replay_engine``; Hugging Face: ``_replay_hf`` with the same pool, page size and budget. Greedy,
    the same weights (``to_hf``), `threads` torch threads. warmup untimed replays of the first 4 requests per system,
    then repeats rounds, each replaying every (rate, system) once in turn, round k starting with system k mod 3 (so that
    background load hits all alike).
    A row per (rate, system): tokens/s (generated tokens / seconds from the first arrival to the last token; median of
    the rounds), TTFT (first token - arrival, seconds) and TPOT ((last token - first token) / (tokens - 1)), p50 and
    p95 (nearest rank) over every request of every round; `differ`: how many (round, request) pairs' tokens differ
    from the request generated alone (``generate_cached``), of `checked`. Returns {"rows": [...], ...}.
    """
    from .hf import to_hf
    from .serving import Engine, make_trace

    if repeats < 1 or warmup < 0 or not rates:
        raise ValueError(f"need repeats >= 1, warmup >= 0 and at least one rate; got {repeats}, {warmup}, {rates}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    hf_seen: dict = {}
    try:
        model = serve_model("char-gpt")
        hf_model = to_hf(model)
        use_fastest_kernels(model, rows=[1 << i for i in range(7)])
        V, context = model.config.vocab_size, model.config.block_size
        requests = make_trace(n_requests, seed=seed, context=context, vocab=list(range(V)), mean_gap=0)
        with torch.inference_mode():
            alone = {r.name: generate_cached(model, torch.tensor([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
                     for r in requests}
        num_blocks = sum(math.ceil((len(r.prompt) + r.max_new_tokens) / block_size) for r in requests)
        engine = Engine(model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget)
        systems = {
            WALL_SYSTEMS[0]: lambda reqs, at: _replay_static(model, reqs, at, max_batch_size),
            WALL_SYSTEMS[1]: lambda reqs, at: _replay_engine(engine, reqs, at),
            WALL_SYSTEMS[2]: lambda reqs, at: _replay_hf(hf_model, reqs, at, num_blocks, block_size, token_budget, hf_seen),
        }
        schedules = {rate: poisson_arrivals(n_requests, rate, seed) for rate in rates}
        for run in systems.values():  # warm-up: allocator, first-call overheads
            for _ in range(warmup):
                run(requests[:4], [0.0] * 4)
        runs = {(rate, system): [] for rate in rates for system in systems}
        order = list(systems)
        for k in range(repeats):
            for rate, arrivals in schedules.items():
                for system in order[k % len(order):] + order[:k % len(order)]:  # each round starts with the next system
                    runs[rate, system].append(systems[system](requests, arrivals))
    finally:
        torch.set_num_threads(previous_threads)
    arrival_of = {rate: {r.name: at for r, at in zip(requests, arrivals)} for rate, arrivals in schedules.items()}
    rows = []
    for (rate, system), these in runs.items():
        ttft = [times[0] - arrival_of[rate][name] for run in these for name, (_, times) in run.items()]
        tpot = [(times[-1] - times[0]) / (len(times) - 1) for run in these for _, times in run.values() if len(times) > 1]
        per_s = [sum(len(tokens) for tokens, _ in run.values()) / max(times[-1] for _, times in run.values())
                 for run in these]
        rows.append({"rate": rate, "system": system, "requests": len(these[-1]),
                     "tokens": sum(len(tokens) for tokens, _ in these[-1].values()),
                     "tokens_per_s": statistics.median(per_s), "runs_tokens_per_s": per_s,
                     "ttft_p50": _percentile(ttft, 0.5), "ttft_p95": _percentile(ttft, 0.95),
                     "tpot_p50": _percentile(tpot, 0.5), "tpot_p95": _percentile(tpot, 0.95),
                     "differ": sum(run.get(name, (None,))[0] != tokens for run in these for name, tokens in alone.items()),
                     "checked": len(these) * len(alone)})
    return {"rows": rows, "threads": threads, "repeats": repeats, "warmup": warmup, "n_requests": n_requests,
            "block_size": block_size, "token_budget": token_budget, "max_batch_size": max_batch_size,
            "hf_threads": sorted(hf_seen.get("threads", ())), "attn_implementation": hf_seen.get("attention")}


def format_serve_wall(result: dict) -> str:
    """The wall-clock sweep's table, as `course bench serve` prints it."""
    r = result
    lines = [f"wall-clock sweep: char-gpt, the same {r['n_requests']} requests arriving as a Poisson process at each rate "
             f"(requests per second), replayed in real time; {r['threads']} thread(s); tokens/s: median of {r['repeats']} "
             f"rounds after {r['warmup']} warm-up; TTFT (from arrival), TPOT: every request of every round",
             f"static: batches of {r['max_batch_size']} formed when the previous one ends (rows sized by the true output "
             f"lengths: an oracle); ours: Engine.add_request/step, blocks of {r['block_size']}, {r['token_budget']} tokens "
             f"per step; HF: its continuous batching manager (generate_batch's), add_request at each arrival, the same pool "
             f"and budget (attention {r['attn_implementation']}, torch threads in its generation thread {r['hf_threads']})",
             f"{'req/s':>5s} {'system':24s} {'tokens':>6s} {'tokens/s':>8s} {'TTFT ms p50':>11s} {'p95':>6s} "
             f"{'TPOT ms p50':>11s} {'p95':>6s} {'differ from alone':>17s}"]
    for row in r["rows"]:
        lines.append(f"{row['rate']:5.0f} {row['system']:24s} {row['tokens']:6d} {row['tokens_per_s']:8.0f} "
                     f"{row['ttft_p50'] * 1e3:11.1f} {row['ttft_p95'] * 1e3:6.1f} {row['tpot_p50'] * 1e3:11.2f} "
                     f"{row['tpot_p95'] * 1e3:6.2f} {row['differ']:>8d} of {row['checked']:<5d}")
    lines.append("differ from alone: (round, request) pairs whose greedy tokens differ from the request generated alone "
                 "(generate_cached); greedy, so none should, unless float rounding flips a near tie")
    return "\n".join(lines)


#: ``course bench serve``'s targets for the engine's speed (issue 33): a decode-only step at most this many times
#: static batching's at the same batch size and contexts, throughput at least Hugging Face's, 2 threads no slower than 1
SERVE_TARGETS = {"decode_step": 1.2, "versus_hf": 1.0, "two_threads": 1.0}


def _decode_step_seconds(trace, batch_size: int) -> float:
    """The median seconds of a run's decode-only steps of batch_size sequences (no prompt chunk in them)."""
    return statistics.median(s for s, p, b in zip(trace.step_seconds, trace.prefill, trace.batch) if p == 0 and b == batch_size)


def bench_serve_speed(models=SERVE_MODELS, serve_result: dict | None = None, batch_size: int = 8, prompt_len: int = 32,
                      new_tokens: int = 32, block_size: int = 8, token_budget: int = 64, mean_gap: float = 0.5,
                      n_requests: dict | int | None = None, threads: tuple = (1, 2), warmup: int = 1, repeats: int = 3,
                      seed: int = 0) -> dict:
    """The engine's speed against its targets (``SERVE_TARGETS``); every ratio is the median of per-round ratios, the
    contenders alternating within each round (so that background load hits both alike).

    * decode step: batch_size requests of prompt_len random tokens, new_tokens each, all at step 0, served by
      ``Engine`` (token budget batch_size * prompt_len: one prefill step, then decode-only steps of batch_size
      sequences) and by ``static_batching`` (one batch): the same sequences at the same contexts in every decode step.
      Per run, the median seconds of its decode-only steps of batch_size sequences; the ratio engine / static.
    * versus HF: ours continuous / Hugging Face's ``generate_batch`` manager, tokens/s of each round of `serve_result`
      (``bench_serve``'s "all at 0" rows, whose rounds alternate the systems), per model.
    * threads: the engine (``bench_serve``'s settings) on the model's trace with its arrivals, at threads[1] and at
      threads[0] torch threads in turn; the ratio of tokens/s, threads[1] / threads[0] (the target: >= 1, no slower).
    Returns {"rows": [...], ...}; each row: model, what, ratio, runs (the per-round ratios), target.
    """
    from .serving import Engine, Request, make_trace, static_batching

    previous_threads = torch.get_num_threads()
    counts = dict(SERVE_REQUESTS) if n_requests is None else (
        {m: n_requests for m in SERVE_MODELS} if isinstance(n_requests, int) else {**SERVE_REQUESTS, **n_requests})
    rows = []
    try:
        for name in models:
            torch.set_num_threads(threads[0])
            model = serve_model(name, seed)
            use_fastest_kernels(model, rows=[1 << i for i in range(7)])
            V, context = model.config.vocab_size, model.config.block_size
            g = torch.Generator().manual_seed(seed)
            same = [Request(f"d{i}", torch.randint(0, V, (prompt_len,), generator=g).tolist(), new_tokens)
                    for i in range(batch_size)]
            blocks = batch_size * math.ceil((prompt_len + new_tokens) / block_size)
            engine = Engine(model, num_blocks=blocks, block_size=block_size, token_budget=batch_size * prompt_len)
            contenders = {"engine": lambda: engine.run(same)[1], "static": lambda: static_batching(model, same, batch_size)[1]}
            for run in contenders.values():
                for _ in range(warmup):
                    run()
            ratios = []
            for _ in range(repeats):
                seconds = {who: _decode_step_seconds(run(), batch_size) for who, run in contenders.items()}
                ratios.append(seconds["engine"] / seconds["static"])
            rows.append({"model": name, "what": f"decode-only step, engine / static batching (batch {batch_size}, "
                                                f"contexts {prompt_len + 1}..{prompt_len + new_tokens - 1})",
                         "ratio": statistics.median(ratios), "runs": ratios, "target": ("<=", SERVE_TARGETS["decode_step"])})
            if serve_result is not None:
                per_s = {r["system"]: r["runs_tokens_per_s"] for r in serve_result["rows"]
                         if r["model"] == name and r["arrivals"] == "all at 0"}
                if SERVE_SYSTEMS[2] in per_s:
                    ratios = [ours / hf for ours, hf in zip(per_s[SERVE_SYSTEMS[0]], per_s[SERVE_SYSTEMS[2]])]
                    rows.append({"model": name, "what": "tokens/s, ours continuous / HF generate_batch (all at 0)",
                                 "ratio": statistics.median(ratios), "runs": ratios,
                                 "target": (">=", SERVE_TARGETS["versus_hf"])})
            trace = make_trace(counts[name], seed=seed, context=context, vocab=list(range(V)), mean_gap=mean_gap)
            num_blocks = sum(math.ceil((len(r.prompt) + r.max_new_tokens) / block_size) for r in trace)
            engine = Engine(model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget)
            for n in threads:  # warm-up: the kernels of every row count at n threads (course_lib.kernels), and runs
                torch.set_num_threads(n)
                use_fastest_kernels(model, rows=[1 << i for i in range(7)])
                for _ in range(warmup):
                    engine.run(trace[:4])
            ratios = []
            for _ in range(repeats):
                per_s = {}
                for n in threads:
                    torch.set_num_threads(n)
                    results, run = engine.run(trace)
                    per_s[n] = sum(len(r.tokens) for r in results.values()) / run.seconds
                ratios.append(per_s[threads[1]] / per_s[threads[0]])
            rows.append({"model": name, "what": f"tokens/s of the engine on the trace, {threads[1]} threads / {threads[0]}",
                         "ratio": statistics.median(ratios), "runs": ratios, "target": (">=", SERVE_TARGETS["two_threads"])})
    finally:
        torch.set_num_threads(previous_threads)
    return {"rows": rows, "repeats": repeats, "warmup": warmup, "threads": threads}


def format_serve_speed(result: dict) -> str:
    """The engine's speed against its targets, as `course bench serve` prints it after its table."""
    lines = [f"the engine's speed against its targets (median of {result['repeats']} rounds' ratios, the contenders "
             f"alternating in each round, after {result['warmup']} warm-up run(s)):"]
    for row in result["rows"]:
        op, target = row["target"]
        met = row["ratio"] <= target if op == "<=" else row["ratio"] >= target
        lines.append(f"  {row['model']:10s} {row['what']:92s} {row['ratio']:5.2f}x  (target {op} {target}x: "
                     f"{'met' if met else 'NOT met'}; rounds {', '.join(f'{r:.2f}' for r in row['runs'])})")
    return "\n".join(lines)


#: Llama-style shapes of ``course bench decode`` (random weights): char-llama's, and a 12-layer model of GPT-2 small's
#: width with 4 key/value heads and a 32,000-token vocabulary (Llama's)
LLAMA_DECODE_SHAPES = {
    "tiny": dict(vocab_size=103, block_size=1024, n_layer=4, n_head=4, n_embd=128, n_kv_head=2, intermediate_size=352),
    "llama-small": dict(vocab_size=32000, block_size=1024, n_layer=12, n_head=12, n_embd=768, n_kv_head=4,
                        intermediate_size=2048),
}
#: the Llama shape that `--shapes` runs for each GPT shape (the same width and depth)
LLAMA_FOR_GPT_SHAPE = {"tiny": "tiny", "gpt2-small": "llama-small"}


def bench_llama_decode(shapes=("tiny", "llama-small"), batch_sizes=(1, 8), new_tokens: int = 128, prompt_len: int = 16,
                       threads: int = 2, warmup: int = 1, repeats: int = 5, seed: int = 0) -> dict:
    """Greedy decoding speed of our Llama-style model (``generate_llama``, KV cache) and of Hugging Face's
    LlamaForCausalLM ``generate`` (use_cache=True) with the same weights (``llama_to_hf``), float32.

    For each shape and batch size: random weights (seeded), a random prompt of prompt_len tokens, new_tokens new
    tokens, warmup untimed runs, then repeats timed runs alternating between the two; the median gives
    tokens/s = B * new_tokens / seconds, and "vs HF" = ours / HF. Returns {"rows": [...], ...}.
    """
    from .hf import llama_to_hf
    from .llama import Llama, LlamaConfig, generate_llama

    unknown = sorted(set(shapes) - set(LLAMA_DECODE_SHAPES))
    if unknown:
        raise ValueError(f"shapes must be among {sorted(LLAMA_DECODE_SHAPES)}, got {unknown}")
    if repeats < 1 or warmup < 0 or new_tokens < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, new_tokens >= 1; got {repeats}, {warmup}, {new_tokens}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for shape in shapes:
            torch.manual_seed(seed)
            config = LlamaConfig(**LLAMA_DECODE_SHAPES[shape])
            ours = Llama(config).eval()
            theirs = llama_to_hf(ours)
            use_fastest_kernels(ours, rows=batch_sizes)  # the faster kernel per weight, measured here
            for B in batch_sizes:
                prompt = torch.randint(0, config.vocab_size, (B, prompt_len), generator=torch.Generator().manual_seed(seed + B))
                runs = {"ours (generate_llama)": lambda n: generate_llama(ours, prompt, n),
                        "HF LlamaForCausalLM generate": lambda n: hf_generate(theirs, prompt, n, True)}
                outputs, times = {}, {name: [] for name in runs}
                for name, run in runs.items():
                    for _ in range(warmup):
                        run(min(new_tokens, 8))
                for _ in range(repeats):
                    for name, run in runs.items():
                        start = time.perf_counter()
                        outputs[name] = run(new_tokens)
                        times[name].append(time.perf_counter() - start)
                same = torch.equal(*outputs.values())
                these = [{"shape": shape, "batch_size": B, "impl": name, "new_tokens": new_tokens,
                          "seconds": statistics.median(times[name]), "times": times[name], "same_tokens_as_hf": same}
                         for name in runs]
                for row in these:
                    row["tokens_per_s"] = B * new_tokens / row["seconds"]
                for row in these:
                    row["ratio_to_hf"] = row["tokens_per_s"] / these[-1]["tokens_per_s"]
                rows.extend(these)
    finally:
        torch.set_num_threads(previous_threads)
    return {"rows": rows, "threads": threads, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len,
            "kernels": chosen_kernels()}


def format_llama_decode(result: dict) -> str:
    """The Llama table `course bench decode` prints."""
    lines = [f"Llama-style (chapter 11): greedy decoding from a {result['prompt_len']}-token prompt, random weights, "
             f"{result['threads']} threads, median of {result['repeats']} runs after {result['warmup']} warm-up run(s)",
             f"{'shape':11s} {'B':>2s}  {'implementation':29s} {'new':>4s} {'ms/step':>8s} {'tokens/s':>9s} {'vs HF':>6s}"]
    for row in result["rows"]:
        lines.append(f"{row['shape']:11s} {row['batch_size']:>2d}  {row['impl']:29s} {row['new_tokens']:>4d} "
                     f"{row['seconds'] / row['new_tokens'] * 1e3:>8.2f} {row['tokens_per_s']:>9.1f} {row['ratio_to_hf']:>5.2f}x")
    agree = {(r["shape"], r["batch_size"]): r["same_tokens_as_hf"] for r in result["rows"]}
    lines.append("ours == HF, same tokens: " + ", ".join(f"{s} B={b}: {'yes' if v else 'NO'}" for (s, b), v in agree.items()))
    lines.append("(vs HF: ours / Hugging Face's LlamaForCausalLM.generate, same weights, use_cache=True; floor >= 1.0x)")
    lines.append(format_kernels(result.get("kernels", {})))
    return "\n".join(lines)


def _llama_rows(args) -> dict:
    """bench_llama_decode with the command line's options (each GPT shape of --shapes stands for the Llama shape of its
    width and depth, LLAMA_FOR_GPT_SHAPE)."""
    shapes = tuple(LLAMA_FOR_GPT_SHAPE[s] for s in args.shapes)
    if args.quick:
        return bench_llama_decode(shapes=shapes, new_tokens=32, threads=args.threads, warmup=0, repeats=args.repeats or 1)
    return bench_llama_decode(shapes=shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=min(args.tokens, 128),
                              threads=args.threads, repeats=args.repeats or 5)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grade"]:  # grading speed: its own options
        from .grading.bench import main as bench_grade_main

        return bench_grade_main(argv[1:])
    if argv[:1] == ["serve-http"]:  # the engine behind HTTP: its own options
        from .server import bench_main as bench_serve_http_main

        return bench_serve_http_main(argv[1:])
    parser = argparse.ArgumentParser(prog="course bench", description="benchmarks (they print; they assert nothing); "
                                                                      "`course bench grade --help` for grading speed")
    parser.add_argument("what", choices=["train", "decode", "serve"],
                        help="train: a training step of our GPT vs Hugging Face's GPT-2; decode: greedy decoding speed, "
                             "cached and uncached, vs Hugging Face's generate; serve: many requests at once, our continuous "
                             "batching with a paged cache vs our static batching and Hugging Face's continuous batching")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats; the median is reported (default: 7 for train, 5 for decode, 3 for serve)")
    parser.add_argument("--steps", type=int, default=10, help="train: training steps per repeat (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 2; serve: 1, because a serving step is many small ops, and on a "
                             "shared machine each 2-thread op can wait for a descheduled thread; the engine runs its small "
                             "passes on one thread whatever this says: the 2-threads row compares)")
    parser.add_argument("--tokens", type=int, default=256, help="decode: new tokens of the cached rows (default: %(default)s)")
    shapes = sorted(set(DECODE_SHAPES) | set(SERVE_MODELS))
    parser.add_argument("--shapes", nargs="+", default=None, choices=shapes,
                        help=f"models: decode {list(DECODE_SHAPES)} (default: both), serve {list(SERVE_MODELS)} (default: both)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode: batch sizes (default: 1 8)")
    parser.add_argument("--requests", type=int, default=None,
                        help="serve: requests in the trace of every model (default: "
                             + ", ".join(f"{m} {n}" for m, n in SERVE_REQUESTS.items()) + ")")
    parser.add_argument("--quick", action="store_true",
                        help="decode: 32 new tokens (8 uncached), 1 run, no warm-up; serve: 8 requests, 1 run, no warm-up "
                             "(a smoke run)")
    parser.add_argument("--family", choices=["all", "gpt", "llama"], default="all",
                        help="decode: GPT-2-style rows (chapters 05 and 08), Llama-style rows (chapter 11), or both (default)")
    args = parser.parse_args(argv)
    allowed = {"decode": DECODE_SHAPES, "serve": SERVE_MODELS}.get(args.what, ())
    if args.shapes and any(s not in allowed for s in args.shapes):
        parser.error(f"--shapes for {args.what} must be among {list(allowed)}, got {args.shapes}")
    if args.what == "serve":
        models, threads = args.shapes or list(SERVE_MODELS), args.threads or 1
        if args.quick:
            result = bench_serve(models=models, n_requests=args.requests or 8, threads=threads, warmup=0,
                                 repeats=args.repeats or 1)
        else:
            result = bench_serve(models=models, n_requests=args.requests, threads=threads, repeats=args.repeats or 3)
        print(format_serve(result))
        print()
        if args.quick:
            load = bench_serve_load(rates=SWEEP_RATES[-1:], budgets=SWEEP_BUDGETS[-1:], n_requests=args.requests or 8,
                                    threads=threads, repeats=args.repeats or 1)
        else:
            load = bench_serve_load(threads=threads, repeats=args.repeats or 3)
        print(format_serve_load(load))
        print()
        if args.quick:
            wall = bench_serve_wall(rates=WALL_RATES[-1:], n_requests=args.requests or 8, threads=threads, warmup=0,
                                    repeats=args.repeats or 1)
        else:
            wall = bench_serve_wall(threads=threads, repeats=args.repeats or 3)
        print(format_serve_wall(wall))
        print()
        quick = dict(new_tokens=8, n_requests=args.requests or 8, warmup=0, repeats=args.repeats or 1) if args.quick else \
            dict(n_requests=args.requests, repeats=args.repeats or 3)
        print(format_serve_speed(bench_serve_speed(models=models, serve_result=result, threads=(threads, 2 * threads),
                                                   **quick)))
        return 0
    args.threads = args.threads or 2
    if args.what == "decode":
        shapes = args.shapes = args.shapes or list(DECODE_SHAPES)
        if args.family == "llama":
            print(format_llama_decode(_llama_rows(args)))
            return 0
        if args.quick:
            result = bench_decode(shapes=shapes, new_tokens=32, uncached_tokens={s: 8 for s in DECODE_SHAPES},
                                  threads=args.threads, warmup=0, repeats=args.repeats or 1)
        else:
            result = bench_decode(shapes=shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=args.tokens,
                                  threads=args.threads, repeats=args.repeats or 5)
        print(format_decode(result))
        if args.family == "all":
            print()
            print(format_llama_decode(_llama_rows(args)))
        return 0
    repeats = args.repeats or 7
    result = bench_train(threads=args.threads, repeats=repeats, steps_per_repeat=args.steps)
    c = result["config"]
    print(f"training step, batch {result['batch_size']} x block {c.block_size}, {c.n_layer} layers, {c.n_embd} dims, "
          f"{c.n_head} heads, vocab {c.vocab_size}, {result['threads']} threads, median of {repeats} x {args.steps} steps")
    print(f"  ours (course_lib.gpt.GPT):          {result['ours_s'] * 1e3:8.2f} ms/step")
    print(f"  Hugging Face GPT2LMHeadModel ({result['attn_implementation']}): {result['hf_s'] * 1e3:8.2f} ms/step")
    print(f"  ratio ours / HF: {result['ratio']:.2f}x  (target <= 1.0x)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
