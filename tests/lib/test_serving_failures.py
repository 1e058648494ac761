"""Every request fails alone (issue 33): course_lib.serving.Engine with bad requests, failing steps and stalls.

Oracles, independent of the engine: a surviving request's tokens equal generating it alone (chapter 05's
``generate_cached`` for greedy, an uncached loop with chapter 06's ``process_logits`` for sampled ones);
the pool is checked directly (every block on the free list, no reference, no remembered prefix); a failed
request's tokens are a prefix of its alone run. Each bad request arrives into a running batch (arrival 2,
while the others prefill and decode), with prefix sharing and, in a tight pool, preemption.
"""
from __future__ import annotations

import contextlib
import math
import signal

import pytest
import torch

import course_lib.serving as serving
from course_lib.decoding import min_p_filter, process_logits
from course_lib.gpt import GPT, GPTConfig
from course_lib.kv_cache import generate_cached
from course_lib.serving import Engine, Request, make_trace, paged_attention, schedule_step, static_batching

pytestmark = pytest.mark.usefixtures("one_thread")

V, CONTEXT = 61, 48
PREFIX = [7, 8, 9, 10, 11, 12, 13, 14]  # a system prompt: two full blocks of 4, shared


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, block_size=CONTEXT, n_layer=2, n_head=2, n_embd=32)).eval()


@pytest.fixture
def pools(monkeypatch):
    """Every PagedKVCache the engine makes, to look at after the run."""
    made, original = [], serving.PagedKVCache.for_model

    def for_model(model, num_blocks, block_size):
        made.append(original(model, num_blocks, block_size))
        return made[-1]

    monkeypatch.setattr(serving.PagedKVCache, "for_model", staticmethod(for_model))
    return made


def assert_all_blocks_back(cache):
    assert sorted(cache.free) == list(range(cache.num_blocks)), f"{cache.num_blocks - len(cache.free)} blocks held"
    assert not any(cache.refs)  # blocks stay cached on the free list (prefix caching), each under its own hash
    assert all(cache.cached[h] == block for block, (h, _, _) in cache.hash_of.items()) and len(cache.cached) == len(cache.hash_of)


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail the test instead of hanging: SIGALRM raises in the main thread after `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: the engine hangs")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def alone(model, request) -> list:
    out = generate_cached(model, torch.tensor([request.prompt]), request.max_new_tokens)
    return out[0, len(request.prompt):].tolist()


def sampled_alone(model, request, sampling=None) -> list:
    """No cache, the full forward pass at every step, a generator seeded per request."""
    g = torch.Generator().manual_seed(request.seed)
    idx = torch.tensor([request.prompt])
    for _ in range(request.max_new_tokens):
        with torch.no_grad():
            logits = model(idx)[0][:, -1]
        scores = process_logits(logits, idx, idx[:, len(request.prompt):], **(sampling or request.sampling))
        idx = torch.cat([idx, torch.multinomial(torch.softmax(scores, -1), 1, generator=g)], dim=1)
    return idx[0, len(request.prompt):].tolist()


def expected(model, request) -> list:
    return alone(model, request) if request.sampling is None else sampled_alone(model, request)


def batch():
    """Eight requests of at most 31 tokens, a shared 8-token prefix (the prefix cache), some sampled, arrivals 0..4."""
    requests = make_trace(8, 3, context=31, vocab=list(range(V)), prompt_range=(1, 10), output_median=6,
                          mean_gap=0.6, prefix=PREFIX)  # 31 tokens at most: contexts <= 30
    for i, r in enumerate(requests[::3]):
        r.sampling, r.seed = [dict(temperature=0.9), dict(top_k=7, repetition_penalty=1.2), dict(top_p=0.8)][i], 50 + i
    return requests


ENGINES = {"roomy": dict(num_blocks=80, block_size=4, token_budget=16),
           "tight": dict(num_blocks=12, block_size=4, token_budget=6)}  # 12 blocks: the largest request only


def serve(model, pools, requests, engine="roomy", **kwargs):
    results, trace = Engine(model, **ENGINES[engine]).run(requests, **kwargs)
    assert_all_blocks_back(pools[-1])
    return results, trace


def assert_the_others_exact(model, results, requests, failed: set):
    for r in requests:
        if r.name not in failed:
            assert results[r.name].error is None, results[r.name].error
            assert results[r.name].tokens == expected(model, r), r.name


# ---------------------------------------------------------------------------------------------------- on arrival

BAD = [  # (request, the words its error must contain: the field and its allowed range)
    (Request("hot", [1, 2, 3], 4, sampling=dict(temperature=-0.5)), "sampling temperature: temperature must be >= 0 (0 means greedy), got -0.5"),
    (Request("nan", [1, 2, 3], 4, sampling=dict(temperature=float("nan"))), "sampling temperature must be a finite number, got nan"),
    (Request("topk", [1, 2, 3], 4, sampling=dict(top_k=2.0)), "sampling top_k: top_k must be an integer >= 1, got 2.0"),
    (Request("topk-", [1, 2, 3], 4, sampling=dict(top_k=-3)), "sampling top_k: top_k must be an integer >= 1, got -3"),
    (Request("topp", [1, 2, 3], 4, sampling=dict(top_p=0.0)), "sampling top_p: top_p must be in (0, 1], got 0.0"),
    (Request("minp", [1, 2, 3], 4, sampling=dict(min_p=1.5)), "sampling min_p: min_p must be in [0, 1], got 1.5"),
    (Request("rep", [1, 2, 3], 4, sampling=dict(repetition_penalty=0)), "sampling repetition_penalty: repetition_penalty must be > 0 (1 means no penalty), got 0"),
    (Request("freq", [1, 2, 3], 4, sampling=dict(frequency_penalty=3)), "sampling frequency_penalty: frequency_penalty must be in [-2, 2], got 3"),
    (Request("pres", [1, 2, 3], 4, sampling=dict(presence_penalty="1")), "sampling presence_penalty must be a finite number, got '1'"),
    (Request("typo", [1, 2, 3], 4, sampling=dict(temprature=0.5)), "sampling has no setting 'temprature'; the settings are repetition_penalty, frequency_penalty, presence_penalty, temperature"),
    (Request("notdict", [1, 2, 3], 4, sampling=0.8), "sampling must be None (greedy) or a dict of settings"),
    (Request("inf", [1, 2, 3], 4, sampling=dict(temperature=float("inf"))), "sampling temperature must be a finite number, got inf"),
    (Request("temp-none", [1, 2, 3], 4, sampling=dict(temperature=None)), "sampling temperature must be a finite number, got None"),
    (Request("fn", [1, 2, 3], 4, sampling=dict(top_k_filter=abs)), "sampling has no setting 'top_k_filter'"),  # Engine.run's
    (Request("fns", [1, 2, 3], 4, sampling=dict(functions={"top_k_filter": abs})), "sampling has no setting 'functions'"),
    (Request("seed", [1, 2, 3], 4, seed=2 ** 64), "seed must be an integer in [-2**63, 2**64)"),
    (Request("seedf", [1, 2, 3], 4, seed=1.5), "seed must be an integer in [-2**63, 2**64)"),
    (Request("oov", [1, V, 3], 4), f"prompt token ids must be integers in [0, vocab_size = {V}), got {V} at position 1"),
    (Request("neg", [1, 2, -1], 4), f"prompt token ids must be integers in [0, vocab_size = {V}), got -1 at position 2"),
    (Request("float", [1, 2.0], 4), "prompt token ids must be integers in [0, vocab_size"),
    (Request("str", "abc", 4), "prompt must be a list of token ids, got str"),
    (Request("empty", [], 4), "prompt must hold at least 1 token"),
    (Request("long", [1] * 40, 9), "prompt length + max_new_tokens must be <= the model's context length, context = 48"),
    (Request("bool", [1, 2], True), "max_new_tokens must be an integer >= 1"),
    (Request("zero", [1, 2], 0), "max_new_tokens must be an integer >= 1"),
]


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("bad,words", BAD, ids=[b.name for b, _ in BAD])
def test_a_bad_request_arriving_mid_run_is_rejected_alone_with_the_field_and_its_range(small, pools, bad, words, engine):
    bad.arrival = 2  # the others are prefilling and decoding by then
    requests = batch()
    requests.insert(3, bad)
    results, _ = serve(small, pools, requests, engine)
    assert results[bad.name].error.startswith(f"request {bad.name}: ") and words in results[bad.name].error
    assert results[bad.name].tokens == [] and results[bad.name].arrival_time > 0  # rejected on arrival, not before
    assert_the_others_exact(small, results, requests, {bad.name})


def test_the_allowed_values_at_the_edges_of_each_range_are_served(small, pools):
    edges = [dict(temperature=0), dict(top_k=0), dict(top_k=None, top_p=1.0), dict(min_p=0.0), dict(min_p=1.0),
             dict(repetition_penalty=None, frequency_penalty=-2, presence_penalty=2), {}]
    requests = [Request(f"e{i}", [0, 5, V - 1], 4, sampling=s, seed=[0, -2 ** 63, 2 ** 64 - 1][i % 3])
                for i, s in enumerate(edges)]
    results, _ = serve(small, pools, requests)
    assert_the_others_exact(small, results, requests, set())


def test_static_batching_rejects_the_same_requests_with_the_same_errors(small, pools):
    requests = batch() + [Request("oov", [1, V], 3, arrival=1), Request("hot", [1], 3, sampling=dict(top_p=2))]
    engine, _ = serve(small, pools, requests)
    static, _ = static_batching(small, requests, 4)
    for name in ("oov", "hot"):
        assert static[name].error == engine[name].error and engine[name].error
    assert_the_others_exact(small, static, requests, {"oov", "hot"})


def test_a_bad_arrival_is_rejected_at_once_and_duplicate_names_raise(small, pools):
    requests = batch() + [Request("never", [1, 2], 3, arrival=-1), Request("when", [1, 2], 3, arrival=2.5)]
    results, _ = serve(small, pools, requests)
    assert "arrival must be an integer >= 0 (an engine step), got -1" in results["never"].error
    assert "got 2.5" in results["when"].error
    assert_the_others_exact(small, results, requests, {"never", "when"})
    with pytest.raises(ValueError, match="request names must be unique.*'r00' appears twice"):
        Engine(small, num_blocks=40).run(batch() + [Request("r00", [1], 1)])


# ---------------------------------------------------------------------------------------------------- mid-run


def failing_after(calls: int, function):
    """A processor that works `calls` times, then raises (a request whose own processing breaks mid-run)."""
    count = [0]

    def planted(*args):
        count[0] += 1
        if count[0] > calls:
            raise FloatingPointError(f"planted: call {count[0]}")
        return function(*args)
    return planted


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("calls", [0, 3])  # at its first token (right after its prefill), or mid-decode
def test_a_request_whose_sampling_raises_mid_run_fails_alone_and_keeps_its_tokens_so_far(small, pools, engine, calls):
    requests = batch()
    doomed = Request("doomed", PREFIX + [3, 1, 4, 1, 5], 9, arrival=1, seed=5,  # shares the others' prefix blocks
                     sampling=dict(min_p=0.05))  # the only request with min_p: the only one its filter breaks
    requests.insert(2, doomed)
    results, trace = serve(small, pools, requests, engine, min_p_filter=failing_after(calls, min_p_filter))
    error = results["doomed"].error
    assert error.startswith("request doomed: failed at step ") and f"FloatingPointError: planted: call {calls + 1}" in error
    assert results["doomed"].tokens == sampled_alone(small, doomed)[:calls]  # its tokens before
    assert results["doomed"].finish_step is None
    assert_the_others_exact(small, results, requests, {"doomed"})


def attention_failing_past(length: int):
    """Paged attention that raises when a sequence in the decode batch attends to more than `length` positions
    (a request whose own forward pass breaks mid-decode)."""
    def planted(q, key_pool, value_pool, block_tables, context_lens):
        if int(context_lens.max()) > length:
            raise IndexError(f"planted: context of {int(context_lens.max())} positions")
        return paged_attention(q, key_pool, value_pool, block_tables, context_lens)
    return planted


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_request_whose_forward_pass_raises_mid_run_fails_alone_and_the_batch_is_recomputed(small, pools, engine,
                                                                                             monkeypatch):
    requests = batch()  # contexts of at most 30 positions: only `doomed` gets past 30
    doomed = Request("doomed", PREFIX + [2, 7, 1, 8, 2, 8] * 2, 20, arrival=1)  # shares the others' prefix blocks
    steady = [Request(f"steady{a}", [4, 6, 6, 9, 2], 20, arrival=a) for a in (6, 10)]  # decoding beside it then
    requests[1:1] = [doomed, *steady]
    raised, forward = [], serving.paged_forward

    def spy(model, cache, chunks, **kwargs):  # the number of chunks of each forward pass that raised
        try:
            return forward(model, cache, chunks, **kwargs)
        except IndexError:
            raised.append(len(chunks))
            raise
    monkeypatch.setattr(serving.engine, "paged_forward", spy)
    results, _ = serve(small, pools, requests, engine, paged_attention=attention_failing_past(30))
    assert len(raised) == 2 and raised[1] == 1  # one pass raised, then, of its chunks alone, doomed's only
    if engine == "roomy":
        assert raised[0] > 1  # the pass that raised held other requests' chunks (in the tight pool doomed runs alone)
    else:
        assert sum(r.preemptions for r in results.values()) > 0
    error = results["doomed"].error
    assert error.startswith("request doomed: failed at step ") and "IndexError: planted: context of" in error
    tokens = results["doomed"].tokens
    assert len(tokens) >= 31 - 20 and tokens == alone(small, doomed)[:len(tokens)]  # what it made before: exact
    assert_the_others_exact(small, results, requests, {"doomed"})


def test_a_batched_pass_that_raises_though_every_chunk_alone_succeeds_is_an_engine_error(small, pools):
    def batch_only(q, key_pool, value_pool, block_tables, context_lens):
        if len(q) > 1:
            raise RuntimeError("planted: fails for batches only")
        return paged_attention(q, key_pool, value_pool, block_tables, context_lens)
    with pytest.raises(RuntimeError, match="every chunk alone succeeded: an engine error") as info:
        Engine(small, num_blocks=80, block_size=4).run(batch(), paged_attention=batch_only)
    assert "planted: fails for batches only" in str(info.value.__cause__)


# ---------------------------------------------------------------------------------------------------- no progress


def test_leaked_blocks_stop_the_engine_with_an_error_instead_of_a_hang(small, pools, monkeypatch):
    def leaking_release(self, block):  # planted: at the last reference, forgets to put the block on the free list
        self.refs[block] -= 1
    monkeypatch.setattr(serving.PagedKVCache, "release", leaking_release)
    requests = [Request(f"q{i}", [i + 1] * 6, 6, arrival=2 * i) for i in range(6)]  # 3 blocks each, one after another
    with deadline(20), pytest.raises(RuntimeError, match="the engine made no progress at step") as info:
        Engine(small, num_blocks=8, block_size=4).run(requests)
    message = str(info.value)
    assert "(0 running, 3 waiting); 0 of 8 blocks are free, 0 held by running requests, 8 held by no request" in message
    assert "blocks leaked (not on the free list, in no running request's block table): [0, 1, 2, 3, 4, 5, 6, 7]" in message


def test_a_scheduler_that_schedules_nothing_stops_the_engine_with_an_error_instead_of_a_hang(small, pools):
    def strict(running, waiting, num_free_blocks, token_budget):  # planted: needs one block more than it takes
        return schedule_step(running, waiting, num_free_blocks - 1, token_budget)
    requests = batch()
    fits = max(math.ceil((len(r.prompt) + r.max_new_tokens) / 4) for r in requests)
    with deadline(20), pytest.raises(RuntimeError, match="no block leaked: the scheduler returned nothing"):
        Engine(small, num_blocks=fits, block_size=4, token_budget=64).run(requests, schedule_step=strict)


def test_the_correct_engine_never_stalls_in_a_pool_that_holds_one_request(small, pools):
    requests = batch()
    fits = max(math.ceil((len(r.prompt) + r.max_new_tokens) / 2) for r in requests)
    with deadline(60):
        results, _ = Engine(small, num_blocks=fits, block_size=2, token_budget=5).run(requests)
    assert sum(r.preemptions for r in results.values()) > 0
    assert_all_blocks_back(pools[-1])
    assert_the_others_exact(small, results, requests, set())
