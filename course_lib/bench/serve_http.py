"""``course bench serve-http``: chapter 12's engine behind HTTP (``course_lib.server``), driven as vLLM's
benchmarks/benchmark_serving.py drives a server: streamed greedy requests with Poisson arrivals at each rate, time to
first token and time per output token from the streamed tokens, tokens/s."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time

from .. import assets
from ..data import default_corpus
from ..serving import make_trace, quantile
from ..server import Server
from . import timing

#: Request rates (requests per second; inf: all at once) and requests per rate by default
RATES = (4.0, 16.0, math.inf)
REQUESTS = 48
#: The prompts' lengths in tokens (windows of the default corpus) and the median output length (``make_trace``'s)
PROMPT_RANGE = (8, 64)
OUTPUT_MEDIAN = 24
#: The warm-up: this many requests of WARMUP_TOKENS tokens each, all at once
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 4


async def _drive(url: str, model_name: str, prompts: list, max_tokens: list, rate: float, seed: int) -> list:
    """Send each prompt as a streamed greedy request, the gaps between sends exponential with mean 1 / rate seconds
    (Poisson arrivals; rate inf: all at once). Per request: (seconds to the first token, seconds between the
    first and the last, tokens (the usage the server reports), seconds from send to the end)."""
    import httpx

    rng = random.Random(seed)

    async def one(client, prompt: str, n: int) -> tuple:
        body = {"model": model_name, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        sent, times, tokens = time.perf_counter(), [], 0
        async with client.stream("POST", f"{url}/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["text"]:
                        times.append(time.perf_counter())
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
        return times[0] - sent, times[-1] - times[0], tokens, time.perf_counter() - sent

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for prompt, n in zip(prompts, max_tokens):
            tasks.append(asyncio.ensure_future(one(client, prompt, n)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def bench_serve_http(model_name: str = "char-gpt", *, rates: tuple = RATES, n_requests: int = REQUESTS,
                     seed: int = 0, threads: int = 1, **engine) -> list:
    """Drive a ``Server`` with Poisson arrivals at each rate (requests per second): prompts are windows of the
    default corpus, outputs log-normal (``serving.make_trace``'s lengths), greedy. Returns one dict per rate:
    rate, requests, seconds, output tokens per second, TTFT and TPOT p50 and p95 in seconds (TPOT: (last token's
    time - first's) / (tokens - 1), per request, as vLLM's benchmark reports it)."""
    with timing.threads(threads):
        corpus = default_corpus()
        context = assets.info(model_name)["config"]["block_size"]
        trace = make_trace(n_requests, seed, context=context, prompt_range=PROMPT_RANGE, output_median=OUTPUT_MEDIAN)
        rng = random.Random(seed)
        prompts = []
        for r in trace:
            start = rng.randrange(len(corpus) - len(r.prompt))
            prompts.append(corpus[start:start + len(r.prompt)])
        max_tokens = [r.max_new_tokens for r in trace]
        rows = []
        with Server(model_name, **engine) as server:
            asyncio.run(_drive(server.url, model_name, prompts[:WARMUP_REQUESTS], [WARMUP_TOKENS] * WARMUP_REQUESTS,
                               math.inf, seed))
            for rate in rates:
                start = time.perf_counter()
                got = asyncio.run(_drive(server.url, model_name, prompts, max_tokens, rate, seed))
                seconds = time.perf_counter() - start
                ttft = [g[0] for g in got]
                tpot = [g[1] / (g[2] - 1) for g in got if g[2] > 1]
                rows.append({"rate": rate, "requests": len(got), "seconds": seconds,
                             "tokens_per_second": sum(g[2] for g in got) / seconds,
                             "ttft_p50": quantile(ttft, 0.5), "ttft_p95": quantile(ttft, 0.95),
                             "tpot_p50": quantile(tpot, 0.5), "tpot_p95": quantile(tpot, 0.95)})
        return rows


def format_serve_http(rows: list) -> str:
    """The table `course bench serve-http` prints."""
    lines = ["the engine behind HTTP (course serve), streamed greedy requests, Poisson arrivals "
             "(timings depend on the machine and its load)",
             f"{'rate (req/s)':>12} {'requests':>8} {'seconds':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} "
             f"{'TPOT p50':>9} {'TPOT p95':>9}"]
    for r in rows:
        lines.append(f"{r['rate']:>12} {r['requests']:>8} {r['seconds']:>8.2f} {r['tokens_per_second']:>9.0f} "
                     f"{r['ttft_p50'] * 1e3:>7.1f}ms {r['ttft_p95'] * 1e3:>7.1f}ms "
                     f"{r['tpot_p50'] * 1e3:>7.1f}ms {r['tpot_p95'] * 1e3:>7.1f}ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``course bench serve-http``."""
    parser = argparse.ArgumentParser(prog="course bench serve-http",
                                     description="drive `course serve` over HTTP with Poisson arrivals (as vLLM's "
                                                 "benchmark_serving.py does): TTFT and TPOT from the streamed tokens")
    parser.add_argument("--model", default="char-gpt", help="a language model of course_lib.assets with a tokenizer "
                                                             "(char-gpt, bpe-gpt; default: %(default)s)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES),
                        help="requests per second, one run each (inf: all at once; default: 4 16 inf)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per rate (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts, lengths and arrival gaps (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.requests < 1 or any(not r > 0 for r in args.rates):
        parser.error("--requests must be >= 1 and every --rates value > 0")
    print(format_serve_http(bench_serve_http(args.model, rates=tuple(args.rates), n_requests=args.requests,
                                             seed=args.seed, threads=args.threads)))
    return 0
