"""Hugging Face's side of ``course bench``: every place the benchmarks reach into transformers, in one module.

Written against transformers 5.23.0, the version ``pyproject.toml`` and ``environment.yml`` pin
(``TRANSFORMERS_VERSION``; a test holds the three equal). Besides the public API (``generate``, a model's
``logits``), it leans on internals that a new version may rename or change; after an upgrade, read these again:

* ``config._attn_implementation``: the attention a model runs (continuous batching switches it to a paged one
  inside its context manager and restores it on exit);
* the continuous batching manager behind ``generate_batch`` (``continuous_batching_context_manager``,
  ``ContinuousBatchingConfig``, ``add_request``, ``get_result``): driven directly, so that each request gets its own
  max_new_tokens and arrives when it arrives;
* its batch processor (``manager.batch_processor``: ``update_batch``, called in the generation thread after each
  forward pass, wrapped here to observe every step) and its paged cache (``cache.cache_allocators``: block tables,
  ``bytes_per_block``, ``tokens_per_page``; ``scheduler.active_requests``' ``position_offset``);
* a result's ``is_finished()``, ``error``, ``generated_tokens``, ``timestamps`` and ``created_time``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from ..hf import _transformers
from .timing import sleep_until

#: The transformers version this module was written against (pinned in pyproject.toml and environment.yml)
TRANSFORMERS_VERSION = "5.23.0"
#: Seconds to wait for one result of the continuous batching manager before giving up
RESULT_TIMEOUT_S = 60


def attn_implementation(hf_model) -> str:
    """The attention implementation `hf_model` runs now (inside continuous batching: its paged one)."""
    return hf_model.config._attn_implementation


def hf_generate(model, idx, max_new_tokens: int, use_cache: bool = True):
    """Greedy decoding with Hugging Face's generate: exactly max_new_tokens new tokens, no padding. (B, T) -> (B, T + n)."""
    with torch.inference_mode():
        return model.generate(idx, attention_mask=torch.ones_like(idx), do_sample=False, use_cache=use_cache,
                              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)


@contextlib.contextmanager
def continuous_batching(hf_model, requests: list, num_blocks: int, block_size: int, token_budget: int,
                        after_step: Callable[[object], object]):
    """Hugging Face's continuous batching manager (the one ``generate_batch`` wraps), greedy, for `requests`.

    Its paged cache: pages of block_size tokens, num_blocks of them, at most token_budget tokens per forward pass,
    block sharing off (so that no finished request's blocks are kept for reuse and every block held belongs to a live
    request), synchronous batching; warmed up on entry. ``after_step(processor)`` runs in its generation thread after
    each forward pass. Yields the manager; add requests with ``add``, wait for them with ``collect``.
    """
    transformers = _transformers()
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation_config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1,
                                                      max_new_tokens=max(r.max_new_tokens for r in requests))
    cb_config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=token_budget,
                                         allow_block_sharing=False, use_async_batching=False)
    with hf_model.continuous_batching_context_manager(generation_config=generation_config, warmup=True,
                                                      continuous_batching_config=cb_config) as manager:
        processor = manager.batch_processor  # made by the warm-up, reused by the generation thread
        update_batch = processor.update_batch

        def update_and_observe():  # runs in the generation thread, after each forward pass
            update_batch()
            after_step(processor)

        processor.update_batch = update_and_observe
        yield manager


def add(manager, request) -> None:
    """Add a ``serving.Request`` to the manager with its own max_new_tokens (``generate_batch`` takes one for all)."""
    manager.add_request(request.prompt, request_id=request.name, max_new_tokens=request.max_new_tokens,
                        record_timestamps=True)


def collect(manager, n: int) -> dict:
    """Wait for the manager to finish n requests; returns {request_id: its result}."""
    outputs = {}
    while len(outputs) < n:
        output = manager.get_result(timeout=RESULT_TIMEOUT_S)
        if output is None:
            raise RuntimeError(f"Hugging Face's continuous batching returned {len(outputs)} of {n} requests")
        if output.is_finished():
            outputs[output.request_id] = output
    return outputs


def kv_bytes(processor) -> tuple[int, int]:
    """(bytes of the KV blocks held: the distinct blocks in the allocators' block tables, bytes holding a cached token:
    each live request's position_offset tokens, every layer) of the batch processor's paged cache, now."""
    held = cached = 0
    for allocator in processor.cache.cache_allocators.values():
        blocks = {b for table in allocator.block_table.values() for b in table}
        held += len(blocks) * allocator.bytes_per_block
        per_token = allocator.bytes_per_block // allocator.tokens_per_page  # one token, every layer
        cached += per_token * sum(s.position_offset for s in processor.scheduler.active_requests.values())
    return held, cached


def hf_serve(hf_model, requests: list, num_blocks: int, block_size: int, token_budget: int) -> dict:
    """Serve `requests` greedily with Hugging Face's continuous batching over its paged cache (``continuous_batching``);
    every request is added at once (``Request.arrival``, a step of our engine's clock, means nothing to it:
    ``hf_replay`` feeds it arrivals in seconds instead).

    After every step it records the KV bytes held and the bytes holding a cached token (``kv_bytes``). Returns the dict
    ``serve._ours_run`` returns, plus the attention implementation it ran and the torch threads of its generation thread.
    """
    allocated, used, threads = [], [], []

    def count(processor):
        held, cached = kv_bytes(processor)
        allocated.append(held)
        used.append(cached)
        threads.append(torch.get_num_threads())

    with continuous_batching(hf_model, requests, num_blocks, block_size, token_budget, count) as manager:
        start = time.perf_counter()
        for r in requests:
            add(manager, r)
        outputs = collect(manager, len(requests))
    attention = attn_implementation(hf_model)
    served = [o for o in outputs.values() if o.error is None]
    ttft = [o.timestamps[0] - o.created_time for o in served]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in served if len(o.timestamps) > 1]
    return {"tokens": {o.request_id: list(o.generated_tokens) for o in served},
            "seconds": max(o.timestamps[-1] for o in served) - start, "ttft": ttft, "tpot": tpot,
            "allocated": sum(allocated), "used": sum(used), "errors": len(outputs) - len(served),
            "attn_implementation": attention, "threads": sorted(set(threads))}


def hf_replay(hf_model, requests: list, arrivals: list, num_blocks: int, block_size: int, token_budget: int,
              seen: dict) -> dict:
    """Replay `requests` arriving at `arrivals` (seconds) in real time against Hugging Face's continuous batching
    (``continuous_batching``): its generation thread runs the steps while this thread adds each request at its arrival
    time, then collects the results. Records in `seen` the attention implementation it runs and (a set) the torch
    threads of its generation thread. Returns {name: (tokens, token times in seconds since the replay began)}, as
    ``serve._replay_engine`` does."""
    def note(processor):
        seen.setdefault("threads", set()).add(torch.get_num_threads())

    with continuous_batching(hf_model, requests, num_blocks, block_size, token_budget, note) as manager:
        seen["attention"] = attn_implementation(hf_model)  # the one it switched to for continuous batching
        start = time.perf_counter()
        for at, r in zip(arrivals, requests):
            sleep_until(start, at)
            add(manager, r)
        outputs = collect(manager, len(requests))
    failed = [o.request_id for o in outputs.values() if o.error is not None]
    if failed:
        raise RuntimeError(f"Hugging Face's continuous batching failed requests {failed}")
    return {o.request_id: (list(o.generated_tokens), [t - start for t in o.timestamps]) for o in outputs.values()}
