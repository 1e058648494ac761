"""Chapter 12's engine on p processes (``Engine(..., tensor_parallel_size=p)``, course_lib.serving.executor) against
the single-process engine serving each request alone: the same tokens for greedy and seeded requests, with prefix
caching, preemption and parallel sampling (n > 1: copy on write replayed on the workers); the same step log (the
scheduler and the bookkeeping stay in the caller). Failures end the group with a RankError naming the rank, within
the time limit; the workers are gone after ``close``, ``with``, a failure and an interrupt.

Tokens, not logits: a row-parallel layer adds its p partial products in another order than one process, so the
logits agree within float32 rounding; the traces' tokens are not decided by that rounding (they are equal, asserted).
"""
from __future__ import annotations

import functools
import gc
import math
import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from course_lib import assets, tensor_parallel as tp
from course_lib.gpt import GPT, GPTConfig
from course_lib.serving import Engine, Request, executor, make_trace

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def char_gpt():
    """Trained weights: peaked distributions, whose tokens a wrong key or value changes (a small random model's are
    nearly uniform, and its sampled tokens barely move)."""
    return assets.load("char-gpt").eval()


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=4, n_embd=32)).eval()


def no_processes_left():
    assert multiprocessing.active_children() == []


def mixed_trace() -> list:
    """Greedy and seeded requests, a shared 9-token prefix (two full blocks of 4), n = 3 and n = 2 among them."""
    requests = make_trace(8, 6, context=48, vocab=list(range(103)), prompt_range=(2, 10), output_median=12,
                          mean_gap=0.3, prefix=[3, 1, 4, 1, 5, 9, 2, 6, 5])
    settings = [None, dict(temperature=0.9), dict(top_k=5, temperature=1.2), dict(top_p=0.8)]
    for i, r in enumerate(requests):
        r.sampling, r.seed, r.n = settings[i % 4], 40 + i, (1, 3, 1, 2, 1, 1, 3, 1)[i]
    return requests


def alone(model, request) -> dict:
    """The oracle: the single-process engine serving this request alone, in a roomy pool: {name: tokens}."""
    results, _ = Engine(model, num_blocks=64, block_size=4, token_budget=16).run([request])
    return {name: result.tokens for name, result in results.items()}


@pytest.mark.parametrize("p,num_blocks,budget", [(2, 80, 16), (2, 32, 8), (4, 80, 16)])  # 32 blocks: preemption
def test_every_request_gets_the_tokens_of_the_single_process_engine_serving_it_alone(char_gpt, p, num_blocks, budget):
    requests = mixed_trace()
    single, single_log = Engine(char_gpt, num_blocks=num_blocks, block_size=4, token_budget=budget).run(requests)
    with Engine(char_gpt, num_blocks=num_blocks, block_size=4, token_budget=budget, tensor_parallel_size=p) as engine:
        results, log = engine.run(requests)
    no_processes_left()
    for r in requests:
        for name, tokens in alone(char_gpt, r).items():
            assert results[name].error is None, results[name].error
            assert len(tokens) == r.max_new_tokens
            assert results[name].tokens == tokens, name
    # the scheduler and the pool's bookkeeping stay in the caller: the same steps, blocks and KV bytes as one process
    assert (log.batch, log.computed, log.allocated, log.used) == (single_log.batch, single_log.computed,
                                                                  single_log.allocated, single_log.used)
    assert log.allocated[0] > 0  # a block's bytes: the whole model's (every head), not one rank's
    prompt_tokens = sum(len(r.prompt) for r in requests)
    assert sum(log.prefill) < prompt_tokens  # the shared prefix was found in the cache, not computed again
    if num_blocks == 32:
        assert sum(result.preemptions for result in results.values()) > 0
    assert len({tuple(results[n].tokens) for n in ("r01", "r01/1", "r01/2")}) > 1  # n = 3: the seeds differ


def test_online_serving_on_two_processes_gives_each_request_its_tokens_alone(small):
    requests = make_trace(3, 9, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5)
    with Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        results = {r.name: engine.add_request(r) for r in requests}
        while engine.running or engine.waiting:
            engine.step()
    for r in requests:
        assert results[r.name].tokens == alone(small, r)[r.name], r.name
    no_processes_left()


# ---------------------------------------------------------------------------------------------- failures


def failing_on(rank_that_fails: int, at_call: int, how):
    """paged_forward replaced (in the caller, before the fork: the workers inherit it) by one that does `how` on
    rank `rank_that_fails` at its at_call-th pass."""
    real, calls = executor.paged_forward, []

    def paged_forward(*args, **kwargs):
        calls.append(1)
        if dist.get_rank() == rank_that_fails and len(calls) == at_call:
            how()
        return real(*args, **kwargs)
    return paged_forward


def planted_error():
    raise ValueError("planted failure")


@pytest.mark.parametrize("p,rank", [(2, 1), (2, 0), (4, 2)])
def test_a_rank_that_raises_ends_the_run_with_an_error_naming_it_within_the_time_limit(small, monkeypatch, p, rank):
    monkeypatch.setattr(executor, "paged_forward", failing_on(rank, 3, planted_error))
    monkeypatch.setattr(tp, "TIMEOUT_S", 20.0)
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=p)
    start = time.monotonic()
    with pytest.raises(tp.RankError, match=rf"rank {rank} of {p} failed.*ValueError: planted failure") as info:
        engine.run(make_trace(4, 1, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5))
    assert info.value.rank == rank and info.value.error_type == "ValueError"
    assert time.monotonic() - start < 20.0
    no_processes_left()  # the failure stopped every worker
    with pytest.raises(RuntimeError, match="workers are stopped"):
        engine.executor.forward(small, engine.cache, [([0], 0, [1])], paged_attention=None, slot_mapping=None)
    engine.close()  # again: nothing to do


def test_a_rank_that_crashes_is_named(small, monkeypatch):
    monkeypatch.setattr(executor, "paged_forward", failing_on(1, 2, lambda: os._exit(3)))
    with Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        with pytest.raises(tp.RankError, match=r"rank 1 of 2 died \(exit code 3\)") as info:
            engine.run(make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5))
    assert info.value.rank == 1
    no_processes_left()


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_that_stops_answering_is_a_timeout_naming_it_not_a_hang(small, monkeypatch, rank):
    """The silent rank holds the other inside an all-reduce, which fails when its time is up: the error names the rank
    that did not answer, not the one that waited for it (every rank answers each step, not only rank 0)."""
    monkeypatch.setattr(executor, "paged_forward", failing_on(rank, 2, lambda: time.sleep(60)))
    monkeypatch.setattr(tp, "TIMEOUT_S", 2.0)
    start = time.monotonic()
    with Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        says = rf"^rank {rank} of 2 did not answer within 2.0 s \(for 'step'\); rank {1 - rank} failed after waiting"
        with pytest.raises(tp.RankError, match=says + " that long in a collective") as info:
            engine.run(make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5))
    assert info.value.rank == rank
    assert time.monotonic() - start < 2.0 + tp.GRACE_S + executor.STOP_S + 3
    no_processes_left()


def test_an_interrupted_caller_stops_the_workers(small, monkeypatch):
    monkeypatch.setattr(executor, "paged_forward", failing_on(1, 2, lambda: time.sleep(60)))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            engine.run(make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert engine.executor.closed
    no_processes_left()


def test_close_with_and_garbage_collection_stop_the_workers(small):
    engine = Engine(small, num_blocks=8, block_size=4, tensor_parallel_size=2)
    assert len(multiprocessing.active_children()) == 2
    engine.close()
    no_processes_left()
    with Engine(small, num_blocks=8, block_size=4, tensor_parallel_size=2):
        assert len(multiprocessing.active_children()) == 2
    no_processes_left()
    Engine(small, num_blocks=8, block_size=4, tensor_parallel_size=2)  # dropped at once
    gc.collect()
    no_processes_left()


@pytest.mark.parametrize("size,message", [(0, "tensor_parallel_size"), (3, r"n_head \(4\) must be divisible by "
                                                                          r"tensor_parallel_size \(3\)")])
def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_a_value_error(small, size, message):
    with pytest.raises(ValueError, match=message):
        Engine(small, num_blocks=8, block_size=4, tensor_parallel_size=size)
    no_processes_left()


def test_the_default_runs_in_this_process(small):
    engine = Engine(small, num_blocks=8, block_size=4)
    assert engine.executor is None and multiprocessing.active_children() == []
    assert math.prod(engine.cache.storage.shape) > 0  # the keys and values are here


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_killed_between_runs_is_named_not_blamed_on_the_requests(small, rank):
    """SIGKILL (the kernel's out-of-memory killer, say) while the engine waits between runs: the next step's message
    cannot reach that worker. A RankError naming it, not every request failed by a broken pipe."""
    trace = make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5)
    with Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        engine.run(trace)
        victim = engine.executor.processes[rank]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        with pytest.raises(tp.RankError, match=rf"rank {rank} of 2 died \(exit code -9\)") as info:
            engine.run(trace)
    assert info.value.rank == rank
    no_processes_left()


def test_an_engine_whose_workers_are_stopped_says_so_rather_than_failing_every_request(small):
    trace = make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5)
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2)
    engine.close()
    with pytest.raises(executor.ExecutorError, match="workers are stopped .* make a new Engine"):
        engine.run(trace)
    no_processes_left()


def test_functions_that_cannot_reach_the_workers_are_named_not_blamed_on_the_requests(small):
    trace = make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5)
    from course_lib.serving.model_runner import paged_attention
    with Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        with pytest.raises(executor.ExecutorError, match="paged_attention and slot_mapping .* reach the workers"):
            engine.run(trace, paged_attention=lambda *args, **kwargs: paged_attention(*args, **kwargs))
    no_processes_left()


def attention_of_the_fork(*args, **kwargs):
    """A step function the workers know by name: defined before they were forked."""
    from course_lib.serving.model_runner import paged_attention
    return paged_attention(*args, **kwargs)


@pytest.mark.parametrize("name,says,wrap", [
    ("attention_of_the_fork", "was redefined after the Engine started its workers", lambda f: f),
    ("attention_of_the_fork", "was redefined after the Engine started its workers", functools.partial),  # by name too
    ("attention_defined_later", "was defined after the Engine started its workers", lambda f: f)])
def test_a_step_function_the_workers_hold_no_current_copy_of_is_an_error_not_a_stale_run(small, monkeypatch, name,
                                                                                        says, wrap):
    """The workers get the step's functions by name (pickle), as their module held them when the Engine forked them:
    a learner who fixes a function and re-runs the engine cell must get an error, never the old definition's run. The
    caller's error, naming the function: no rank failed (every rank refuses the step before any collective)."""
    trace = make_trace(3, 2, context=48, vocab=list(range(61)), prompt_range=(1, 10), output_median=5)
    with Engine(small, num_blocks=40, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        namespace = {"__name__": __name__}
        exec(f"def {name}(*args, **kwargs):\n    raise ValueError('the definition made after the fork')", namespace)
        monkeypatch.setattr(sys.modules[__name__], name, namespace[name], raising=False)
        with pytest.raises(executor.ExecutorError, match=rf"^paged_attention {__name__}.{name} {says}: .* make a new "
                                                         "Engine$") as info:
            engine.run(trace, paged_attention=wrap(namespace[name]))
    assert not isinstance(info.value, tp.RankError) and "rank" not in str(info.value)
    no_processes_left()


def test_logprobs_on_two_processes_are_those_of_the_request_alone_within_float32_rounding(char_gpt):
    """The sampler stays in the caller and reads rank 0's logits: the same tokens, the same top-k alternatives, their
    log-probabilities within float32 rounding (the row-parallel sums add in another order)."""
    requests = mixed_trace()
    for i, r in enumerate(requests):
        r.logprobs = (0, 2, 5)[i % 3]
    with Engine(char_gpt, num_blocks=32, block_size=4, token_budget=8, tensor_parallel_size=2) as engine:
        results, _ = engine.run(requests)
    for r in requests:
        oracle, _ = Engine(char_gpt, num_blocks=64, block_size=4, token_budget=16).run([r])
        for name, want in oracle.items():
            got = results[name]
            assert got.tokens == want.tokens and len(got.logprobs) == len(want.logprobs) == r.max_new_tokens, name
            for (lp, top), (want_lp, want_top) in zip(got.logprobs, want.logprobs):
                assert [t for t, _ in top] == [t for t, _ in want_top], name
                assert len(want_top) == r.logprobs
                assert lp == pytest.approx(want_lp, abs=1e-4)
                assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)
