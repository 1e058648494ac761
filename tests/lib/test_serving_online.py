"""course_lib.serving.Engine's online API (issue 33 item 5): add_request, step, abort; run is a loop over them.

Oracles: chapter 05's ``generate_cached`` for a greedy request alone (independent of the engine); ``Engine.run`` for
the replay of a trace step by step (the same steps, tokens and trace); the pool itself (its free list and reference
counts) for what abort gives back.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from course_lib.gpt import GPT, GPTConfig
from course_lib.kv_cache import generate_cached
from course_lib.serving import Engine, Request, StepOutput, make_trace

pytestmark = pytest.mark.usefixtures("one_thread")

V, CONTEXT = 61, 48


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=CONTEXT, n_layer=2, n_head=2, n_embd=32)).eval()


def alone(model, request) -> list:
    out = generate_cached(model, torch.tensor([request.prompt]), request.max_new_tokens)
    return out[0, len(request.prompt):].tolist()


def requests_of(n, seed, prefix=None):
    return make_trace(n, seed, context=CONTEXT, vocab=list(range(V)), prompt_range=(1, 14), output_median=6,
                      mean_gap=0.7, prefix=prefix)


def assert_pool_empty(cache):
    assert len(cache.free) == cache.num_blocks and not any(cache.refs), \
        f"{cache.num_blocks - len(cache.free)} blocks held, references {sum(cache.refs)}"


@pytest.mark.parametrize("num_blocks,budget", [(200, 16), (9, 5)])  # roomy; tight (preemption)
def test_replaying_a_trace_step_by_step_is_run(small, num_blocks, budget):
    requests = requests_of(12, 3, prefix=[5, 6, 7, 8])  # shared prefix blocks of 4
    requests[4] = dataclasses.replace(requests[4], sampling={"temperature": 0.9, "top_k": 8}, seed=11)
    offline = Engine(small, num_blocks=num_blocks, block_size=4, token_budget=budget)
    expected, expected_trace = offline.run(requests)
    engine = Engine(small, num_blocks=num_blocks, block_size=4, token_budget=budget)
    streamed = {r.name: [] for r in requests}
    finished_at = {}
    pending = sorted(requests, key=lambda r: r.arrival)
    while pending or engine.waiting or engine.running:
        if not engine.waiting and not engine.running:
            engine.clock = pending[0].arrival  # as run does: nothing happens until then
        while pending and pending[0].arrival <= engine.clock:
            r = pending.pop(0)
            assert engine.add_request(r).arrival_step == r.arrival
        step = engine.clock
        output = engine.step()
        assert engine.clock == step + 1
        for name, token in output.tokens.items():
            streamed[name].append(token)
        for name in output.finished:
            assert name not in finished_at
            finished_at[name] = step
    if num_blocks == 9:
        assert sum(r.preemptions for r in engine.results.values()) > 0  # the tight pool preempted
    for r in requests:
        got, want = engine.results[r.name], expected[r.name]
        assert got.error is None and streamed[r.name] == got.tokens == want.tokens, r.name
        assert (got.first_token_step, got.finish_step, got.preemptions) == \
               (want.first_token_step, want.finish_step, want.preemptions), r.name
        assert finished_at[r.name] == want.finish_step
        if r.sampling is None:
            assert got.tokens == alone(small, r), r.name
    assert engine.log.states == expected_trace.states and engine.log.batch == expected_trace.batch
    assert engine.log.computed == expected_trace.computed and engine.log.allocated == expected_trace.allocated
    assert_pool_empty(engine.cache)


def test_requests_added_while_others_run_get_their_tokens_alone(small):
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=6)
    requests = [Request(f"r{i}", [(7 * i + j) % V for j in range(3 + 2 * i)], 5 + i) for i in range(6)]
    for i, r in enumerate(requests):  # one joins every other step, into a running batch
        engine.add_request(r)
        engine.step()
        engine.step()
        assert len(engine.running) >= min(i + 1, 2)
    while engine.waiting or engine.running:
        engine.step()
    for r in requests:
        assert engine.results[r.name].error is None and engine.results[r.name].tokens == alone(small, r), r.name
    assert engine.step() == StepOutput() and engine.clock == len(engine.log.states)  # idle: no step
    assert_pool_empty(engine.cache)


def test_abort_gives_the_blocks_back_and_the_others_finish(small):
    engine = Engine(small, num_blocks=30, block_size=4, token_budget=16, max_num_seqs=2)
    long, short, queued = Request("long", list(range(10)), 30), Request("short", [3, 1, 4], 6), Request("q", [2, 7], 5)
    for r in (long, short, queued):
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    assert [s.request.name for s in engine.running] == ["long", "short"] and engine.waiting[0].request.name == "q"
    held = next(s for s in engine.running if s.request.name == "long").blocks
    assert len(held) == 4  # 10 prompt + 3 new tokens cached: 13 slots, 4 blocks of 4
    free = len(engine.cache.free)
    assert engine.abort("long") is True
    assert len(engine.cache.free) == free + len(held) and all(engine.cache.refs[b] == 0 for b in held)
    result = engine.results["long"]
    assert "aborted" in result.error and result.tokens == alone(small, long)[:len(result.tokens)]
    assert len(result.tokens) == 4 and result.finish_step is None
    assert engine.abort("long") is False  # gone already
    with pytest.raises(ValueError, match="name must be a request added"):
        engine.abort("nobody")
    while engine.waiting or engine.running:
        engine.step()
    for r in (short, queued):  # the waiting one was admitted in the room the aborted one left
        assert engine.results[r.name].error is None and engine.results[r.name].tokens == alone(small, r)
    assert engine.abort("short") is False
    assert_pool_empty(engine.cache)


def test_abort_of_a_waiting_request_and_a_bad_request_online(small):
    engine = Engine(small, num_blocks=30, block_size=4, max_num_seqs=1)
    engine.add_request(Request("a", [1, 2, 3], 4))
    engine.add_request(Request("b", [1, 2, 3, 4, 5], 4))  # waits: the cap is 1
    engine.step()
    assert engine.abort("b") is True and not engine.waiting and engine.results["b"].tokens == []
    bad = engine.add_request(Request("bad", [1, V], 4))  # a token id outside the vocabulary: rejected at once
    assert "prompt token ids must be integers in [0, vocab_size = 61)" in bad.error and not engine.waiting
    with pytest.raises(ValueError, match="unique"):
        engine.add_request(Request("a", [1], 1))
    while engine.running:
        engine.step()
    assert engine.results["a"].tokens == alone(small, Request("a", [1, 2, 3], 4))
    assert_pool_empty(engine.cache)
