"""``course bench``: the benchmarks, our code against Hugging Face's on the same weights (they print; they assert nothing).

``course bench train``: a training step (``train``). ``course bench decode``: greedy decoding, cached and uncached,
float32, int8 and bfloat16 weights, with the memory-bandwidth bound; then chapter 11's Llama-style model (``decode``).
``course bench serve``: many requests at once, continuous batching over a paged cache against static batching and
Hugging Face's continuous batching, the load sweeps and the engine's speed against its targets (``serve``).
``course bench serve-http``: ``course serve`` under Poisson arrivals over HTTP (``serve_http``). ``course bench structured``:
chapter 15's token index and per-step constraint against xgrammar and outlines-core (``structured``). ``course bench grade``:
grading speed (``course_lib.grading.bench``, with the grading code it times). ``course bench tensor-parallel``:
chapter 16's decoding sharded across 1 and 2 processes against one process (``tensor_parallel``).

The modules: ``timing`` (a torch thread count for a block, contenders timed alternately after a warm-up),
``hf_adapters`` (every use of transformers' internals, tied to the pinned version), and one per benchmark. Every
contender of a benchmark is timed alternately with the others in one process, so that background load hits all alike.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: Each public name and the module it lives in: imported on first use (PEP 562), so that importing one module of the
#: package (``course_lib.bench.timing``, as the timed notebooks do) does not import every benchmark and what they import
#: (``structured``: xgrammar, transformers)
_NAMES = {
    "decode": ("DECODE_SHAPES", "LLAMA_DECODE_SHAPES", "LLAMA_FOR_GPT_SHAPE", "LLAMA_MAX_TOKENS", "READ_WIDTHS",
               "UNCACHED_TOKENS", "bench_decode", "bench_decode_threads", "bench_llama_decode", "check_thread_counts",
               "format_decode", "format_decode_threads", "format_kernels", "format_llama_decode", "greedy_uncached",
               "read_bandwidth", "read_bandwidths"),
    "hf_adapters": ("TRANSFORMERS_VERSION", "hf_generate", "hf_replay", "hf_serve"),
    "serve": ("SERVE_MODELS", "SERVE_REQUESTS", "SERVE_SYSTEMS", "SERVE_TARGETS", "SWEEP_BUDGETS", "SWEEP_RATES",
              "WALL_RATES", "WALL_SYSTEMS", "bench_serve", "bench_serve_load", "bench_serve_speed", "bench_serve_wall",
              "format_serve", "format_serve_load", "format_serve_speed", "format_serve_wall", "poisson_arrivals",
              "serve_model", "serve_ratios"),
    "serve_http": ("bench_serve_http", "format_serve_http"),
    "structured": ("bench_engine", "bench_index", "bench_step", "format_structured"),
    "tensor_parallel": ("TP_WORLD_SIZES", "bench_tensor_parallel", "format_tensor_parallel"),
    "timing": ("Runs", "alternate", "threads"),
    "train": ("bench_train", "format_train"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name: str):
    """A public name of a benchmark module, imported on first use and kept here (a name set here first, a test's
    stand-in say, is the one found)."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    return globals().setdefault(name, value)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


def _import_all() -> None:
    """Every public name into this module's namespace, where ``main`` and its helpers look them up (names set here
    already, a test's stand-ins, are kept)."""
    for name in _MODULE_OF:
        __getattr__(name)

__all__ = [*_MODULE_OF, "main"]

#: ``--quick`` (a smoke run): new tokens of the cached and of the uncached decode rows, requests per serve trace, new
#: tokens per request of the engine's decode-step target; one run, no warm-up
QUICK_TOKENS, QUICK_UNCACHED_TOKENS, QUICK_REQUESTS, QUICK_SPEED_TOKENS = 32, 8, 8, 8
QUICK_RATIO_SECONDS = 2.0  # --quick: each of the engine's own speed ratios timed for about this long
#: New tokens of ``--thread-counts``' rows at most (each row runs once per thread count)
THREADS_TOKENS = 64
#: Timed repeats by default
REPEATS = {"train": 7, "decode": 5, "serve": 3, "structured": 20}
#: Torch threads by default (serve: 1, see its --threads help)
THREADS = {"train": 2, "decode": 2, "serve": 1, "structured": 1}


def _llama_rows(args) -> dict:
    """bench_llama_decode with the command line's options (each GPT shape of --shapes stands for the Llama shape of its
    width and depth, LLAMA_FOR_GPT_SHAPE)."""
    shapes = tuple(LLAMA_FOR_GPT_SHAPE[s] for s in args.shapes)
    if args.quick:
        return bench_llama_decode(shapes=shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=QUICK_TOKENS,
                                  threads=args.threads, warmup=0, repeats=args.repeats or 1)
    return bench_llama_decode(shapes=shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=min(args.tokens, LLAMA_MAX_TOKENS),
                              threads=args.threads, repeats=args.repeats or REPEATS["decode"])


def _serve(args) -> None:
    """``course bench serve``: its table, the load sweep, the wall-clock sweep, the engine's speed against its targets.
    The benchmarks are looked up here, in this module, at each call (tests shrink them by patching these names)."""
    models, threads = args.shapes or list(SERVE_MODELS), args.threads or THREADS["serve"]
    repeats = args.repeats or (1 if args.quick else REPEATS["serve"])
    if args.quick:
        result = bench_serve(models=models, n_requests=args.requests or QUICK_REQUESTS, threads=threads, warmup=0,
                             repeats=repeats)
    else:
        result = bench_serve(models=models, n_requests=args.requests, threads=threads, repeats=repeats)
    print(format_serve(result))
    print()
    if args.quick:
        load = bench_serve_load(rates=SWEEP_RATES[-1:], budgets=SWEEP_BUDGETS[-1:], n_requests=args.requests or QUICK_REQUESTS,
                                threads=threads, repeats=repeats)
    else:
        load = bench_serve_load(threads=threads, repeats=repeats)
    print(format_serve_load(load))
    print()
    if args.quick:
        wall = bench_serve_wall(rates=WALL_RATES[-1:], n_requests=args.requests or QUICK_REQUESTS, threads=threads, warmup=0,
                                repeats=repeats)
    else:
        wall = bench_serve_wall(threads=threads, repeats=repeats)
    print(format_serve_wall(wall))
    print()
    quick = dict(new_tokens=QUICK_SPEED_TOKENS, n_requests=args.requests or QUICK_REQUESTS, warmup=0, repeats=repeats,
                 ratio_seconds=QUICK_RATIO_SECONDS) \
        if args.quick else dict(n_requests=args.requests, repeats=repeats)
    print(format_serve_speed(bench_serve_speed(models=models, serve_result=result, threads=(threads, 2 * threads), **quick)))


def _decode(args) -> None:
    """``course bench decode``: the GPT table, the Llama table, or both (--family); then, with --thread-counts, the GPT
    cached rows at each thread count."""
    args.shapes = args.shapes or list(DECODE_SHAPES)
    printed = []

    def show(table: str) -> None:  # each table as soon as it is measured, a blank line between two
        print(("\n" if printed else "") + table, flush=True)
        printed.append(table)

    if args.family != "llama":
        if args.quick:
            result = bench_decode(shapes=args.shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=QUICK_TOKENS,
                                  uncached_tokens={s: QUICK_UNCACHED_TOKENS for s in DECODE_SHAPES},
                                  threads=args.threads, warmup=0, repeats=args.repeats or 1)
        else:
            result = bench_decode(shapes=args.shapes, batch_sizes=tuple(args.batch_sizes), new_tokens=args.tokens,
                                  threads=args.threads, repeats=args.repeats or REPEATS["decode"])
        show(format_decode(result))
    if args.family != "gpt":
        show(format_llama_decode(_llama_rows(args)))
    if args.thread_counts:
        quick = dict(new_tokens=QUICK_TOKENS, warmup=0, repeats=args.repeats or 1) if args.quick else \
            dict(new_tokens=min(args.tokens, THREADS_TOKENS), repeats=args.repeats or REPEATS["decode"])
        show(format_decode_threads(bench_decode_threads(
            shapes=args.shapes, batch_sizes=tuple(args.batch_sizes), thread_counts=tuple(args.thread_counts), **quick)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grade"]:  # grading speed: its own options
        from ..grading.bench import main as bench_grade_main

        return bench_grade_main(argv[1:])
    if argv[:1] == ["tensor-parallel"]:  # chapter 16: its own options
        from .tensor_parallel import main as bench_tensor_parallel_main

        return bench_tensor_parallel_main(argv[1:])
    if argv[:1] == ["serve-http"]:  # the engine behind HTTP: its own options
        from .serve_http import main as bench_serve_http_main

        return bench_serve_http_main(argv[1:])
    _import_all()
    parser = argparse.ArgumentParser(prog="course bench", description="benchmarks (they print; they assert nothing); "
                                                                      "`course bench grade --help` for grading speed, "
                                                                      "`course bench tensor-parallel --help` for chapter 16's")
    parser.add_argument("what", choices=["train", "decode", "serve", "structured"],
                        help="train: a training step of our GPT vs Hugging Face's GPT-2; decode: greedy decoding speed, "
                             "cached and uncached, vs Hugging Face's generate; serve: many requests at once, our continuous "
                             "batching with a paged cache vs our static batching and Hugging Face's continuous batching; "
                             "structured: chapter 15's token index and per-step mask vs xgrammar and outlines-core, and the engine "
                             "with constrained requests mixed in vs all free")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats; the median is reported (default: "
                             + ", ".join(f"{n} for {what}" for what, n in REPEATS.items()) + ")")
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
                        help=f"decode: {QUICK_TOKENS} new tokens ({QUICK_UNCACHED_TOKENS} uncached), 1 run, no warm-up; "
                             f"structured: bpe-gpt's vocabulary only, 1 run, 4 requests in the engine; "
                             f"serve: {QUICK_REQUESTS} requests, 1 run, no warm-up, the engine's speed ratios timed for "
                             f"{QUICK_RATIO_SECONDS:g} s each (a smoke run)")
    parser.add_argument("--thread-counts", type=int, nargs="+", default=None,
                        help="decode: then the cached rows again at each of these thread counts, timed side by side, "
                             "and what each buys over the first (e.g. 1 2: what a second thread buys; default: not run; "
                             f"at most {THREADS_TOKENS} new tokens)")
    parser.add_argument("--family", choices=["all", "gpt", "llama"], default="all",
                        help="decode: GPT-2-style rows (chapters 05 and 08), Llama-style rows (chapter 11), or both (default)")
    args = parser.parse_args(argv)
    allowed = {"decode": DECODE_SHAPES, "serve": SERVE_MODELS}.get(args.what, ())
    if args.shapes and any(s not in allowed for s in args.shapes):
        parser.error(f"--shapes for {args.what} must be among {list(allowed)}, got {args.shapes}")
    if args.thread_counts is not None:  # refused before the other tables run, not minutes later
        try:
            check_thread_counts(args.thread_counts)
        except ValueError as error:
            parser.error(f"--{error}".replace("thread_counts", "thread-counts", 1))
    if args.what == "serve":
        _serve(args)
        return 0
    if args.what == "structured":
        rows = bench_index(vocab_sizes=(512,)) if args.quick else bench_index()
        step = bench_step(repeats=args.repeats or (1 if args.quick else REPEATS["structured"]), warmup=0 if args.quick else 2,
                          threads=args.threads or THREADS["structured"])
        engine = bench_engine(requests=4 if args.quick else 8, constrained=2 if args.quick else 4,
                              max_new_tokens=16 if args.quick else 48, repeats=args.repeats or (1 if args.quick else 5),
                              warmup=0 if args.quick else 1, threads=args.threads or THREADS["structured"],
                              seconds=0.0 if args.quick else 3.0)
        print(format_structured(rows, step, engine))
        return 0
    args.threads = args.threads or THREADS[args.what]
    if args.what == "decode":
        _decode(args)
        return 0
    repeats = args.repeats or REPEATS["train"]
    print(format_train(bench_train(threads=args.threads, repeats=repeats, steps_per_repeat=args.steps), repeats, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
