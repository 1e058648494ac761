"""Serving many users at once, chapter 12: continuous batching and a paged KV cache.

Requests arrive at different times and want different numbers of tokens. ``static_batching`` runs them the simple
way (chapter 05's left-padded batch, a cache preallocated for the batch's longest prompt plus its longest output in
every row, the batch waits for its longest member). ``Engine`` runs them the way serving engines do (Orca's
iteration-level scheduling, Yu et al. 2022; vLLM's PagedAttention, Kwon et al. 2023; chunked prefill under a token
budget as in Sarathi and Sarathi-Serve, Agrawal et al. 2023 and 2024, and vLLM):

* **continuous batching**: at every step requests join and leave the running batch; the prompt of a new request is
  prefilled in chunks beside the decode steps of the others, under a token budget;
* **a paged KV cache**: one pool of fixed-size blocks per layer, a block table per sequence, a free list; attention
  reads keys and values through the block table;
* **a prefix cache** (vLLM's automatic prefix caching): a full block is known by the hash of its tokens and its
  prefix's hash; a sequence whose tokens start the same way shares it (a reference count) instead of computing it; a
  block nobody holds stays cached on the free list and is evicted, least recently used first, only when a fresh
  block is needed, so later requests and preempted ones resuming find it;
* **preemption**: when the pool is full, the most recently admitted running sequence gives its blocks back and is
  recomputed later (vLLM's default); it keeps the tokens it generated;
* **a cap on running sequences** (``max_num_seqs``, vLLM's name; none by default);
* **parallel sampling** (``Request.n``): the prompt is computed once, its blocks shared by the n sequences, the last
  partly filled one copied by the first sequence that writes into it (copy on write, vLLM's paper, section 4.4);
* **log-probabilities** (``Request.logprobs``): each token's and the top k's, from the distribution it was drawn from;
* **per-request sampling**: each request carries its own chapter 06 settings and its own ``torch.Generator``, so its
  random stream does not depend on the batch it ran in (its logits may, by float rounding: the tests check that its
  tokens do not, on their models and traces).

The modules, along the seams of vLLM (v1) and nano-vllm:

============== ==========================================================================================
``request``      ``Request`` (its sampling settings: ``SAMPLING``), ``Result``, ``validate``, ``Sequence`` (``fork``)
``block_pool``   ``PagedKVCache`` (blocks, free list, reference counts, prefix cache, copy on write), ``block_hashes``;
                 a sequence's block table against it: ``allocate_slots``, ``cache_full_blocks``, ``used_slots``
``scheduler``    ``schedule_step`` (an exercise)
``model_runner`` ``slot_mapping``, ``paged_attention`` (exercises), the pass's layout, ``paged_forward``
``sampler``      the next token: the argmax, or chapter 06's processors and a draw; its log-probabilities
``engine``       ``Engine`` (``run`` offline; ``add_request``, ``step``, ``abort`` online), ``StepOutput``
``executor``     chapter 16: the model sharded across worker processes (``Engine(..., tensor_parallel_size=p)``)
``static``       ``static_batching``, the baseline
``metrics``      ``StepLog`` (what a run did, step by step), ``serving_stats``, ``quantile``
``workloads``    ``make_trace`` (a seeded request trace), ``load_sweep`` (systems over traces)
============== ==========================================================================================

A *trace* is a workload (a list of requests: ``make_trace``, ``load_sweep``'s traces); a *step log* is what one run
did with it (``StepLog``: per step, the tokens through the forward pass and those in prompt chunks, the KV bytes
allocated and used, each step's seconds). Shapes: L layers, H heads, Dh head size, C = H * Dh, N blocks in the pool,
S block size, V vocabulary. ``slot_mapping``, ``paged_attention`` and ``schedule_step`` are the reference solutions
of chapter 12's exercises (``tests/grading/test_solution_drift.py`` keeps them equal to the notebook's).
"""
from __future__ import annotations

from .block_pool import PagedKVCache, block_hashes
from .engine import Engine, StepOutput
from .metrics import StepLog, quantile, serving_stats
from .model_runner import paged_attention, paged_forward, slot_mapping
from .request import (SAMPLING, SEED_RANGE, Request, Result, Sequence, blocks_for, is_real_number, sample_names,
                      sample_seed, validate)
from .sampler import argmaxes, choose_token, choose_with_logprobs, scores_drawn_from, token_logprobs
from .scheduler import schedule_step
from .static import static_batching
from .workloads import load_sweep, make_trace

__all__ = ["SAMPLING", "SEED_RANGE", "Engine", "PagedKVCache", "Request", "Result", "Sequence", "StepLog", "StepOutput",
           "argmaxes", "block_hashes", "blocks_for", "choose_token", "choose_with_logprobs", "is_real_number",
           "load_sweep", "make_trace", "paged_attention", "paged_forward", "quantile", "sample_names", "sample_seed",
           "schedule_step", "scores_drawn_from", "serving_stats", "slot_mapping", "static_batching", "token_logprobs",
           "validate"]
