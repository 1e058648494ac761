"""Parallel sampling (``Request.n``) and log-probabilities (``Request.logprobs``) in course_lib.serving, against
independent oracles.

* n > 1: sequence i of a request seeded s gets the tokens of a request with n = 1 seeded (s + i) mod 2**64 run alone
  in an uncached loop (the full forward pass at every step, chapter 06's ``process_logits``, ``torch.multinomial``
  on a generator seeded by that rule); greedy, n identical answers equal to ``generate_cached`` alone. The prompt is
  computed once (tokens computed, from the step log) and its full blocks shared (blocks allocated, counted by
  hand from the block size), and every block goes back.
* logprobs: a float64 copy of the model run over the emitted sequence alone (the plain GPT forward pass), the
  request's processors applied to its logits in float64, log_softmax.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from course_lib import serving
from course_lib.decoding import process_logits
from course_lib.gpt import GPT, GPTConfig
from course_lib.kv_cache import generate_cached
from course_lib.serving import Engine, Request, make_trace

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [dict(temperature=0.9), dict(top_k=5, temperature=1.2), dict(top_p=0.8),
            dict(frequency_penalty=0.8, presence_penalty=0.5, temperature=0.7)]


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()


def names(request) -> list:
    return [request.name] + [f"{request.name}/{i}" for i in range(1, request.n)]


def sampled_alone(model, prompt, max_new_tokens, sampling, seed) -> list:
    """The oracle: no cache, the full forward pass at every step, one generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt])
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx)[0][:, -1]
        scores = process_logits(logits, idx, idx[:, len(prompt):], **sampling)
        idx = torch.cat([idx, torch.multinomial(torch.softmax(scores, -1), 1, generator=g)], dim=1)
    return idx[0, len(prompt):].tolist()


def assert_all_blocks_back(cache):
    assert sorted(cache.free) == list(range(cache.num_blocks)), f"{cache.num_blocks - len(cache.free)} blocks held"
    assert not any(cache.refs)


def parallel_trace():
    """Requests with n > 1 (seeds at the edges of the range: (s + i) wraps past 2**64) among requests with n = 1."""
    requests = make_trace(6, 3, context=48, vocab=list(range(61)), prompt_range=(3, 14), output_median=6, mean_gap=0.1)
    seeds = [7, 2 ** 64 - 2, -3, 11, 5, 1234]
    for i, r in enumerate(requests):
        r.sampling, r.seed, r.n = SETTINGS[i % len(SETTINGS)], seeds[i], (4, 3, 2, 1, 3, 1)[i]
    return requests


@pytest.mark.parametrize("num_blocks,budget", [(80, 16), (10, 6)])  # roomy; a pool that preempts (the largest needs 10)
def test_sequence_i_of_a_request_seeded_s_equals_the_request_seeded_s_plus_i_alone(small, num_blocks, budget):
    requests = parallel_trace()
    engine = Engine(small, num_blocks=num_blocks, block_size=4, token_budget=budget)
    results, _ = engine.run(requests)
    for r in requests:
        for i, name in enumerate(names(r)):
            assert results[name].error is None, results[name].error
            expected = sampled_alone(small, r.prompt, r.max_new_tokens, r.sampling, (r.seed + i) % 2 ** 64)
            assert results[name].tokens == expected, name
    if num_blocks == 10:
        assert sum(results[name].preemptions for name in results if "/" in name) > 0  # forked ones preempted too
    assert len({tuple(results[name].tokens) for name in names(requests[0])}) > 1  # the seeds differ: so do the samples
    assert_all_blocks_back(engine.cache)


def test_greedy_with_n_gives_n_identical_answers_equal_to_generating_alone(small):
    prompt = [5, 9, 2, 44, 17, 3, 8, 30, 1, 12, 6]
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=16)
    r = Request("g", prompt, 9, n=5)
    results, _ = engine.run([r])
    expected = generate_cached(small, torch.tensor([prompt]), 9)[0, len(prompt):].tolist()
    assert [results[name].tokens for name in names(r)] == [expected] * 5
    assert_all_blocks_back(engine.cache)


@pytest.mark.parametrize("prompt_len", [10, 12])  # a partly filled last prompt block (copied on write), or none
def test_the_prompt_is_computed_once_and_its_full_blocks_are_shared(small, prompt_len, monkeypatch):
    allocated = []
    original = serving.PagedKVCache.allocate

    def allocate(cache):
        allocated.append(original(cache))
        return allocated[-1]

    monkeypatch.setattr(serving.PagedKVCache, "allocate", allocate)
    S, M, prompt = 4, 7, list(range(3, 3 + prompt_len))
    computed, blocks = {}, {}
    for n in (1, 4):
        allocated.clear()
        engine = Engine(small, num_blocks=60, block_size=S, token_budget=64, share_prefixes=False)
        results, log = engine.run([Request("r", prompt, M, sampling=dict(temperature=1.0), seed=3, n=n)])
        computed[n], blocks[n] = (sum(log.prefill), sum(log.computed)), len(allocated)
        assert all(res.error is None and len(res.tokens) == M for res in results.values())
        assert_all_blocks_back(engine.cache)
    assert computed[4][0] == computed[1][0] == prompt_len  # the prompt's tokens, computed once for n = 4
    assert computed[4][1] == prompt_len + 4 * (M - 1)  # then each sequence's own tokens (its last is never computed)
    cached = prompt_len + M - 1  # tokens one sequence caches
    full = prompt_len // S  # the prompt's full blocks: shared; every other block: one per sequence
    assert blocks[1] == math.ceil(cached / S)
    assert blocks[4] == full + 4 * (math.ceil(cached / S) - full)


def test_no_sequence_writes_into_a_block_another_holds(small, monkeypatch):
    """Every slot written in a step belongs to a block that the writing sequence alone holds (copy on write)."""
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=16, share_prefixes=False)
    writes = []
    original = serving.engine.paged_forward

    def spy(model, cache, chunks, **kwargs):
        for table, start, tokens in chunks:
            for p in range(start, start + len(tokens)):
                writes.append(cache.refs[table[p // cache.block_size]])
        return original(model, cache, chunks, **kwargs)

    monkeypatch.setattr(serving.engine, "paged_forward", spy)
    results, _ = engine.run([Request("r", list(range(1, 11)), 6, sampling=dict(temperature=1.0), n=3)])
    assert writes and set(writes) == {1}
    assert all(res.error is None for res in results.values())


def test_aborting_one_sequence_or_the_whole_request_gives_every_block_back(small):
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=16)
    engine.add_request(Request("a", list(range(1, 11)), 8, sampling=dict(temperature=1.0), n=3))
    engine.add_request(Request("b", list(range(20, 26)), 8, sampling=dict(temperature=1.0), n=3))
    assert engine.abort("b/2")  # before the fork: it will not be made
    for _ in range(3):
        engine.step()
    assert engine.abort("a/1")  # after the fork: this one only
    while engine.waiting or engine.running:
        engine.step()
    assert engine.results["a/1"].error and engine.results["b/2"].error and not engine.results["b/2"].tokens
    for name in ("a", "a/2", "b", "b/1"):
        assert engine.results[name].error is None and len(engine.results[name].tokens) == 8
    assert_all_blocks_back(engine.cache)
    engine.add_request(Request("c", list(range(1, 11)), 8, n=3))
    assert engine.abort("c")  # the first name before the fork: all three
    assert all("aborted" in engine.results[name].error for name in ("c", "c/1", "c/2"))
    assert not engine.waiting and not engine.running
    assert_all_blocks_back(engine.cache)


@pytest.mark.parametrize("field,value,words", [
    ("n", 0, "n must be an integer >= 1"), ("n", 2.0, "n must be an integer >= 1"),
    ("n", 6, "num_blocks = 12 is too small"), ("logprobs", -1, "logprobs must be None or an integer in [0, "),
    ("logprobs", 62, "vocab_size = 61]")])
def test_bad_n_or_logprobs_rejects_that_request_only_naming_the_field(small, field, value, words):
    bad = Request("bad", list(range(1, 9)), 8, **{field: value})
    good = Request("good", list(range(1, 9)), 8)
    results, _ = Engine(small, num_blocks=12, block_size=4).run([bad, good])
    assert words in results["bad"].error and results["bad"].error.startswith("request bad:")
    assert results["good"].error is None and len(results["good"].tokens) == 8


def test_n_counts_against_max_num_seqs(small):
    requests = [Request("a", [1, 2, 3], 5, n=3, sampling=dict(temperature=1.0)), Request("b", [4, 5], 5),
                Request("c", [6], 4, n=4)]
    engine = Engine(small, num_blocks=40, block_size=4, max_num_seqs=3)
    results, log = engine.run(requests)
    assert max(sum(state != "waiting" for state in states.values()) for states in log.states) <= 3
    assert "max_num_seqs = 3" in results["c"].error and results["c/3"].error
    assert all(results[name].error is None for name in ("a", "a/1", "a/2", "b"))


def test_a_request_with_n_prefilling_over_several_steps_keeps_room_for_its_forks_under_max_num_seqs(small):
    """"a" (n = 3) computes its 10-token prompt in chunks of 4, 4 and 2 (budget 4); "b" arrives meanwhile. Counted
    by hand: "a" and its forks fill max_num_seqs = 3, so "b" waits until they leave; the running sequences never
    exceed 3 (the cap counted a running "a" as 1 and admitted "b" beside its last chunk, with the budget's 2 tokens
    left: the fork then made 4 run at once)."""
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=4, max_num_seqs=3)
    engine.add_request(Request("a", list(range(1, 11)), 3, n=3, sampling=dict(temperature=1.0)))
    most = 0
    while engine.waiting or engine.running:
        if engine.clock == 1:
            engine.add_request(Request("b", [20, 21], 3))
        engine.step()
        most = max(most, len(engine.running))
    assert most <= 3
    assert all(engine.results[name].error is None for name in ("a", "a/1", "a/2", "b"))
    assert engine.results["b"].first_token_step > engine.results["a"].finish_step


def logprobs_oracle(model64, prompt, tokens, sampling, k):
    """Per emitted token: (its log-probability, the top k), from the float64 model over the whole sequence alone,
    the processors applied in float64 (greedy: the penalties only), log_softmax."""
    idx = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model64(idx)[0][0].double()  # (T, V): the logits at every position
    settings = dict(sampling or {})
    if settings.get("temperature", 1.0) < 1e-5:  # greedy: an argmax, no draw; vLLM too drops the filters then
        settings = {key: value for key, value in settings.items() if key.endswith("penalty")}
    out = []
    for j, token in enumerate(tokens):
        t = len(prompt) + j
        scores = process_logits(logits[t - 1][None], idx[:, :t], idx[:, len(prompt):t], **settings)[0]
        logprobs = torch.log_softmax(scores, -1)
        top = torch.topk(logprobs, k)
        out.append((float(logprobs[token]), top.indices.tolist(), top.values.tolist()))
    return out


@pytest.mark.parametrize("sampling", [None, dict(temperature=0.0, frequency_penalty=1.0), *SETTINGS,
                                      dict(temperature=0.0, top_k=2, frequency_penalty=1.0),
                                      dict(temperature=1e-7, top_p=0.3, min_p=0.5)])
def test_logprobs_are_those_of_the_distribution_the_token_was_drawn_from(small, sampling):
    model64 = copy.deepcopy(small).double()
    requests = [Request(f"r{i}", list(range(3 + i, 12 + 2 * i)), 7, sampling=sampling, seed=40 + i, n=1 + (i == 1),
                        logprobs=k) for i, k in enumerate((0, 3, 5))]
    results, _ = Engine(small, num_blocks=40, block_size=4, token_budget=8).run(requests)
    checked = 0
    for r in requests:
        for name in names(r):
            res = results[name]
            assert res.error is None and len(res.logprobs) == len(res.tokens) == 7
            for (lp, top), token, (lp64, ids64, top64) in zip(res.logprobs, res.tokens,
                                                             logprobs_oracle(model64, r.prompt, res.tokens,
                                                                             sampling, r.logprobs)):
                assert math.isfinite(lp) and lp == pytest.approx(lp64, abs=1e-4)  # a drawn token is never filtered
                assert len(top) == r.logprobs
                finite = [i for i, v in enumerate(top64) if math.isfinite(v)]
                assert [top[i][0] for i in finite] == [ids64[i] for i in finite]
                for (_, value), value64 in zip(top, top64):
                    assert value == pytest.approx(value64, abs=1e-4) if math.isfinite(value64) else value == -math.inf
                checked += 1
    assert checked == 7 * 4
    if sampling is not None and "top_k" in sampling:  # the filter shows: the 6th most likely is -inf, as drawn
        assert all(top[-1][1] > -math.inf for lp, top in results["r2"].logprobs)
        assert all(lp > -math.inf for lp, _ in results["r2"].logprobs)


def test_logprobs_are_not_the_raw_model_s_when_a_processor_changes_them(small):
    """The reported distribution is the processed one: at temperature 0.5 the chosen token's log-probability is
    that of softmax(logits / 0.5), not of softmax(logits) (vLLM's default, raw, would give the latter)."""
    model64 = copy.deepcopy(small).double()
    r = Request("t", [1, 2, 3, 4, 5], 4, sampling=dict(temperature=0.5), seed=9, logprobs=2)
    res = Engine(small, num_blocks=20, block_size=4).run([r])[0]["t"]
    raw = logprobs_oracle(model64, r.prompt, res.tokens, None, 2)
    processed = logprobs_oracle(model64, r.prompt, res.tokens, r.sampling, 2)
    for (lp, _), (lp_raw, _, _), (lp_processed, _, _) in zip(res.logprobs, raw, processed):
        assert lp == pytest.approx(lp_processed, abs=1e-4) and abs(lp - lp_raw) > 1e-3


def test_a_huge_n_is_rejected_without_making_its_sequences_and_static_batching_rejects_n_and_logprobs(small):
    huge = Request("huge", [1, 2, 3], 4, n=10 ** 12)  # a list of its names would not fit in memory
    results, _ = Engine(small, num_blocks=12, block_size=4).run([huge])
    assert list(results) == ["huge"] and "num_blocks = 12 is too small" in results["huge"].error
    engine = Engine(small, num_blocks=12, block_size=4)
    assert engine.add_request(huge).error and list(engine.results) == ["huge"]
    requests = [Request("n", [1, 2], 3, n=2), Request("lp", [1, 2], 3, logprobs=1), Request("ok", [1, 2], 3)]
    results, _ = serving.static_batching(small, requests, 2)
    assert "serves n = 1 without logprobs" in results["n"].error and "serves n = 1" in results["lp"].error
    assert list(results) == ["n", "lp", "ok"] and results["ok"].error is None


def test_the_slots_used_count_a_shared_partly_filled_block_once(small):
    """The step log's KV bytes used: every block any running sequence holds, counted once with the slots filled in
    it (brute force over the block tables after each step), while forked sequences share a partly filled block."""
    engine = Engine(small, num_blocks=40, block_size=4, token_budget=16, share_prefixes=False)
    engine.add_request(Request("a", list(range(1, 11)), 6, sampling=dict(temperature=1.0), n=3))
    engine.add_request(Request("b", list(range(20, 27)), 6))
    shared_tail_seen = False
    while engine.waiting or engine.running:
        engine.step()
        filled = {}
        for seq in engine.running:
            for j, block in enumerate(seq.blocks):
                filled[block] = max(filled.get(block, 0), min(4, seq.n_cached - 4 * j))
        tails = [seq.blocks[-1] for seq in engine.running if seq.n_cached % 4]
        shared_tail_seen |= len(tails) > len(set(tails))
        assert engine.log.used[-1] == sum(filled.values()) * engine.cache.block_bytes // 4
    assert shared_tail_seen
