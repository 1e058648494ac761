"""``course bench serve``: many requests at once (chapter 12), ours against Hugging Face's continuous batching.

On the same seeded request trace (``course_lib.serving.make_trace``) and the same weights: our continuous batching over
a paged KV cache (``serving.Engine``), our static batching (``serving.static_batching``) and Hugging Face's continuous
batching (the manager behind ``generate_batch``, with its paged cache); throughput, time to first token, time per
output token, KV bytes allocated per byte used (``bench_serve``). Then chapter 12's load sweep, timed: request rates
with Poisson arrivals and token budgets, ours only (``bench_serve_load``); the same rates on the wall clock, Hugging
Face included (``bench_serve_wall``); and the engine's speed against its targets (``bench_serve_speed``).
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

import torch

from ..gpt import GPT, GPTConfig
from ..hf import to_hf
from ..kernels import use_fastest_kernels
from ..kv_cache import generate_cached
from ..serving import Engine, Request, load_sweep, make_trace, quantile, static_batching
from . import timing
from .decode import DECODE_SHAPES
from .hf_adapters import hf_replay, hf_serve

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
#: The settings every part of ``course bench serve`` runs by default (chapter 12's notebook's): tokens per KV block,
#: tokens per engine step, requests per static batch (and the capped engine's max_num_seqs)
BLOCK_SIZE, TOKEN_BUDGET, MAX_BATCH_SIZE = 8, 64, 8
#: The sweeps' requests per trace and their seed (of the trace and of the Poisson arrival times)
SWEEP_REQUESTS, SWEEP_SEED = 32, 3
#: Timed repeats (rounds) by default
REPEATS = 3
#: The least seconds each of ``bench_serve_speed``'s own ratios is timed for: a row whose round is short runs more
#: rounds (the course model's runs take about a quarter of a second, and on a quiet machine runs of the same work
#: were measured 0.2 to 0.34 s apart: a ratio of three such rounds is noise)
RATIO_SECONDS = 10.0
#: Requests of a warm-up run (the first ones of the trace)
WARMUP_REQUESTS = 4
#: The rows of the products whose kernels are measured before the timed runs (``use_fastest_kernels``; others are
#: measured when first met): 1, 2, 4, ..., 64, a step's rows up to the default token budget; the load sweep's up to 128
STEP_ROWS = tuple(1 << i for i in range(7))
SWEEP_STEP_ROWS = tuple(1 << i for i in range(8))


def serve_model(name: str, seed: int = 0) -> GPT:
    """Our GPT for ``bench_serve``: the shipped char-gpt checkpoint, or a shape of ``DECODE_SHAPES`` with seeded random weights."""
    if name == "char-gpt":
        from .. import assets

        return assets.load("char-gpt")
    if name not in DECODE_SHAPES:
        raise ValueError(f"models must be among {list(SERVE_MODELS)}, got {name!r}")
    torch.manual_seed(seed)
    return GPT(GPTConfig(**DECODE_SHAPES[name])).eval()


def _request_counts(n_requests: dict | int | None) -> dict:
    """Requests per model: SERVE_REQUESTS, every model's count (an int) or some models' counts (a dict)."""
    if n_requests is None:
        return dict(SERVE_REQUESTS)
    return {m: n_requests for m in SERVE_MODELS} if isinstance(n_requests, int) else {**SERVE_REQUESTS, **n_requests}


def _pool_blocks(requests: list, block_size: int) -> int:
    """Blocks of block_size tokens that hold every request's prompt and output at once (no preemption)."""
    return sum(math.ceil((len(r.prompt) + r.max_new_tokens) / block_size) for r in requests)


def _ours_run(results: dict, trace) -> dict:
    """One run of ours (``Engine.run`` or ``static_batching``) in the form ``bench_serve`` compares."""
    served = [r for r in results.values() if r.error is None]
    return {"tokens": {r.name: list(r.tokens) for r in served}, "seconds": trace.seconds,
            "ttft": [r.ttft for r in served], "tpot": [r.tpot for r in served if r.tpot is not None],
            "allocated": sum(trace.allocated), "used": sum(trace.used), "errors": len(results) - len(served)}


def bench_serve(models=SERVE_MODELS, n_requests: dict | int | None = None, block_size: int = BLOCK_SIZE,
                token_budget: int = TOKEN_BUDGET, max_batch_size: int = MAX_BATCH_SIZE, mean_gap: float = 0.5,
                threads: int = 1, warmup: int = 1, repeats: int = REPEATS, seed: int = 0) -> dict:
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
    unknown = sorted(set(models) - set(SERVE_MODELS))
    if unknown:
        raise ValueError(f"models must be among {list(SERVE_MODELS)}, got {unknown}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, warmup >= 0; got {repeats}, {warmup}")
    counts = _request_counts(n_requests)
    rows = []
    with timing.threads(threads):
        for name in models:
            ours = serve_model(name, seed)
            theirs = to_hf(ours)
            use_fastest_kernels(ours, rows=STEP_ROWS)
            V, context = ours.config.vocab_size, ours.config.block_size
            trace = make_trace(counts[name], seed=seed, context=context, vocab=list(range(V)), mean_gap=mean_gap)
            at_once = make_trace(counts[name], seed=seed, context=context, vocab=list(range(V)), mean_gap=mean_gap)
            for r in at_once:
                r.arrival = 0
            num_blocks = _pool_blocks(trace, block_size)
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
                timed = timing.alternate({s: (lambda run=run: run(requests)) for s, run in systems.items()}, repeats, warmup,
                                         warm={s: (lambda run=run: run(requests[:WARMUP_REQUESTS])) for s, run in systems.items()})
                reference = timed[SERVE_SYSTEMS[0]].results[-1]["tokens"]
                for system, these in ((s, t.results) for s, t in timed.items()):
                    last = these[-1]
                    ttft = [t for run in these for t in run["ttft"]]
                    tpot = [t for run in these for t in run["tpot"]]
                    per_s = [sum(len(t) for t in run["tokens"].values()) / run["seconds"] for run in these]
                    rows.append({
                        "model": name, "arrivals": arrivals, "system": system, "requests": len(requests),
                        "tokens": sum(len(t) for t in last["tokens"].values()), "errors": last["errors"],
                        "tokens_per_s": statistics.median(per_s), "runs_tokens_per_s": per_s,
                        "ttft_median": statistics.median(ttft), "ttft_p95": quantile(ttft, 0.95),
                        "tpot_median": statistics.median(tpot), "tpot_p95": quantile(tpot, 0.95),
                        "kv_ratio": last["allocated"] / last["used"], "same_tokens": last["tokens"] == reference,
                        "attn_implementation": last.get("attn_implementation"), "hf_threads": last.get("threads"),
                    })
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


def _how_timed(r: dict, run: str) -> str:
    """How a serving table's times were taken: the threads, and of how many runs (``run``: what one is called)."""
    return (f"{r['threads']} thread(s); tokens/s: median of {r['repeats']} {run}s after {r['warmup']} warm-up {run}(s); "
            f"TTFT, TPOT: every request of every {run}")


def _static_batching(r: dict) -> str:
    """What the serving tables' static batching is (``course_lib.serving.static_batching``, reserving by the oracle)."""
    return (f"static: batches of {r['max_batch_size']}, each formed when the one before has ended, a cache preallocated "
            "in every row for the batch's longest prompt + longest output (read from the true output lengths: an oracle)")


def format_serve(result: dict) -> str:
    """The table `course bench serve` prints."""
    r = result
    lines = [f"serving a seeded request trace (course_lib.serving.make_trace: prompts 4..48 tokens, output lengths "
             f"log-normal, median 12), greedy, float32, {_how_timed(r, 'run')}",
             f"ours continuous: Engine, blocks of {r['block_size']} tokens, a pool that holds every request at once (no "
             f"preemption), {r['token_budget']} tokens per step; capped: the same, at most {r['max_batch_size']} requests "
             f"at once (max_num_seqs); {_static_batching(r)}; static, context: the model's context in every row; HF: the "
             "same pool, page size and token budget",
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


def bench_serve_load(rates=SWEEP_RATES, budgets=SWEEP_BUDGETS, n_requests: int = SWEEP_REQUESTS,
                     block_size: int = BLOCK_SIZE, token_budget: int = TOKEN_BUDGET, max_batch_size: int = MAX_BATCH_SIZE,
                     threads: int = 1, repeats: int = REPEATS, seed: int = SWEEP_SEED) -> dict:
    """Chapter 12's load sweep on the course model, timed: ``serving.load_sweep`` in seconds as well as steps.

    Traces: ``make_trace(n_requests, seed, mean_gap=1 / rate)`` per rate. Systems: static batching (batches of
    max_batch_size) sized by the true output lengths (the oracle) and reserving the context; the engine (a pool of
    max_batch_size x the context, the notebook's) capped at max_batch_size running requests and uncapped; and, at
    the highest rate, the uncapped engine with each token budget. Each round runs every (trace, system) once, in
    order (so that background load hits all alike); a row holds, per field of ``serving_stats``, the median over
    the rounds (the step counts are the same in every round). Hugging Face's continuous batching has no arrival
    times, so it is not swept: ``bench_serve`` compares it with every request arriving at once."""
    if repeats < 1 or not rates or not budgets:
        raise ValueError(f"need repeats >= 1 and at least one rate and one budget; got {repeats}, {rates}, {budgets}")
    with timing.threads(threads):
        model = serve_model("char-gpt")
        use_fastest_kernels(model, rows=SWEEP_STEP_ROWS)
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
        first = {rates[0]: traces[rates[0]][:WARMUP_REQUESTS]}  # the warm-up's trace: allocator, first-call overheads
        timed = timing.alternate({"rates": lambda: load_sweep(systems, traces), "budgets": lambda: load_sweep(by_budget, top)},
                                 repeats, warmup=1, warm={"rates": lambda: load_sweep(systems, first)})

    def medians(runs):
        return [{k: (statistics.median(run[i][k] for run in runs) if isinstance(v, float) else v)
                 for k, v in row.items()} for i, row in enumerate(runs[0])]

    return {"rates": medians(timed["rates"].results), "budgets": medians(timed["budgets"].results),
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
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    rng, times, clock = random.Random(seed), [], 0.0
    for _ in range(n):
        times.append(clock)
        clock += rng.expovariate(rate)
    return times


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
            timing.sleep_until(start, pending[0][0])
    return {name: (r.tokens, r.token_times) for name, r in engine.results.items()}


def _replay_static(model, requests: list, arrivals: list, max_batch_size: int) -> dict:
    """The same replay against static batching: when no batch runs, the requests that have arrived (first come, at
    most max_batch_size) form the next batch, served by ``static_batching`` to its end; a request arriving meanwhile
    waits for the batch after. Returns what ``_replay_engine`` returns."""
    out, start, pending = {}, time.perf_counter(), list(zip(arrivals, requests))
    while pending:
        timing.sleep_until(start, pending[0][0])
        now = time.perf_counter() - start
        batch = [r for at, r in pending[:max_batch_size] if at <= now]
        pending = pending[len(batch):]
        began = time.perf_counter() - start  # static_batching's own clock starts just after: its times + began
        results, _ = static_batching(model, [dataclasses.replace(r, arrival=0) for r in batch], max_batch_size)
        out.update({name: (r.tokens, [began + t for t in r.token_times]) for name, r in results.items()})
    return out


def bench_serve_wall(rates=WALL_RATES, n_requests: int = SWEEP_REQUESTS, block_size: int = BLOCK_SIZE,
                     token_budget: int = TOKEN_BUDGET, max_batch_size: int = MAX_BATCH_SIZE, threads: int = 1,
                     warmup: int = 1, repeats: int = REPEATS, seed: int = SWEEP_SEED) -> dict:
    """The load sweep on the wall clock, Hugging Face included: the same requests arriving as a Poisson process at each
    rate (requests per second), replayed in real time against static batching, our engine and Hugging Face's.

    Requests: ``make_trace(n_requests, seed, mean_gap=0)`` on the course model (its arrivals unused); arrival times:
    ``poisson_arrivals(n_requests, rate, seed)`` per rate, the same for the three systems. Static batching:
    ``_replay_static`` (batches of max_batch_size, rows sized by the true output lengths: the oracle); ours:
    ``Engine`` with a pool that holds every request at once, blocks of block_size tokens, token_budget tokens per
    step, driven by ``_replay_engine``; Hugging Face: ``hf_replay`` with the same pool, page size and budget. Greedy,
    the same weights (``to_hf``), `threads` torch threads. warmup untimed replays of the first 4 requests per system,
    then repeats rounds, each replaying every (rate, system) once in turn, round k starting with system k mod 3 (so that
    background load hits all alike).
    A row per (rate, system): tokens/s (generated tokens / seconds from the first arrival to the last token; median of
    the rounds), TTFT (first token - arrival, seconds) and TPOT ((last token - first token) / (tokens - 1)), p50 and
    p95 (nearest rank) over every request of every round; `differ`: how many (round, request) pairs' tokens differ
    from the request generated alone (``generate_cached``), of `checked`. Returns {"rows": [...], ...}.
    """
    if repeats < 1 or warmup < 0 or not rates:
        raise ValueError(f"need repeats >= 1, warmup >= 0 and at least one rate; got {repeats}, {warmup}, {rates}")
    hf_seen: dict = {}
    with timing.threads(threads):
        model = serve_model("char-gpt")
        hf_model = to_hf(model)
        use_fastest_kernels(model, rows=STEP_ROWS)
        V, context = model.config.vocab_size, model.config.block_size
        requests = make_trace(n_requests, seed=seed, context=context, vocab=list(range(V)), mean_gap=0)
        with torch.inference_mode():
            alone = {r.name: generate_cached(model, torch.tensor([r.prompt]), r.max_new_tokens)[0, len(r.prompt):].tolist()
                     for r in requests}
        num_blocks = _pool_blocks(requests, block_size)
        engine = Engine(model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget)
        systems = {
            WALL_SYSTEMS[0]: lambda reqs, at: _replay_static(model, reqs, at, max_batch_size),
            WALL_SYSTEMS[1]: lambda reqs, at: _replay_engine(engine, reqs, at),
            WALL_SYSTEMS[2]: lambda reqs, at: hf_replay(hf_model, reqs, at, num_blocks, block_size, token_budget, hf_seen),
        }
        schedules = {rate: poisson_arrivals(n_requests, rate, seed) for rate in rates}
        order = list(systems)

        def round_order(k):  # each round starts with the next system
            return [(rate, system) for rate in rates for system in order[k % len(order):] + order[:k % len(order)]]

        timed = timing.alternate(
            {(rate, system): (lambda run=run, arrivals=arrivals: run(requests, arrivals))
             for rate, arrivals in schedules.items() for system, run in systems.items()}, repeats, warmup,
            warm={system: (lambda run=run: run(requests[:WARMUP_REQUESTS], [0.0] * WARMUP_REQUESTS))
                  for system, run in systems.items()},
            order=round_order)
    runs = {key: t.results for key, t in timed.items()}
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
                     "ttft_p50": quantile(ttft, 0.5), "ttft_p95": quantile(ttft, 0.95),
                     "tpot_p50": quantile(tpot, 0.5), "tpot_p95": quantile(tpot, 0.95),
                     "differ": sum(run.get(name, (None,))[0] != tokens for run in these for name, tokens in alone.items()),
                     "checked": len(these) * len(alone)})
    return {"rows": rows, "threads": threads, "repeats": repeats, "warmup": warmup, "n_requests": n_requests,
            "block_size": block_size, "token_budget": token_budget, "max_batch_size": max_batch_size,
            "hf_threads": sorted(hf_seen.get("threads", ())), "attn_implementation": hf_seen.get("attention")}


def format_serve_wall(result: dict) -> str:
    """The wall-clock sweep's table, as `course bench serve` prints it."""
    r = result
    lines = [f"wall-clock sweep: char-gpt, the same {r['n_requests']} requests arriving as a Poisson process at each rate "
             "(requests per second), replayed in real time (TTFT from arrival); " + _how_timed(r, "round"),
             f"{_static_batching(r)}; ours: Engine.add_request/step, blocks of {r['block_size']}, {r['token_budget']} "
             "tokens per step; HF: its continuous batching manager (generate_batch's), add_request at each arrival, the "
             f"same pool and budget (attention {r['attn_implementation']}, torch threads in its generation thread {r['hf_threads']})",
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
                      new_tokens: int = 32, block_size: int = BLOCK_SIZE, token_budget: int = TOKEN_BUDGET, mean_gap: float = 0.5,
                      n_requests: dict | int | None = None, threads: tuple = (1, 2), warmup: int = 1, repeats: int = REPEATS,
                      ratio_seconds: float = RATIO_SECONDS, seed: int = 0) -> dict:
    """The engine's speed against its targets (``SERVE_TARGETS``); every ratio is the median of per-round ratios, the
    contenders alternating within each round (so that background load hits both alike). The decode-step and thread
    rows run `repeats` rounds, or more, until their rounds have taken `ratio_seconds` (``timing.alternate``).

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
    counts = _request_counts(n_requests)
    rows = []
    with timing.threads(threads[0]):
        for name in models:
            model = serve_model(name, seed)
            use_fastest_kernels(model, rows=STEP_ROWS)
            V, context = model.config.vocab_size, model.config.block_size
            g = torch.Generator().manual_seed(seed)
            same = [Request(f"d{i}", torch.randint(0, V, (prompt_len,), generator=g).tolist(), new_tokens)
                    for i in range(batch_size)]
            blocks = batch_size * math.ceil((prompt_len + new_tokens) / block_size)
            engine = Engine(model, num_blocks=blocks, block_size=block_size, token_budget=batch_size * prompt_len)
            timed = timing.alternate({"engine": lambda: engine.run(same)[1],
                                      "static": lambda: static_batching(model, same, batch_size)[1]}, repeats, warmup,
                                     seconds=ratio_seconds)
            ratios = [_decode_step_seconds(e, batch_size) / _decode_step_seconds(s, batch_size)
                      for e, s in zip(timed["engine"].results, timed["static"].results)]
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
            engine = Engine(model, num_blocks=_pool_blocks(trace, block_size), block_size=block_size, token_budget=token_budget)

            def tokens_per_s(n, requests):  # the engine on n threads
                with timing.threads(n):
                    results, run = engine.run(requests)
                return sum(len(r.tokens) for r in results.values()) / run.seconds

            def warm_up(n):  # the kernels of every row count a pass on n threads meets (course_lib.kernels), then runs
                with timing.threads(n):
                    use_fastest_kernels(model, rows=[1 << i for i in range(7)])
                return tokens_per_s(n, trace[:WARMUP_REQUESTS])

            timed = timing.alternate({n: (lambda n=n: tokens_per_s(n, trace)) for n in threads}, repeats, warmup,
                                     warm={n: (lambda n=n: warm_up(n)) for n in threads}, seconds=ratio_seconds)
            ratios = [more / fewer for more, fewer in zip(timed[threads[1]].results, timed[threads[0]].results)]
            rows.append({"model": name, "what": f"tokens/s of the engine on the trace, {threads[1]} threads / {threads[0]}",
                         "ratio": statistics.median(ratios), "runs": ratios, "target": (">=", SERVE_TARGETS["two_threads"])})
    return {"rows": rows, "repeats": repeats, "warmup": warmup, "threads": threads}


def format_serve_speed(result: dict) -> str:
    """The engine's speed against its targets, as `course bench serve` prints it after its table."""
    lines = [f"the engine's speed against its targets (the median of per-round ratios, the contenders alternating in "
             f"each round, after {result['warmup']} warm-up run(s); at least {result['repeats']} rounds, more where a round "
             f"is short; the middle half of the rounds' ratios beside it):"]
    for row in result["rows"]:
        op, target = row["target"]
        met = row["ratio"] <= target if op == "<=" else row["ratio"] >= target
        runs = row["runs"]
        low, high = statistics.quantiles(runs, n=4, method="inclusive")[::2] if len(runs) > 1 else runs * 2
        lines.append(f"  {row['model']:10s} {row['what']:92s} {row['ratio']:5.2f}x  (target {op} {target}x: "
                     f"{'met' if met else 'NOT met'}; rounds {len(runs)}, their middle half {low:.2f} to {high:.2f})")
    return "\n".join(lines)
