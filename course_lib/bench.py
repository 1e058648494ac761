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
from .gpt import GPT, GPTConfig
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
    for _ in range(max_new_tokens):
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in tr.h:
            x = block(x)
        nxt = model.lm_head(tr.ln_f(x[:, -1])).argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def hf_generate(model, idx, max_new_tokens: int, use_cache: bool = True):
    """Greedy decoding with Hugging Face's generate: exactly max_new_tokens new tokens, no padding. (B, T) -> (B, T + n)."""
    with torch.inference_mode():
        return model.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, use_cache=use_cache,
                              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Measured read bandwidth in bytes/s: the best of `repeats` timed sums of a float32 tensor of nbytes bytes
    (after one warm-up sum), at the current thread count."""
    buffer = torch.ones(max(1, nbytes // 4))
    buffer.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


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
    bandwidth (measured after each repeat's runs, best of 3 sums; the median over the repeats) / the bytes
    of the weights a step reads. Returns {"rows": [...], "bound": {...} or None, ...}.
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
                        bandwidths.append(read_bandwidth(decode_weight_bytes(ours), repeats=3))
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
                    bandwidth = statistics.median(bandwidths)  # the median, as for the tokens/s beside it
                    bound = {"bandwidth": bandwidth, "bandwidths": bandwidths, "formats": {}}
                    for weights, model, impl in (("float32", ours, "ours, cached"), ("int8", ours_int8, "ours int8, cached"),
                                                 ("bfloat16", ours_bf16, "ours bf16, cached")):
                        weight_bytes = decode_weight_bytes(model)
                        row = next(r for r in these if r["impl"] == impl)
                        bound["formats"][weights] = {"weight_bytes": weight_bytes, "tokens_per_s": bandwidth / weight_bytes,
                                                     "fraction": row["tokens_per_s"] * weight_bytes / bandwidth}
    finally:
        torch.set_num_threads(previous_threads)
    return {"rows": rows, "bound": bound, "threads": threads, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len}


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
                     f"(median of [{spread}] GB/s: sums of a float32 tensor the size of the float32 weights, measured "
                     "between the repeats) / weights read per step:")
        for weights, b in bound["formats"].items():
            lines.append(f"  {weights:8s} {b['weight_bytes'] / 1e6:6.1f} MB -> {b['tokens_per_s']:6.1f} tokens/s; "
                         f"ours cached reaches {b['fraction']:.0%} of it" + (" (target >= 50%)" if weights == "float32" else ""))
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
    return {"rows": rows, "threads": threads, "repeats": repeats, "warmup": warmup, "prompt_len": prompt_len}


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
    parser = argparse.ArgumentParser(prog="course bench", description="benchmarks (they print; they assert nothing); "
                                                                      "`course bench grade --help` for grading speed")
    parser.add_argument("what", choices=["train", "decode"],
                        help="train: a training step of our GPT vs Hugging Face's GPT-2; decode: greedy decoding speed, "
                             "cached and uncached, vs Hugging Face's generate")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats; the median is reported (default: 7 for train, 5 for decode)")
    parser.add_argument("--steps", type=int, default=10, help="train: training steps per repeat (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=256, help="decode: new tokens of the cached rows (default: %(default)s)")
    parser.add_argument("--shapes", nargs="+", default=list(DECODE_SHAPES), choices=list(DECODE_SHAPES), help="decode: model shapes")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode: batch sizes (default: 1 8)")
    parser.add_argument("--quick", action="store_true", help="decode: 32 new tokens (8 uncached), 1 run, no warm-up (a smoke run)")
    parser.add_argument("--family", choices=["all", "gpt", "llama"], default="all",
                        help="decode: GPT-2-style rows (chapters 05 and 08), Llama-style rows (chapter 11), or both (default)")
    args = parser.parse_args(argv)
    if args.what == "decode" and args.family == "llama":
        print(format_llama_decode(_llama_rows(args)))
        return 0
    if args.what == "decode":
        if args.quick:
            result = bench_decode(shapes=args.shapes, new_tokens=32, uncached_tokens={s: 8 for s in DECODE_SHAPES},
                                  threads=args.threads, warmup=0, repeats=args.repeats or 1)
        else:
            result = bench_decode(shapes=args.shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=args.tokens,
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
