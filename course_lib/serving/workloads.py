"""Workloads: a seeded request trace (arrivals, prompt and output lengths), and a sweep that runs systems over traces
(the request-rate and token-budget sweeps of chapter 12 and ``course bench serve``).
"""
from __future__ import annotations

import math
import random
from typing import Mapping

from .metrics import serving_stats
from .request import Request


def make_trace(n_requests: int, seed: int = 0, *, context: int = 128, mean_gap: float = 1.0,
               prompt_range: tuple = (4, 48), output_median: float = 12.0, output_sigma: float = 0.9,
               vocab: list | None = None, prefix: list | None = None) -> list:
    """A seeded list of n_requests ``Request``s: arrivals, prompt and output lengths.

    Gaps between arrivals are exponential (mean mean_gap steps; a Poisson process; 0: all at step 0), prompt lengths uniform
    in prompt_range, output lengths log-normal (median output_median, sigma output_sigma: a long tail of
    long answers), each cut so that prompt + output fits the context. Prompt tokens are drawn from `vocab`
    (default: ids 0..63); `prefix` (a shared system prompt) is put in front of every prompt.
    """
    rng = random.Random(seed)
    vocab = list(range(64)) if vocab is None else vocab
    prefix = [] if prefix is None else list(prefix)
    requests, clock = [], 0.0
    for i in range(n_requests):
        n_prompt = rng.randint(*prompt_range)
        prompt = prefix + [rng.choice(vocab) for _ in range(n_prompt)]
        room = context - len(prompt)
        n_out = max(1, min(room, round(rng.lognormvariate(math.log(output_median), output_sigma))))
        requests.append(Request(f"r{i:02d}", prompt, n_out, arrival=int(clock)))
        clock += rng.expovariate(1.0 / mean_gap) if mean_gap > 0 else 0.0
    return requests


def load_sweep(systems: Mapping, traces: Mapping) -> list:
    """Run every system on every trace; one row of ``serving_stats`` per (trace, system), with their names.

    systems: {name: a function of a list of Requests returning ({name: Result}, StepLog)} (``Engine(...).run``,
    ``lambda reqs: static_batching(model, reqs, 8)``); traces: {label: a list of Requests} (e.g. request rates,
    ``make_trace(..., mean_gap=1 / rate)``). The systems run one after another on each trace, so that background
    load hits them alike. Rows carry "trace" (the label), "system" and every ``serving_stats`` field."""
    rows = []
    for label, requests in traces.items():
        for name, run in systems.items():
            rows.append({"trace": label, "system": name, **serving_stats(*run(requests))})
    return rows
