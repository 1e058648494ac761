"""course_lib.serving against independent oracles.

* Greedy tokens: every request's tokens equal generating it alone with chapter 05's ``generate_cached`` (exact),
  for any arrival order, token budget, block size and pool size that holds one request, with shared prefixes
  (the prefix cache, its evictions included) and with preemption. Exact equality of tokens is a claim about rounding: the engine
  runs a request's rows through matrix products of other shapes than ``generate_cached`` does, so its
  logits differ from the alone run by float32 rounding (checked at 1e-5 here too); the argmax is the same
  whenever no two logits are that close, which holds on every model and trace below (the tests would show it
  otherwise), as it does for chapter 05's batched generation (tests/lib/test_kv_cache.py).
* Sampled tokens: an uncached loop (the full forward pass of the model at every step, chapter 06's
  ``process_logits``, one ``torch.multinomial`` draw per token from a generator seeded per request).
* Paged attention: F.scaled_dot_product_attention in float64 over each sequence's keys laid out contiguously.
* The scheduler: its documented policy, on hand-made sequences.
* The prefix cache: what must hit, from a brute-force set of every block-aligned prefix computed before (requests
  one after another, a pool that never evicts); which blocks least-recently-used eviction must have reused, argued
  block by block on a pool that holds two requests.
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from course_lib import assets
from course_lib.decoding import process_logits
from course_lib.gpt import GPT, GPTConfig
from course_lib.kv_cache import generate_cached
from course_lib.serving import (Engine, PagedKVCache, Request, block_hashes, make_trace, paged_attention, paged_forward,
                                schedule_step, slot_mapping, static_batching)
from tests.helpers import assert_parity

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()


def alone(model, request) -> list:
    out = generate_cached(model, torch.tensor([request.prompt]), request.max_new_tokens)
    return out[0, len(request.prompt):].tolist()


def trace(n, seed, vocab=61, context=48, prefix=None, gap=0.7):
    return make_trace(n, seed, context=context, vocab=list(range(vocab)), prompt_range=(1, 14), output_median=6,
                      mean_gap=gap, prefix=prefix)


# ---------------------------------------------------------------------------------------------------- slots


def test_slot_mapping_follows_the_block_table():
    table = torch.tensor([7, 2, 9, 0])
    for S in (1, 3, 4):
        positions = torch.arange(min(4 * S, 11))
        expected = [table[p // S].item() * S + p % S for p in positions.tolist()]  # the definition, one by one
        assert slot_mapping(table, positions, S).tolist() == expected


# ---------------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("S", [1, 3, 4])
def test_paged_attention_equals_contiguous_attention_in_float64(S):
    g = torch.Generator().manual_seed(S)
    N, H, Dh = 40, 3, 8
    key_pool, value_pool = torch.randn(N, S, H, Dh, generator=g), torch.randn(N, S, H, Dh, generator=g)
    lengths = [1, S, 2 * S + 1, 5 * S - 1, 7]  # partly filled last blocks, one-token and one-block sequences
    M = max(math.ceil(n / S) for n in lengths)
    order = torch.randperm(N, generator=g)  # each sequence's blocks: scattered over the pool
    tables = torch.zeros(len(lengths), M, dtype=torch.long)
    used = 0
    for b, n in enumerate(lengths):
        k = math.ceil(n / S)
        tables[b, :k] = order[used:used + k]
        tables[b, k:] = order[-1]  # padding entries: a valid block holding other numbers
        used += k
    q = torch.randn(len(lengths), H, Dh, generator=g)
    got = paged_attention(q, key_pool, value_pool, tables, torch.tensor(lengths))
    for b, n in enumerate(lengths):
        keys = key_pool[tables[b]].reshape(-1, H, Dh)[:n].transpose(0, 1).double()  # (H, n, Dh), contiguous
        values = value_pool[tables[b]].reshape(-1, H, Dh)[:n].transpose(0, 1).double()
        expected = F.scaled_dot_product_attention(q[b, :, None].double(), keys, values)[:, 0]
        assert_parity(got[b], expected)


def test_paged_forward_logits_equal_the_full_forward_pass(small):
    cache = PagedKVCache.for_model(small, 20, 4)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    tables = [torch.tensor([5, 0, 17]), torch.tensor([3, 9, 12])]
    paged_forward(small, cache, [(tables[0], 0, ids[0, :6]), (tables[1], 0, ids[1, :10])])  # two prefills
    logits = paged_forward(small, cache, [(tables[0], 6, ids[0, 6:11]), (tables[1], 10, ids[1, 10:11])])  # chunk, decode
    with torch.no_grad():
        full = small(ids)[0]
    assert_parity(logits[0], full[0, 10])
    assert_parity(logits[1], full[1, 10])
    # block tables and tokens as lists of ints (the engine's), all or some of them: the same pass
    for listed in ({0, 1, 2, 3}, {1, 2}):  # which of (table 0, tokens 0, table 1, tokens 1) are lists
        parts = [tables[0], ids[0, 6:11], tables[1], ids[1, 10:11]]
        parts = [part.tolist() if i in listed else part for i, part in enumerate(parts)]
        assert torch.equal(paged_forward(small, cache, [(parts[0], 6, parts[1]), (parts[2], 10, parts[3])]), logits)


# ---------------------------------------------------------------------------------------------------- one batched pass


def scattered_tables(lengths: list, S: int, N: int, seed: int) -> list:
    """Block tables for sequences of `lengths` tokens, each block anywhere in a pool of N blocks (no block twice)."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lengths:
        k = math.ceil(n / S)
        tables.append(torch.tensor(order[used:used + k]))
        used += k
    return tables


@pytest.mark.parametrize("S", [1, 3, 4])
def test_one_pass_mixing_decodes_of_different_lengths_and_prefill_chunks_equals_the_full_forward_pass(small, S):
    # Six sequences in one pass, in an order that interleaves them: decodes whose contexts (1 to 40 tokens) and block
    # tables (1 to 40 / S blocks) differ, so the shorter tables are padded; prefill chunks of different lengths, one
    # from position 0, others after a cached part, one ending inside a block: their batch is padded too. Each
    # sequence's cache is first filled by its own earlier passes. Oracle: the model's ordinary forward pass.
    ids = torch.randint(0, 61, (6, 40), generator=torch.Generator().manual_seed(S))
    cached = [0, 7, 39, 12, 2 * S + 1, 5]  # tokens in the cache before the pass
    new = [1, 1, 1, 9, 3, 2 * S + 3]  # tokens in the pass: three decodes (one with an empty cache), three chunks
    cache = PagedKVCache.for_model(small, 40 * 6, S)
    tables = scattered_tables([c + n for c, n in zip(cached, new)], S, 40 * 6, S)
    for i, c in enumerate(cached):
        if c:
            paged_forward(small, cache, [(tables[i], 0, ids[i, :c])])
    order = [3, 0, 4, 2, 5, 1]
    logits = paged_forward(small, cache, [(tables[i], cached[i], ids[i, cached[i]:cached[i] + new[i]]) for i in order])
    with torch.no_grad():
        full = small(ids)[0]
    for row, i in enumerate(order):
        assert_parity(logits[row], full[i, cached[i] + new[i] - 1])


def test_a_pass_calls_paged_attention_once_per_layer_for_all_decodes_and_slot_mapping_twice(small):
    # The learner's functions plug in: paged_attention gets every decode of the pass at once, block tables padded into
    # one (B, M) tensor, context lengths per row; slot_mapping is called once for the new tokens and once for the
    # prefill keys.
    S = 4
    cached, new = [9, 30, 3, 14], [1, 1, 6, 1]
    ids = torch.randint(0, 61, (4, 40), generator=torch.Generator().manual_seed(3))
    cache = PagedKVCache.for_model(small, 60, S)
    tables = scattered_tables([c + n for c, n in zip(cached, new)], S, 60, 3)
    for i, c in enumerate(cached):
        paged_forward(small, cache, [(tables[i], 0, ids[i, :c])])
    calls = {"paged_attention": [], "slot_mapping": 0}

    def recording_attention(q, key_pool, value_pool, block_tables, context_lens):
        calls["paged_attention"].append((tuple(q.shape), tuple(block_tables.shape), context_lens.tolist()))
        return paged_attention(q, key_pool, value_pool, block_tables, context_lens)

    def counting_slots(block_table, positions, block_size):
        calls["slot_mapping"] += 1
        return slot_mapping(block_table, positions, block_size)

    chunks = [(tables[i], cached[i], ids[i, cached[i]:cached[i] + new[i]]) for i in range(4)]
    logits = paged_forward(small, cache, chunks, paged_attention=recording_attention, slot_mapping=counting_slots)
    H, Dh = small.config.n_head, small.config.n_embd // small.config.n_head
    widest = max(len(tables[i]) for i in (0, 1, 3))  # the decodes' longest block table
    assert calls["paged_attention"] == [((3, H, Dh), (3, widest), [10, 31, 15])] * small.config.n_layer
    assert calls["slot_mapping"] == 2
    with torch.no_grad():
        full = small(ids)[0]
    for i in range(4):
        assert_parity(logits[i], full[i, cached[i] + new[i] - 1])


def test_two_threads_give_the_same_tokens_as_one_and_the_thread_count_is_restored(small, monkeypatch):
    # A small pass runs on one thread whatever the caller's count (ONE_THREAD_WORK); with that threshold at 0
    # every pass runs on the caller's two threads. The tokens are the same either way, and equal the run alone.
    from course_lib import kernels
    requests = trace(4, 11, gap=0.4)
    seen = []

    def counting_threads(*args):
        seen.append(torch.get_num_threads())
        return paged_attention(*args)

    engine = Engine(small, num_blocks=80, block_size=4, token_budget=12)
    one, _ = engine.run(requests)
    torch.set_num_threads(2)
    try:
        small_passes, _ = engine.run(requests, paged_attention=counting_threads)
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setattr(kernels, "ONE_THREAD_WORK", 0)
        monkeypatch.setattr(kernels.THREAD_CHOICE, "pick", lambda model, rows, n, probe: kernels.ThreadProbe(rows, n, 1.0))
        two, _ = engine.run(requests, paged_attention=counting_threads)
        assert set(seen) == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    for r in requests:
        assert one[r.name].tokens == small_passes[r.name].tokens == two[r.name].tokens == alone(small, r), r.name


# ---------------------------------------------------------------------------------------------------- exactness


def test_processor_functions_plug_in_by_the_name_of_the_function_they_replace(small):
    # The plug-in rule: Engine.run(requests, top_k_filter=...) runs that function for every sampled request. A
    # top_k_filter that keeps one token makes sampling greedy: the oracle is greedy generate_cached.
    from course_lib.decoding import top_k_filter

    requests = trace(5, 23, gap=0.5)
    for i, r in enumerate(requests):
        r.sampling, r.seed = {"temperature": 1.5, "top_k": 20}, 40 + i
    calls = []

    def keep_one(logits, k):
        calls.append(k)
        return top_k_filter(logits, 1)

    engine = Engine(small, num_blocks=64, block_size=4, token_budget=12)
    sampled, _ = engine.run(requests)
    kept, _ = engine.run(requests, top_k_filter=keep_one)
    assert set(calls) == {20} and len(calls) == sum(r.max_new_tokens for r in requests)  # once per token, its top_k
    assert all(kept[r.name].tokens == alone(small, r) for r in requests)
    assert any(sampled[r.name].tokens != alone(small, r) for r in requests)  # without it, they sample


def test_a_temperature_near_0_is_greedy_and_penalties_apply_before_the_argmax(small):
    # vLLM's rule: a temperature below 1e-5 is greedy (1e-45 divides the logits into inf and NaN probabilities);
    # OpenAI's and vLLM's: the penalties apply at temperature 0 too, before the argmax. The oracles: greedy
    # generate_cached, and chapter 06's generate (greedy with the penalties, uncached).
    from course_lib.decoding import generate

    requests = trace(6, 21, gap=0.5)
    for i, r in enumerate(requests):
        r.sampling = {"temperature": [1e-45, 1e-7, 0.0][i % 3]}
    tiny, _ = Engine(small, num_blocks=64, block_size=4, token_budget=12).run(requests)
    assert all(tiny[r.name].error is None and tiny[r.name].tokens == alone(small, r) for r in requests)
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 1.0, "repetition_penalty": 1.5}
    for i, r in enumerate(requests):
        r.sampling = {"temperature": [1e-45, 0.0][i % 2], **penalties}
    penalised, _ = Engine(small, num_blocks=64, block_size=4, token_budget=12).run(requests)
    changed = 0
    for r in requests:
        want = generate(small, torch.tensor([r.prompt]), r.max_new_tokens, use_cache=False, **penalties)
        assert penalised[r.name].tokens == want[0, len(r.prompt):].tolist(), r.name
        changed += penalised[r.name].tokens != alone(small, r)
    assert changed >= 2  # the penalties changed these requests' tokens: the comparison can tell them apart


@pytest.mark.parametrize("block_size,budget,seed", [(1, 5, 0), (3, 1, 1), (4, 16, 2), (8, 64, 3), (16, 7, 4)])
def test_greedy_tokens_equal_generating_each_request_alone(small, block_size, budget, seed):
    requests = trace(10, seed)
    random.Random(seed).shuffle(requests)  # the order of the list must not matter either
    results, _ = Engine(small, num_blocks=200, block_size=block_size, token_budget=budget).run(requests)
    for r in requests:
        assert results[r.name].error is None and results[r.name].tokens == alone(small, r), r.name


def test_a_pool_that_holds_one_request_preempts_and_every_request_still_finishes_exactly(small):
    requests = trace(8, 5, gap=0.2)
    S = 4
    num_blocks = max(math.ceil((len(r.prompt) + r.max_new_tokens) / S) for r in requests)  # the largest request fits
    results, _ = Engine(small, num_blocks=num_blocks, block_size=S, token_budget=16).run(requests)
    assert sum(res.preemptions for res in results.values()) > 0
    for r in requests:
        assert results[r.name].tokens == alone(small, r), r.name


def test_shared_prefix_saves_blocks_and_stays_exact(small):
    prefix = list(range(20, 32))  # 12 tokens: 3 full blocks of 4
    requests = trace(8, 6, prefix=prefix, gap=0.3)
    same = [Request(f"same{i}", prefix[:8], 5, arrival=2) for i in range(3)]  # block-aligned identical prompts
    requests += same
    engine = Engine(small, num_blocks=120, block_size=4, token_budget=32)
    shared, trace_shared = engine.run(requests)
    engine.share_prefixes = False
    private, trace_private = engine.run(requests)
    for r in requests:
        assert shared[r.name].tokens == private[r.name].tokens == alone(small, r), r.name
    assert max(trace_shared.allocated) < max(trace_private.allocated)
    assert sum(trace_shared.allocated) < sum(trace_private.allocated)


def test_a_freed_block_stays_cached_until_the_least_recently_freed_is_evicted(small):
    cache = PagedKVCache.for_model(small, 4, 2)
    tokens = [5, 6, 7, 8, 9, 10]  # three full blocks of 2
    blocks = [cache.allocate() for _ in range(3)]
    for i, b in enumerate(blocks):
        cache.register(tuple(tokens[:2 * (i + 1)]), b)
    assert cache.lookup(tokens) == blocks and cache.lookup([5, 6, 7, 0, 9, 10]) == blocks[:1]
    cache.release_all(blocks)  # the last block first: the prefix's first block is freed last
    assert len(cache.free) == 4 and cache.lookup(tokens) == blocks  # free, still found
    cache.share(blocks[0])  # a hit on a free block takes it off the free list
    assert len(cache.free) == 3 and cache.refs[blocks[0]] == 1
    spare = cache.allocate()  # the never-used block is first on the free list: nothing evicted
    assert spare not in blocks and cache.evictions == 0 and cache.lookup(tokens) == blocks
    assert cache.allocate() == blocks[2] and cache.evictions == 1  # then the least recently freed: the prefix's end
    assert cache.lookup(tokens) == blocks[:2]
    cache.release(blocks[0])
    assert cache.allocate() == blocks[1] and cache.lookup(tokens) == [blocks[0]]  # blocks[0] was freed after blocks[1]


def test_block_hashes_chain_the_prefix():
    a, b = block_hashes([1, 2, 3, 4, 5], 2), block_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2 and len(b) == 2 and a[0] != b[0] and a[1] != b[1]  # the same tokens 3, 4 after another prefix
    assert block_hashes([1, 2, 3, 4, 7], 2) == a and block_hashes([1], 2) == []


def computed_tokens(request, tokens):
    """What a request's run puts in the cache: its prompt and every generated token but the last (never fed back)."""
    return list(request.prompt) + tokens[:-1]


def test_the_prefix_cache_hits_every_block_aligned_prefix_computed_before(small):
    # Requests one after another (each arrives after the previous finished) in a pool that never evicts: a
    # request must find exactly the longest run of full blocks of its tokens but the last that an earlier
    # request computed (the oracle: a set of every block-aligned prefix computed so far).
    S = 4
    system = list(range(30, 42))  # 12 tokens: 3 full blocks
    base = trace(6, 21, prefix=system)
    requests = [Request(r.name, r.prompt, min(r.max_new_tokens, 10), arrival=60 * i) for i, r in enumerate(base)]
    first = alone(small, requests[0])
    follow_up = computed_tokens(requests[0], first) + [first[-1], 7, 8]  # a second turn: the whole first exchange
    requests += [Request("again", requests[1].prompt, 4, arrival=60 * 6),  # a prompt seen before, whole
                 Request("turn2", follow_up, 5, arrival=60 * 7),
                 Request("aligned", system[:8], 3, arrival=60 * 8), Request("aligned2", system[:8], 3, arrival=60 * 9)]
    results, run = Engine(small, num_blocks=400, block_size=S, token_budget=16).run(requests)
    seen, hits = set(), {}
    for r in requests:
        tokens = list(r.prompt)
        k = 0
        while (k + 1) * S <= len(tokens) - 1 and tuple(tokens[:(k + 1) * S]) in seen:
            k += 1
        hits[r.name] = k * S
        done = computed_tokens(r, alone(small, r))
        seen.update(tuple(done[:j * S]) for j in range(1, len(done) // S + 1))
    assert {n: res.admissions for n, res in results.items()} == {r.name: [(len(r.prompt), hits[r.name])] for r in requests}
    assert hits["turn2"] > len(requests[0].prompt)  # it found blocks of generated tokens too
    assert hits["aligned2"] == 4  # the whole prompt is cached: its last block is computed again, fresh
    assert run.evictions == 0 and sum(run.computed) == sum(len(r.prompt) - hits[r.name] + r.max_new_tokens - 1
                                                           for r in requests)
    for r in requests:
        assert results[r.name].tokens == alone(small, r), r.name


def test_least_recently_freed_blocks_are_evicted_first(small):
    # Block size 4; each request: a 9-token prompt and 3 new tokens, 11 tokens computed: 3 blocks, 2 of them
    # full (cached). A pool of 6 holds two requests. A, then B, then C (a new prompt): C's 3 fresh blocks come
    # from the front of the free list, the never-used blocks first, then the least recently freed, A's.
    # So D (B's prompt) finds B's 2 blocks, and E (A's prompt) finds nothing.
    prompts = {n: [i * 10 + k for k in range(9)] for i, n in enumerate("ABC")}
    prompts.update(D=prompts["B"], E=prompts["A"])
    requests = [Request(n, p, 3, arrival=30 * i) for i, (n, p) in enumerate(prompts.items())]
    results, run = Engine(small, num_blocks=6, block_size=4, token_budget=16).run(requests)
    assert [results[n].admissions[0][1] for n in "ABCDE"] == [0, 0, 0, 8, 0]
    assert run.evictions == 2 + 2  # C evicts A's 2 cached blocks; E evicts 2 more (its own 3 blocks: 1 never cached)
    roomy, roomy_run = Engine(small, num_blocks=9, block_size=4, token_budget=16).run(requests)  # room for three
    assert [roomy[n].admissions[0][1] for n in "ABCDE"] == [0, 0, 0, 8, 8] and roomy_run.evictions < run.evictions
    for r in requests:
        assert results[r.name].tokens == roomy[r.name].tokens == alone(small, r), r.name


def test_a_preempted_request_finds_its_own_blocks_on_resume(small):
    S = 4
    requests = trace(10, 8, gap=0.3)
    fits = max(math.ceil((len(r.prompt) + r.max_new_tokens) / S) for r in requests)
    cached, cached_run = Engine(small, num_blocks=fits + 2, block_size=S, token_budget=16).run(requests)
    plain, plain_run = Engine(small, num_blocks=fits + 2, block_size=S, token_budget=16,
                              share_prefixes=False).run(requests)
    resumes = [a for res in cached.values() for a in res.admissions[1:]]
    assert sum(res.preemptions for res in cached.values()) == len(resumes) > 0
    assert all(c % S == 0 and c <= n - 1 for n, c in resumes)  # full blocks, within the tokens but the last
    assert sum(c for _, c in resumes) > 0 and sum(cached_run.computed) < sum(plain_run.computed)
    assert all(c == 0 for res in plain.values() for _, c in res.admissions)
    for r in requests:
        assert cached[r.name].tokens == plain[r.name].tokens == alone(small, r), r.name


def test_every_block_goes_back_to_the_free_list(small):
    requests = trace(10, 7, prefix=[1, 2, 3, 4, 5])
    engine = Engine(small, num_blocks=30, block_size=2, token_budget=9)
    results, run = engine.run(requests)
    assert all(u <= a for u, a in zip(run.used, run.allocated))
    assert run.allocated[-1] == 0


def test_the_shipped_checkpoint_serves_a_trace_exactly():
    model = assets.load("char-gpt")
    requests = make_trace(12, 0, vocab=list(range(model.config.vocab_size)), mean_gap=0.5)
    results, _ = Engine(model, num_blocks=64, block_size=8, token_budget=48).run(requests)
    for r in requests:
        assert results[r.name].tokens == alone(model, r), r.name
    static, _ = static_batching(model, requests, 4)
    for r in requests:
        assert static[r.name].tokens == results[r.name].tokens, r.name


# ---------------------------------------------------------------------------------------------------- sampling


def sampled_alone(model, request) -> list:
    """The oracle: no cache, the full forward pass at every step, a generator seeded per request."""
    g = torch.Generator().manual_seed(request.seed)
    idx = torch.tensor([request.prompt])
    for _ in range(request.max_new_tokens):
        with torch.no_grad():
            logits = model(idx)[0][:, -1]
        scores = process_logits(logits, idx, idx[:, len(request.prompt):], **request.sampling)
        idx = torch.cat([idx, torch.multinomial(torch.softmax(scores, -1), 1, generator=g)], dim=1)
    return idx[0, len(request.prompt):].tolist()


def test_sampled_requests_give_the_same_tokens_alone_and_in_any_batch(small):
    requests = trace(9, 8, gap=0.4)
    settings = [dict(temperature=0.8), dict(top_k=5), dict(top_p=0.9, temperature=1.3), dict(repetition_penalty=1.3)]
    for i, r in enumerate(requests):
        r.sampling, r.seed = settings[i % len(settings)], 100 + i
    batched, _ = Engine(small, num_blocks=60, block_size=4, token_budget=12).run(requests)
    fits = max(math.ceil((len(r.prompt) + r.max_new_tokens) / 4) for r in requests)
    tight, run = Engine(small, num_blocks=fits, block_size=4, token_budget=3).run(requests)  # preemption, other batches
    static, _ = static_batching(small, requests, 3)
    for r in requests:
        expected = sampled_alone(small, r)
        assert batched[r.name].tokens == tight[r.name].tokens == static[r.name].tokens == expected, r.name
    assert sum(tight[r.name].preemptions for r in requests) > 0


# ---------------------------------------------------------------------------------------------------- bad input


def test_bad_requests_get_an_error_naming_the_argument_and_the_others_finish(small):
    good = trace(4, 9)
    bad = [Request("empty", [], 3), Request("long", [1] * 40, 9), Request("none", [1, 2], 0)]
    results, _ = Engine(small, num_blocks=40, block_size=4).run(good + bad)
    assert "prompt must hold at least 1 token" in results["empty"].error
    assert "context = 48" in results["long"].error and "prompt length + max_new_tokens" in results["long"].error
    assert "max_new_tokens must be an integer >= 1" in results["none"].error
    for r in good:
        assert results[r.name].error is None and results[r.name].tokens == alone(small, r)
    static, _ = static_batching(small, good + bad, 4)
    assert static["long"].error == results["long"].error and static[good[0].name].tokens == alone(small, good[0])


def test_a_pool_too_small_for_a_request_rejects_that_request_only(small):
    requests = [Request("short", [1, 2], 2), Request("big", [3] * 20, 10)]
    results, _ = Engine(small, num_blocks=4, block_size=4).run(requests)
    assert "num_blocks = 4 is too small" in results["big"].error
    assert results["short"].tokens == alone(small, requests[0])


@pytest.mark.parametrize("argument,kwargs", [("block_size", dict(block_size=0)), ("num_blocks", dict(num_blocks=0)),
                                             ("token_budget", dict(token_budget=0))])
def test_engine_arguments_below_one_raise(small, argument, kwargs):
    with pytest.raises(ValueError, match=f"{argument} must be an integer >= 1"):
        Engine(small, **{"num_blocks": 10, **kwargs})


# ---------------------------------------------------------------------------------------------------- scheduler


def seq(name, n_tokens, n_cached, held, S=4, freed=None):
    """A hand-made sequence: blocks_needed by the plain formula, blocks_freed = held unless given."""
    return SimpleNamespace(name=name, n_tokens=n_tokens, n_cached=n_cached,
                           blocks_needed=lambda n: max(0, math.ceil((n_cached + n) / S) - held),
                           blocks_freed=lambda: held if freed is None else freed)


def names(scheduled):
    return [(s.name, n) for s, n in scheduled]


def test_scheduler_runs_decodes_then_admits_waiting_requests_in_order_under_the_budget():
    running = [seq("a", 9, 8, 2), seq("b", 5, 4, 1)]  # a: decode, no new block; b: decode, needs a block (5 > 4)
    waiting = [seq("c", 10, 0, 0), seq("d", 3, 0, 0)]
    scheduled, preempted = schedule_step(running, waiting, num_free_blocks=10, token_budget=8)
    assert names(scheduled) == [("a", 1), ("b", 1), ("c", 6)] and preempted == []  # c: a chunk of 6; d: no budget left
    scheduled, _ = schedule_step(running, waiting, num_free_blocks=10, token_budget=20)
    assert names(scheduled) == [("a", 1), ("b", 1), ("c", 10), ("d", 3)]
    scheduled, _ = schedule_step(running, waiting, num_free_blocks=3, token_budget=20)  # c needs 3 blocks: only 2 left
    assert names(scheduled) == [("a", 1), ("b", 1)]  # and d may not overtake c


def test_scheduler_preempts_the_most_recent_running_sequence_and_admits_nobody():
    running = [seq("a", 9, 8, 2), seq("b", 5, 4, 1), seq("c", 13, 12, 3)]  # b and c each need a new block
    waiting = [seq("w", 2, 0, 0)]
    scheduled, preempted = schedule_step(running, waiting, num_free_blocks=0, token_budget=50)
    assert [s.name for s in preempted] == ["c"] and names(scheduled) == [("a", 1), ("b", 1)]
    scheduled, preempted = schedule_step([seq("a", 9, 8, 2), seq("b", 5, 4, 1)], waiting, 0, 50)
    assert [s.name for s in preempted] == ["b"] and names(scheduled) == [("a", 1)]  # b preempts itself
    assert schedule_step(running, [], 5, 2)[0][-1][0].name == "b"  # the budget runs out before c


def test_scheduler_changes_neither_list():
    running, waiting = [seq("a", 5, 4, 1)], [seq("b", 3, 0, 0)]
    schedule_step(running, waiting, 0, 10)
    assert [s.name for s in running] == ["a"] and [s.name for s in waiting] == ["b"]


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_no_write_lands_in_a_shared_block_when_a_whole_prompt_is_shared(small, block_size, monkeypatch):
    # Two identical prompts, the second arriving once the first has cached its prompt: the second shares every
    # prompt block but the last, which it computes again into a fresh block (as vLLM does), whatever
    # block_size (with block_size 1 the block to write is a full one, not a partly filled last block).
    import course_lib.serving.engine as serving_engine
    written = []

    def spy(model, cache, chunks, **kwargs):
        for table, start, tokens in chunks:  # the blocks this step writes, and their reference counts
            for p in range(start, start + len(tokens)):
                block = int(table[p // cache.block_size])
                written.append((block, cache.refs[block]))
        return paged_forward(model, cache, chunks, **kwargs)

    monkeypatch.setattr(serving_engine, "paged_forward", spy)
    prompt = [3, 14, 15, 9, 26, 5, 35, 8]
    requests = [Request("first", prompt, 6, arrival=0), Request("second", prompt, 6, arrival=3)]
    results, _ = Engine(small, num_blocks=40, block_size=block_size, token_budget=16).run(requests)
    assert written and all(refs == 1 for _, refs in written), [w for w in written if w[1] != 1]
    for r in requests:
        assert results[r.name].tokens == alone(small, r), r.name


# ---------------------------------------------------------------------------------------------------- a cap on running sequences


def counting(limit_seen: list):
    """schedule_step, recording how many sequences run after each step (running - preempted + admitted)."""
    def counting_step(running, waiting, num_free_blocks, token_budget):
        scheduled, preempted = schedule_step(running, waiting, num_free_blocks, token_budget)
        admitted = sum(1 for s, _ in scheduled if s in waiting)
        limit_seen.append(len(running) - len(preempted) + admitted)
        return scheduled, preempted
    return counting_step


@pytest.mark.parametrize("cap,num_blocks", [(1, 200), (2, 200), (3, 200), (2, None)])
def test_max_num_seqs_caps_the_running_sequences_and_the_tokens_stay_exact(small, cap, num_blocks):
    requests = trace(9, 11, gap=0.3)
    S = 4
    if num_blocks is None:  # a pool for the largest request only: preemption under the cap too
        num_blocks = max(math.ceil((len(r.prompt) + r.max_new_tokens) / S) for r in requests)
    seen = []
    results, run = Engine(small, num_blocks=num_blocks, block_size=S, token_budget=10, max_num_seqs=cap).run(
        requests, schedule_step=counting(seen))
    assert seen and max(seen) <= cap and max(run.batch) <= cap
    assert max(seen) == cap  # the cap binds on this trace (9 requests, 0.3 steps apart)
    for r in requests:
        assert results[r.name].error is None and results[r.name].tokens == alone(small, r), r.name
    if cap == 1:  # one at a time, first come first served: each starts after the one before has finished
        order = sorted(requests, key=lambda r: r.arrival)
        for before, after in zip(order, order[1:]):
            assert results[after.name].first_token_step > results[before.name].finish_step, (before.name, after.name)


def test_max_num_seqs_at_least_the_requests_is_the_uncapped_engine(small):
    requests = trace(8, 12, gap=0.2)
    fits = max(math.ceil((len(r.prompt) + r.max_new_tokens) / 4) for r in requests)
    uncapped = Engine(small, num_blocks=fits, block_size=4, token_budget=9)  # the largest request only: preemption
    free, free_run = uncapped.run(requests)
    assert sum(r.preemptions for r in free.values()) > 0
    for cap in (len(requests), len(requests) + 5):
        capped, capped_run = Engine(small, num_blocks=fits, block_size=4, token_budget=9, max_num_seqs=cap).run(requests)
        assert capped_run.states == free_run.states and capped_run.allocated == free_run.allocated
        assert capped_run.computed == free_run.computed and capped_run.steps == free_run.steps
        for r in requests:
            a, b = capped[r.name], free[r.name]
            assert (a.tokens, a.first_token_step, a.finish_step, a.preemptions) == (
                b.tokens, b.first_token_step, b.finish_step, b.preemptions), r.name


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3"])
def test_max_num_seqs_must_be_none_or_a_positive_integer(small, value):
    with pytest.raises(ValueError, match="max_num_seqs must be None .* or an integer >= 1"):
        Engine(small, num_blocks=10, max_num_seqs=value)


def test_the_trace_counts_the_tokens_computed(small):
    requests = trace(8, 13, gap=0.5)
    needed = sum(len(r.prompt) + r.max_new_tokens - 1 for r in requests)  # every token but the last, once
    results, run = Engine(small, num_blocks=200, block_size=4, token_budget=10, share_prefixes=False).run(requests)
    assert sum(run.computed) == needed and sum(run.prefill) == sum(len(r.prompt) for r in requests)
    assert all(p <= c <= 10 for p, c in zip(run.prefill, run.computed)) and len(run.step_seconds) == run.steps
    S = 4
    fits = max(math.ceil((len(r.prompt) + r.max_new_tokens) / S) for r in requests)
    tight, tight_run = Engine(small, num_blocks=fits, block_size=S, token_budget=10, share_prefixes=False).run(requests)
    assert sum(r.preemptions for r in tight.values()) > 0 and sum(tight_run.computed) > needed  # recomputed tokens
    prefix = list(range(20, 32))
    shared_reqs = trace(6, 14, prefix=prefix, gap=0.5)
    _, shared = Engine(small, num_blocks=200, block_size=4, token_budget=10).run(shared_reqs)
    assert sum(shared.computed) < sum(len(r.prompt) + r.max_new_tokens - 1 for r in shared_reqs)


# ---------------------------------------------------------------------------------------------------- static batching's reservation


def test_static_batching_reserving_the_context_holds_context_slots_per_row(small):
    per_token = 2 * small.config.n_layer * small.config.n_embd * 4  # keys and values, every layer, float32
    requests = [Request(f"q{i}", [1 + i] * (3 + i), 4 + 2 * i) for i in range(5)]  # all at step 0: batches of 3 and 2
    oracle, oracle_run = static_batching(small, requests, 3)
    context, context_run = static_batching(small, requests, 3, reserve="context")
    for r in requests:
        assert context[r.name].tokens == oracle[r.name].tokens == alone(small, r), r.name
    assert context_run.used == oracle_run.used and context_run.steps == oracle_run.steps
    first, second = requests[:3], requests[3:]
    rows = lambda batch: max(len(r.prompt) for r in batch) + max(r.max_new_tokens for r in batch)
    assert oracle_run.allocated == ([3 * rows(first) * per_token] * max(r.max_new_tokens for r in first)
                                    + [2 * rows(second) * per_token] * max(r.max_new_tokens for r in second))
    assert context_run.allocated == ([3 * 48 * per_token] * max(r.max_new_tokens for r in first)
                                     + [2 * 48 * per_token] * max(r.max_new_tokens for r in second))
    steps = lambda batch: max(r.max_new_tokens for r in batch)
    width = lambda batch: max(len(r.prompt) for r in batch)  # the padded prompt, every row computed
    assert oracle_run.computed == context_run.computed == (
        [3 * width(first)] + [3] * (steps(first) - 1) + [2 * width(second)] + [2] * (steps(second) - 1))
    assert oracle_run.prefill == [3 * width(first)] + [0] * (steps(first) - 1) + [2 * width(second)] + [0] * (steps(second) - 1)
    with pytest.raises(ValueError, match='reserve must be "oracle"'):
        static_batching(small, requests, 3, reserve="max")


# ---------------------------------------------------------------------------------------------------- load: what a run gave its users


def test_serving_stats_counts_steps_and_quantiles_by_hand():
    from course_lib.serving import Result, StepLog, serving_stats

    # three requests: arrive at 0, 0, 4; first tokens at 1, 3, 4; last at 3 (3 tokens), 3 (1 token), 8 (5 tokens)
    results = {"a": Result("a", tokens=[1, 2, 3], arrival_step=0, first_token_step=1, finish_step=3,
                           token_times=[0.1, 0.2, 0.3]),
               "b": Result("b", tokens=[4], arrival_step=0, first_token_step=3, finish_step=3, token_times=[0.5]),
               "c": Result("c", tokens=[5] * 5, arrival_step=4, first_token_step=4, finish_step=8,
                           arrival_time=0.4, token_times=[0.6, 0.7, 0.8, 0.9, 1.0]),
               "x": Result("x", error="rejected")}
    trace = StepLog(computed=[9, 2, 3, 7, 1, 1, 2, 2], clock=[0, 1, 2, 3, 5, 6, 7, 8], steps=9, seconds=2.0)  # step 4 idle
    stats = serving_stats(results, trace)
    assert stats["requests"] == 3 and stats["tokens"] == 9 and stats["tokens_per_step"] == 1.0 and stats["tokens_per_s"] == 4.5
    assert (stats["ttft_steps_p50"], stats["ttft_steps_p95"]) == (1, 3)  # 1, 3, 0: median 1, nearest-rank p95 3
    assert (stats["tpot_steps_p50"], stats["tpot_steps_p95"]) == (1.0, 1.0)  # a: 2 steps / 2; c: 4 / 4
    assert stats["tpot_steps_max"] == 1.0 and stats["most_running"] == 0  # this StepLog records no batch
    one = serving_stats({"a": results["a"]}, StepLog(computed=[9, 2, 3], clock=[1, 2, 3], batch=[3, 1, 2], steps=4, seconds=1.0))
    assert one["most_running"] == 3
    slow = Result("s", tokens=[1, 2], arrival_step=0, first_token_step=1, finish_step=3, token_times=[0.1, 0.2])
    assert serving_stats({"a": results["a"], "s": slow}, trace)["tpot_steps_max"] == 2.0  # s: 2 steps for 1 token
    # a's steps 2, 3 compute 3 and 7 (median 5); c's steps 5..8 compute 1, 1, 2, 2 (median 1.5)
    assert (stats["step_tokens_p50"], stats["step_tokens_p95"]) == (1.5, 5)
    assert stats["ttft_s_p50"] == pytest.approx(0.2) and stats["tpot_s_p95"] == pytest.approx(0.1)
