"""The baseline: static batching, chapter 05's left-padded batch and a cache preallocated per row, one batch at a time
(the vLLM paper's "Orca (Oracle)" and "Orca (Max)").
"""
from __future__ import annotations

import time

import torch

from ..kv_cache import KVCache, cached_forward
from ..validation import check_positive
from .metrics import StepLog
from .request import Request, pending_requests, validate
from .sampler import argmaxes, choose_token


@torch.inference_mode()
def static_batching(model, requests: list, max_batch_size: int = 8, *, reserve: str = "oracle") -> tuple:
    """Serve `requests` in static batches: chapter 05's left-padded batch, one at a time.

    At each step with no batch running, the requests that have arrived (first come, first served, at most
    max_batch_size) form a batch: prompts left-padded to the longest, a ``KVCache`` preallocated in every row
    for `reserve`, one prefill step, then one decode step per token until the row with the most tokens to
    generate is done; a row that is done idles until then. reserve: "oracle" (default) sizes the rows for the
    longest prompt plus the longest output of the batch, read from the requests' true max_new_tokens (as
    ``generate_cached`` does; a server cannot know them in advance: the vLLM paper's "Orca (Oracle)");
    "context" reserves the model's context length in every row, the most a request may hold ("Orca (Max)"),
    or the longest prompt plus the longest output if left padding makes that longer. The tokens are the same
    either way; only the memory differs. Returns ({name: Result}, StepLog) like ``Engine.run``: a request is
    rejected on arrival by the same ``validate``, and a request whose sampling raises fails alone (its row
    idles); an error in the batch's forward pass is raised.
    """
    check_positive("max_batch_size", max_batch_size)
    if reserve not in ("oracle", "context"):
        raise ValueError(f'reserve must be "oracle" (the batch\'s longest prompt + longest output) or "context" '
                         f"(the model's context length per row), got {reserve!r}")
    model.eval()
    context, vocab = model.config.block_size, model.config.vocab_size
    results, pending = pending_requests(requests, most_n=1)  # n > 1 is rejected: one name each
    arrived, log = [], StepLog()
    start_time = time.perf_counter()
    step = 0
    while pending or arrived:
        now = time.perf_counter() - start_time
        while pending and pending[0].arrival <= step:
            request = pending.pop(0)
            results[request.name].arrival_time = now
            try:
                _validate(request, context, vocab)
                arrived.append(request)
            except ValueError as error:
                results[request.name].error = str(error)
        if not arrived:
            step += 1
            continue
        batch, arrived = arrived[:max_batch_size], arrived[max_batch_size:]
        B, width = len(batch), max(len(r.prompt) for r in batch)
        longest = max(r.max_new_tokens for r in batch)
        idx = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)  # 1: a real token; grows by a column per step
        for row, r in enumerate(batch):
            idx[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        capacity = width + longest if reserve == "oracle" else max(context, width + longest)
        cache = KVCache.for_model(model, B, capacity)  # every row: the longest prompt + the longest output, or the context
        generators = [torch.Generator().manual_seed(r.seed) for r in batch]
        tokens = [list(r.prompt) for r in batch]
        failed = set()  # rows whose request failed: they idle like finished rows
        new = idx
        for t in range(longest):
            step_start = time.perf_counter() - start_time
            states = {r.name: "waiting" for r in arrived}
            for r in pending:
                if r.arrival <= step:
                    states[r.name] = "waiting"
            logits = cached_forward(model, new, cache, mask)[:, -1]
            greedy = argmaxes(logits)
            now = time.perf_counter() - start_time
            column = torch.zeros(B, 1, dtype=torch.long)
            for row, r in enumerate(batch):
                done = len(tokens[row]) - len(r.prompt) >= r.max_new_tokens or row in failed
                states[r.name] = "idle" if done else ("prefill" if t == 0 else "decode")
                if done:
                    continue
                try:
                    token = choose_token(logits[row], greedy[row], tokens[row], len(r.prompt), r.sampling, generators[row])
                except Exception as error:  # noqa: BLE001 - this request's sampling: it fails alone, its row idles
                    results[r.name].error = f"request {r.name}: failed at step {step}: {type(error).__name__}: {error}"
                    failed.add(row)
                    continue
                tokens[row].append(token)
                column[row, 0] = token
                result = results[r.name]
                result.tokens.append(token)
                result.token_times.append(now)
                if result.first_token_step is None:
                    result.first_token_step = step
                if len(result.tokens) == r.max_new_tokens:
                    result.finish_step = step
            new = column
            busy = [len(tk) - len(r.prompt) < r.max_new_tokens and row not in failed
                    for row, (tk, r) in enumerate(zip(tokens, batch))]
            mask = torch.cat([mask, torch.tensor(busy, dtype=torch.long)[:, None]], dim=1)  # an idle row feeds padding
            log.states.append(states)
            log.allocated.append(cache.nbytes)
            per_token = cache.nbytes // (B * cache.capacity)
            # tokens cached: all but the one just sampled (fed next step), as the engine counts n_cached
            log.used.append(per_token * sum(len(tk) - 1 for tk in tokens))
            log.batch.append(B)
            log.computed.append(B * (width if t == 0 else 1))  # every row, padding and idle rows included
            log.prefill.append(B * width if t == 0 else 0)
            log.step_seconds.append(time.perf_counter() - start_time - step_start)
            log.clock.append(step)
            step += 1
            while pending and pending[0].arrival <= step:  # arrivals during the batch wait for the next one
                request = pending.pop(0)
                results[request.name].arrival_time = time.perf_counter() - start_time
                try:
                    _validate(request, context, vocab)
                    arrived.append(request)
                except ValueError as error:
                    results[request.name].error = str(error)
    log.seconds, log.steps = time.perf_counter() - start_time, step
    return results, log


def _validate(request: Request, context: int, vocab: int) -> None:
    """``validate``, and the baseline's limits: one sequence per request (n = 1), no log-probabilities."""
    validate(request, context, vocab_size=vocab)
    if request.n != 1 or request.logprobs is not None:
        raise ValueError(f"request {request.name}: static batching (the baseline) serves n = 1 without logprobs, got "
                         f"n = {request.n}, logprobs = {request.logprobs}")
