"""What a run did and what it gave its users: the per-step log of a run, and the serving statistics (throughput, time to
first token, time per output token) computed from it (vLLM's ``v1/metrics``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class StepLog:
    """What a run did, step by step: for the pictures and the memory accounting."""

    states: list = field(default_factory=list)  # per step: {request name: state}
    allocated: list = field(default_factory=list)  # per step: KV bytes allocated
    used: list = field(default_factory=list)  # per step: KV bytes holding a cached token
    batch: list = field(default_factory=list)  # per step: sequences in the forward pass
    computed: list = field(default_factory=list)  # per step: tokens through the forward pass (padding included)
    prefill: list = field(default_factory=list)  # per step: those of them in prompt chunks (a recompute's included)
    step_seconds: list = field(default_factory=list)  # per step: seconds from its start to its end (machine-dependent)
    clock: list = field(default_factory=list)  # per step: its number (steps with nothing to run are skipped, not listed)
    seconds: float = 0.0
    steps: int = 0
    evictions: int = 0  # cached free blocks the engine forgot to reuse them (prefix caching)


def quantile(values: list, q: float) -> float:
    """The q-quantile (0 < q <= 1) by the nearest-rank rule: the smallest value with a fraction q at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def serving_stats(results: dict, log: StepLog) -> dict:
    """What a run gave its users, in engine steps (the same on any machine) and in seconds (this machine, now).

    tokens_per_step: tokens generated / the run's steps (throughput); ttft_steps: per request, first_token_step -
    arrival_step; tpot_steps: per request with 2 tokens or more, (finish_step - first_token_step) / (tokens - 1);
    step_tokens: per request, the median tokens computed by the steps that gave its 2nd .. last token (what a
    decoding request waits for: its own token and everyone else's, prompt chunks included). Each as its median
    (p50) and 95th percentile (p95, nearest rank); ttft_s, tpot_s: the same in seconds (``Result.ttft``, ``tpot``).
    Also tpot_steps_max, the largest tpot_steps over the requests, and most_running, the most sequences in one
    step's forward pass (``StepLog.batch``; 0 if it is empty)."""
    served = [r for r in results.values() if r.error is None]
    if not served:
        raise ValueError("results holds no finished request: nothing to measure")
    computed = dict(zip(log.clock, log.computed))
    later = [r for r in served if len(r.tokens) > 1]
    measures = {
        "ttft_steps": [r.first_token_step - r.arrival_step for r in served],
        "tpot_steps": [(r.finish_step - r.first_token_step) / (len(r.tokens) - 1) for r in later],
        "step_tokens": [statistics.median(computed[s] for s in range(r.first_token_step + 1, r.finish_step + 1))
                        for r in later],
        "ttft_s": [r.ttft for r in served], "tpot_s": [r.tpot for r in later],
    }
    tokens = sum(len(r.tokens) for r in served)
    stats = {"requests": len(served), "tokens": tokens, "steps": log.steps, "seconds": log.seconds,
             "tokens_per_step": tokens / log.steps, "tokens_per_s": tokens / log.seconds}
    for name, values in measures.items():
        stats[f"{name}_p50"] = quantile(values, 0.5) if values else math.nan
        stats[f"{name}_p95"] = quantile(values, 0.95) if values else math.nan
    stats["tpot_steps_max"] = max(measures["tpot_steps"], default=math.nan)
    stats["most_running"] = max(log.batch, default=0)
    return stats
