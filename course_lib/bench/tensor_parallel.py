"""``course bench tensor-parallel``: chapter 16's greedy decoding sharded across p processes against one process.

The model: random weights of a ``course bench decode`` shape. The contenders: one process decoding alone
(``kv_cache.generate_cached``) on one thread and on as many threads as the largest p, and ``tensor_parallel.tp_generate``
on p = 1, 2 processes (``launch``: gloo on loopback, one thread per rank), timed alternately (``timing.alternate``).
Each contender reports the seconds of its decoding alone (a group's process start and sharding are not timed: rank 0's
own clock), so tokens/s compares decoding with decoding. Every run's tokens are compared with one process's.
"""
from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from ..gpt import GPT, GPTConfig
from ..kv_cache import generate_cached
from ..tensor_parallel import launch, tp_generate
from .decode import DECODE_SHAPES
from .timing import alternate, threads

#: Process counts of the tensor-parallel rows by default
TP_WORLD_SIZES = (1, 2)


def _timed_rank(rank, world_size, model, prompt, new_tokens):
    start = time.perf_counter()
    tokens = tp_generate(model, prompt, new_tokens, rank, world_size)
    return tokens, time.perf_counter() - start


def _alone(model, prompt, new_tokens, n_threads):
    with threads(n_threads), torch.inference_mode():
        start = time.perf_counter()
        tokens = generate_cached(model, prompt, new_tokens)
        return tokens, time.perf_counter() - start


def bench_tensor_parallel(shape: str = "tiny", world_sizes=TP_WORLD_SIZES, new_tokens: int = 64, prompt_len: int = 16,
                          repeats: int = 3, warmup: int = 1, seed: int = 0) -> dict:
    """{"shape", "new_tokens", "rows": [{"name", "processes", "threads", "tokens_per_s", "same_tokens"}]}: one row per
    contender, tokens/s from the median of `repeats` alternated rounds after `warmup` untimed ones."""
    if shape not in DECODE_SHAPES:
        raise ValueError(f"shape must be one of {list(DECODE_SHAPES)}, got {shape!r}")
    config = GPTConfig(**DECODE_SHAPES[shape])
    torch.manual_seed(seed)
    model = GPT(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    most = max(world_sizes)
    setups = {("one process", 1, 1): partial(_alone, model, prompt, new_tokens, 1)}
    if most > 1:
        setups[("one process", 1, most)] = partial(_alone, model, prompt, new_tokens, most)
    for p in world_sizes:
        setups[("tensor-parallel", p, 1)] = lambda p=p: launch(_timed_rank, p, model, prompt, new_tokens)[0]
    runs = alternate(setups, repeats, warmup=warmup)
    reference = runs[("one process", 1, 1)].results[0][0]
    rows = []
    for (name, processes, n_threads), run in runs.items():
        seconds = statistics.median(s for _, s in run.results)
        rows.append({"name": name, "processes": processes, "threads": n_threads, "tokens_per_s": new_tokens / seconds,
                     "same_tokens": all(torch.equal(tokens, reference) for tokens, _ in run.results)})
    return {"shape": shape, "new_tokens": new_tokens, "rows": rows}


def format_tensor_parallel(result: dict) -> str:
    lines = [f"greedy decoding, {result['shape']} shape (random weights), {result['new_tokens']} new tokens, batch 1",
             f"{'':18s} {'processes':>9s} {'threads each':>12s} {'tokens/s':>9s}  same tokens as one process"]
    for row in result["rows"]:
        lines.append(f"{row['name']:18s} {row['processes']:9d} {row['threads']:12d} {row['tokens_per_s']:9.1f}  "
                     f"{'yes' if row['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="course bench tensor-parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(DECODE_SHAPES), default="tiny", help="model shape (default: %(default)s)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(TP_WORLD_SIZES),
                        help="process counts of the tensor-parallel rows (default: 1 2)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default: %(default)s)")
    args = parser.parse_args(argv)
    print(format_tensor_parallel(bench_tensor_parallel(args.shape, tuple(args.world_sizes), args.tokens,
                                                       repeats=args.repeats)))
    return 0
