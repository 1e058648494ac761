"""The engine: continuous batching over a paged KV cache (vLLM's ``engine/core.py``, nano-vllm's
``engine/llm_engine.py``). Each step: the scheduler picks the chunks, the model runner runs them in one pass, the
sampler picks each finished chunk's token; requests join and leave between steps.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..decoding import (apply_frequency_presence_penalty, apply_repetition_penalty, apply_temperature, min_p_filter,
                        top_k_filter, top_p_filter)
from ..tensor_parallel import RankError
from ..validation import check_positive, is_count
from .block_pool import PagedKVCache, allocate_slots, cache_full_blocks, used_slots
from .executor import ExecutorError, TensorParallelExecutor
from .metrics import StepLog
from .model_runner import paged_attention, paged_forward, slot_mapping
from .request import Request, Result, Sequence, pending_requests, sample_names, validate
from .sampler import argmaxes, choose_token, choose_with_logprobs, constrain
from .scheduler import schedule_step


@dataclass
class StepOutput:
    """What one ``Engine.step`` did: the token each request got, and the requests that left the engine."""

    tokens: dict = field(default_factory=dict)  # sequence name -> the token it got in this step (one at most); a
    # request's name for n = 1 (``request.sample_names`` for n > 1)
    finished: list = field(default_factory=list)  # names of the sequences that left: all their tokens, or failed


class Engine:
    """Continuous batching over a paged KV cache for a course_lib.gpt.GPT: ``run`` serves a list of requests offline;
    ``add_request``, ``step`` and ``abort`` serve them online (a server's loop). Every request fails alone.

    num_blocks: blocks in the pool; block_size: token slots per block; token_budget: most tokens computed per step,
    prompt chunks and decodes together (each >= 1); max_num_seqs (vLLM's name): most sequences running at once
    (>= 1), None for no cap; a request with n > 1 counts as n from its admission; tensor_parallel_size (vLLM's
    name): the model sharded across that many worker processes (chapter 16's ``executor``), 1 (the default) for this
    process alone; with more, ``close()`` (or ``with Engine(...) as engine:``) stops them. State: ``results``,
    ``waiting``, ``running``, ``cache``, ``log``, ``clock`` (next step).
    """

    def __init__(self, model, num_blocks: int, block_size: int = 8, token_budget: int = 64, *,
                 share_prefixes: bool = True, max_num_seqs: int | None = None, tensor_parallel_size: int = 1):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("token_budget", token_budget)):
            check_positive(name, value)
        if max_num_seqs is not None and (not is_count(max_num_seqs) or max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be None (no cap) or an integer >= 1 (most sequences running at once), "
                             f"got {max_num_seqs!r}")
        self.model = model.eval()
        self.num_blocks, self.block_size, self.token_budget = num_blocks, block_size, token_budget
        self.share_prefixes, self.max_num_seqs = share_prefixes, max_num_seqs
        check_positive("tensor_parallel_size", tensor_parallel_size)
        self.executor = None if tensor_parallel_size == 1 else TensorParallelExecutor(
            self.model, tensor_parallel_size, num_blocks, block_size)
        self.reset()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for tensor_parallel_size = 1)."""
        if self.executor is not None:
            self.executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def reset(self, *, schedule_step=schedule_step, paged_attention=paged_attention, slot_mapping=slot_mapping,
              apply_repetition_penalty=apply_repetition_penalty,
              apply_frequency_presence_penalty=apply_frequency_presence_penalty, apply_temperature=apply_temperature,
              top_k_filter=top_k_filter, top_p_filter=top_p_filter, min_p_filter=min_p_filter) -> None:
        """Start afresh: an empty pool, no requests, step 0, an empty ``log``, the clock at 0 seconds.

        schedule_step, paged_attention, slot_mapping, and chapter 06's processors (apply_repetition_penalty ...
        min_p_filter, as ``process_logits`` takes them): the functions the steps run (the learner's, say)."""
        self.schedule_step, self.paged_attention, self.slot_mapping = schedule_step, paged_attention, slot_mapping
        self.processors = dict(apply_repetition_penalty=apply_repetition_penalty,
                               apply_frequency_presence_penalty=apply_frequency_presence_penalty,
                               apply_temperature=apply_temperature, top_k_filter=top_k_filter,
                               top_p_filter=top_p_filter, min_p_filter=min_p_filter)  # process_logits's keywords
        self.cache = (PagedKVCache.for_model(self.model, self.num_blocks, self.block_size) if self.executor is None
                      else self.executor.block_pool())
        self.results: dict = {}  # name -> Result: every request added since the reset
        self.waiting: list = []  # arrived, not running (new or preempted), first come first
        self.running: list = []  # admitted, oldest admission first
        self.log = StepLog()
        self.forked = False  # a request with n > 1 forked since the reset (the slots used count shared last blocks)
        self.clock = 0  # the next step's number (a logical clock: a run jumps over steps where nothing happens)
        self.start_time = time.perf_counter()

    def run(self, requests: list, **functions) -> tuple:
        """Serve `requests` (names unique); returns ({name: Result}, StepLog). functions: the functions it runs on,
        by the name of the course function each replaces (``reset``'s keywords: ``schedule_step=my_schedule_step``,
        ``top_k_filter=my_top_k_filter``).

        Offline serving of a trace: a fresh ``reset``, then each request arrives (``add_request``'s way) at its
        arrival step, and ``step`` runs until every request has left. A Result whose ``error`` is None holds all
        max_new_tokens tokens (a constrained request: fewer when its language is complete, ``Request.constraint``);
        otherwise ``error`` (the request's name first) says why, and the others are served as if it had not come:
        rejected on arrival by ``validate`` (no tokens, no blocks), or failed in a step (its chunk of the pass or its
        sampling raised: "request NAME: failed at step S: the exception"; the tokens generated
        before are kept, finish_step stays None, its blocks go back). When a step's batched pass raises, each chunk
        runs again alone and only those that raise alone fail. RuntimeError only for the engine's own faults (see
        ``step``); with tensor_parallel_size > 1, a worker's failure ends the run (RankError naming the rank, the
        workers stopped): no request is to blame for it."""
        results, pending = pending_requests(requests, self.num_blocks)
        self.reset(**functions)
        self.results = results
        while pending or self.waiting or self.running:
            now = time.perf_counter() - self.start_time
            while pending and pending[0].arrival <= self.clock:
                self._arrive(pending.pop(0), now)
            if not self.waiting and not self.running:
                if pending:
                    self.clock = pending[0].arrival  # nothing to do until then (the steps between change nothing)
                continue
            self.step()
        self.log.seconds, self.log.steps = time.perf_counter() - self.start_time, self.clock
        return self.results, self.log

    def add_request(self, request: Request) -> Result:
        """Online serving: `request` arrives now and joins at the next ``step`` (its ``arrival`` becomes that step).

        Returns its ``Result``, which the steps fill in; if ``validate`` rejects it, its error is set at once and it
        never runs. Its name must differ from every request added since the last ``reset`` (ValueError); a request
        with n > 1 takes its ``sample_names`` (with most = num_blocks; its other sequences' Results are
        ``results["NAME/i"]``)."""
        names = sample_names(request, self.num_blocks)
        for name in names:
            if name in self.results:
                raise ValueError(f"request names must be unique (the results are keyed by name, a request with n > 1 "
                                 f"takes NAME/1 ...): {name!r} was already added")
        request = dataclasses.replace(request, arrival=self.clock)
        for name in names:
            self.results[name] = Result(name, arrival_step=self.clock)
        self._arrive(request, time.perf_counter() - self.start_time)
        return self.results[request.name]

    def abort(self, name: str) -> bool:
        """Online serving: request `name` leaves now (its client went away, or it met a stop string).

        Its blocks go back to the pool; its Result keeps the tokens generated so far and its error says it was
        aborted. Returns True, or False if it had already left the engine (finished, failed or rejected).
        ValueError if no request of that name was added since the last ``reset``. A name of a request with n > 1
        aborts that sequence; before its prompt is computed the first name (the request's) aborts all n."""
        if name not in self.results:
            raise ValueError(f"name must be a request added since the last reset, got {name!r}")
        aborted = f"request {name}: aborted at step {self.clock}"
        for queue in (self.waiting, self.running):
            for seq in queue:
                for fork in seq.forks:  # a sequence not forked yet: it will not be
                    if fork[1].name == name:
                        fork[1].error = aborted
                        seq.forks.remove(fork)
                        return True
                if seq.name == name:
                    for _, result in seq.forks:
                        result.error = f"request {result.name}: aborted at step {self.clock} (with {name})"
                    seq.result.error = aborted
                    self.cache.release_all(seq.blocks)  # a waiting sequence's cached prefix (seq.hit) holds no reference yet
                    seq.blocks = []
                    queue.remove(seq)
                    return True
        return False

    def _arrive(self, request: Request, now: float) -> None:
        """`request` (its Result in self.results) arrives at `now` seconds: it waits, or its Result gets validate's error."""
        result = self.results[request.name]
        result.arrival_time = now
        try:
            validate(request, self.model.config.block_size, self.num_blocks, self.block_size,
                     vocab_size=self.model.config.vocab_size, max_num_seqs=self.max_num_seqs)
        except ValueError as error:
            result.error = str(error)
            for name in sample_names(request, self.num_blocks)[1:]:
                self.results[name].error = str(error)
            return
        forks = [(i, self.results[name]) for i, name in enumerate(sample_names(request, self.num_blocks)) if i]
        self.waiting.append(Sequence(request, result, self.cache, forks))

    def step(self) -> StepOutput:
        """One step of the scheduler and one forward pass over the chunks it scheduled.

        Returns a ``StepOutput``: the token each request got in this step, and the requests that left the engine
        (all their tokens, or failed: their Result's error says why). With no request waiting or running it does
        nothing (the clock stays). RuntimeError for the engine's own faults, which would otherwise hang or corrupt
        every request: a step that makes no progress (nothing scheduled, nothing preempted: blocks leaked, or a
        replacement scheduler stalls; the message counts the free, held and leaked blocks), a scheduler that
        schedules more blocks than are free, or a batched pass that raises while every chunk alone succeeds."""
        cache, waiting, running, log, step = self.cache, self.waiting, self.running, self.log, self.clock
        schedule_step, paged_attention, slot_mapping = self.schedule_step, self.paged_attention, self.slot_mapping
        start_time = self.start_time
        S = self.block_size
        output = StepOutput()
        if not waiting and not running:
            return output
        step_start = time.perf_counter() - start_time
        for seq in waiting:
            seq.find_prefix(self.share_prefixes)
        admissible = waiting if self.max_num_seqs is None else self._admissible(waiting, running)
        scheduled, preempted = schedule_step(running, admissible, len(cache.free), self.token_budget)
        if not scheduled and not preempted:
            raise RuntimeError(self._no_progress(cache, running, waiting, step))
        for seq in preempted:  # give the blocks back (still cached); recompute later, keeping the tokens generated
            cache.release_all(seq.blocks)
            seq.blocks, seq.n_cached = [], 0
            seq.result.preemptions += 1
            running.remove(seq)
        waiting = sorted(preempted, key=lambda s: s.request.arrival) + waiting
        self.waiting = waiting
        for seq, _ in scheduled:  # admitted: take the cached prefix first (before any allocation can evict it)
            if seq in waiting:
                waiting.remove(seq)
                running.append(seq)
                for b in seq.hit:
                    cache.share(b)
                seq.blocks, seq.hit = seq.hit, []
                seq.result.admissions.append((seq.n_tokens, seq.n_cached))
        chunks, prefill_tokens = [], 0
        for seq, n in scheduled:
            allocate_slots(cache, seq, n)
            if not (n == 1 and seq.prompt_len <= seq.n_cached == seq.n_tokens - 1):  # not a decode: a prompt chunk
                prefill_tokens += n
            chunks.append((seq.blocks, seq.n_cached, seq.tokens[seq.n_cached:seq.n_cached + n]))
        failed = {}  # index in scheduled -> the exception its chunk raised alone
        if chunks:
            try:
                forward = paged_forward if self.executor is None else self.executor.forward  # a worker's failure: RankError
                logits = forward(self.model, cache, chunks, paged_attention=paged_attention, slot_mapping=slot_mapping)
            except (RankError, ExecutorError):
                raise  # a worker of the tensor-parallel model failed, or they are stopped: no request's fault
            except Exception as error:  # noqa: BLE001 - whose error is it? each chunk again, alone
                logits, failed = self._forward_alone(cache, chunks, error, step, paged_attention, slot_mapping)
            with kernels.threads(1):  # a small operation: on the caller's threads it would wait for each (see ONE_THREAD_WORK)
                greedy = argmaxes(logits)
        now = time.perf_counter() - start_time
        states = {s.name: "waiting" for s in waiting}
        for i, (seq, n) in enumerate(scheduled):
            states[seq.name] = "decode" if seq.n_cached >= seq.prompt_len else "prefill"
            if i in failed:
                output.finished += self._fail(cache, seq, running, step, failed[i])
                continue
            seq.n_cached += n
            cache_full_blocks(cache, seq, seq.n_cached - n)
            if seq.n_cached != seq.n_tokens:  # a prompt chunk short of the end: no token yet
                continue
            for seq in (seq, *self._fork(seq, running)) if seq.forks else (seq,):  # n > 1: its prompt is computed
                request, result = seq.request, seq.result
                try:
                    row, top = (logits[i], greedy[i]) if seq.constraint is None else \
                        constrain(logits[i], seq.constraint)
                    if request.logprobs is None:
                        token = choose_token(row, top, seq.tokens, seq.prompt_len, request.sampling,
                                             seq.generator, self.processors)
                    else:
                        token, logprobs = choose_with_logprobs(row, top, seq.tokens, seq.prompt_len,
                                                               request.sampling, seq.generator, self.processors,
                                                               request.logprobs)
                        result.logprobs.append(logprobs)
                    if seq.constraint is not None:
                        seq.constraint.advance(token)  # ValueError for a token its mask forbade: it fails alone
                except Exception as error:  # noqa: BLE001 - this request's sampling: it fails alone
                    output.finished += self._fail(cache, seq, running, step, error)
                    continue
                seq.tokens.append(token)
                result.tokens.append(token)
                result.token_times.append(now)
                output.tokens[seq.name] = token
                if result.first_token_step is None:
                    result.first_token_step = step
                complete = seq.constraint is not None and seq.constraint.finished  # its language allows no more
                if complete or len(result.tokens) == request.max_new_tokens:
                    result.finish_step, result.finish_reason = step, "stop" if complete else "length"
                    cache.release_all(seq.blocks)
                    seq.blocks = []
                    running.remove(seq)
                    output.finished.append(seq.name)
        for seq in running:  # running but not scheduled (the token budget ran out): ready, waiting its turn
            states.setdefault(seq.name, "waiting")
        for seq in preempted:
            states[seq.name] = "preempted"
        log.states.append(states)
        held = cache.num_blocks - len(cache.free)
        log.allocated.append(held * cache.block_bytes)
        log.used.append(used_slots(cache, running, self.forked) * cache.block_bytes // S)
        log.batch.append(len(scheduled))
        log.computed.append(sum(n for _, n in scheduled))
        log.prefill.append(prefill_tokens)
        log.step_seconds.append(time.perf_counter() - start_time - step_start)
        log.clock.append(step)
        log.evictions = cache.evictions
        self.clock += 1
        return output

    def _forward_alone(self, cache: PagedKVCache, chunks: list, error: Exception, step: int, paged_attention,
                      slot_mapping):
        """The batched pass raised `error`: run each chunk alone. Returns (logits, {chunk index: its exception}).

        A chunk's keys and values go to its own blocks (no sequence writes a block another holds), so
        what the failed batched pass wrote is rewritten here or freed with a failed request's blocks."""
        rows, failed = [], {}
        for i, chunk in enumerate(chunks):
            try:
                forward = paged_forward if self.executor is None else self.executor.forward
                rows.append(forward(self.model, cache, [chunk], paged_attention=paged_attention,
                                    slot_mapping=slot_mapping)[0])
            except Exception as alone:  # noqa: BLE001 - this chunk's own error
                failed[i] = alone
                rows.append(torch.zeros(self.model.config.vocab_size))  # never read: its request fails
        if not failed:
            raise RuntimeError(f"step {step}: the batched forward pass over {len(chunks)} chunks raised, but every "
                               f"chunk alone succeeded: an engine error, not a request's") from error
        return torch.stack(rows), failed

    def _fork(self, seq: Sequence, running: list) -> list:
        """A request with n > 1 computed its prompt: its other sequences, sharing its blocks, run from now on (each
        admitted now, after the others: the last preempted first; its admission finds every token cached)."""
        children = seq.fork()
        self.forked = True
        running.extend(children)
        for child in children:
            child.result.arrival_time = seq.result.arrival_time
            child.result.admissions.append((child.n_tokens, child.n_cached))
        return children

    def _admissible(self, waiting: list, running: list) -> list:
        """The first waiting sequences that fit under max_num_seqs beside the running ones (a request with n > 1 not
        forked yet counts n, waiting or running)."""
        room = self.max_num_seqs - sum(1 + len(seq.forks) for seq in running)
        for end, seq in enumerate(waiting):
            room -= 1 + len(seq.forks)
            if room < 0:
                return waiting[:end]
        return waiting

    @staticmethod
    def _fail(cache: PagedKVCache, seq: Sequence, running: list, step: int, error: Exception) -> list:
        """Record `error` on the request's Result (and on those of its sequences not forked yet) and give its blocks
        back; it leaves the engine. Returns the names of the sequences that failed."""
        seq.result.error = f"request {seq.name}: failed at step {step}: {type(error).__name__}: {error}"
        for _, result in seq.forks:
            result.error = f"request {result.name}: failed at step {step} (its prompt, with {seq.name}): " \
                           f"{type(error).__name__}: {error}"
        cache.release_all(seq.blocks)
        seq.blocks = []
        running.remove(seq)
        names, seq.forks = [seq.name] + [result.name for _, result in seq.forks], []
        return names

    def _no_progress(self, cache: PagedKVCache, running: list, waiting: list, step: int) -> str:
        """Why a step scheduled and preempted nothing: the blocks free, held by requests and held by none (leaked)."""
        held = {b for seq in running for b in seq.blocks}
        leaked = sorted(set(range(cache.num_blocks)) - set(cache.free) - held)
        lines = [f"the engine made no progress at step {step}: the scheduler scheduled nothing and preempted nothing "
                 f"({len(running)} running, {len(waiting)} waiting); {len(cache.free)} of {cache.num_blocks} blocks "
                 f"are free, {len(held)} held by running requests, {len(leaked)} held by no request"]
        if waiting:
            seq = waiting[0]
            n = min(seq.n_tokens - seq.n_cached, self.token_budget)
            lines.append(f"the first waiting request, {seq.name}, needs {seq.blocks_needed(n)} blocks for its "
                         f"next {n} tokens")
        if leaked:
            lines.append(f"blocks leaked (not on the free list, in no running request's block table): {leaked[:12]}"
                         f"{' ...' if len(leaked) > 12 else ''}")
        else:
            lines.append("no block leaked: the scheduler returned nothing although it could schedule")
        return "; ".join(lines)
