"""Visible checks of chapter 12 (serving: a paged KV cache and a scheduler), and the oracles they compare against.

Oracles: slots worked out one position at a time from the definition; attention over each sequence's keys laid
out contiguously, in float64 (``contiguous_attention``); hand-made sequences whose scheduling the policy of the
chapter's section 3 decides (``fake_sequence``); never course_lib.serving's reference solutions.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from .core import assert_close, assert_shape, assert_tensor, fail, passed

__all__ = ["check_slot_mapping", "check_paged_attention", "check_schedule_step", "contiguous_attention",
           "fake_sequence", "paged_example"]


def check_slot_mapping(slot_mapping) -> None:
    """Visible checks for chapter 12, exercise 1: positions -> flat slots through a block table."""
    table = torch.tensor([5, 2, 7])
    positions = torch.arange(10)
    try:
        got = slot_mapping(table, positions, 4)
    except IndexError as error:  # e.g. block_table[positions % block_size] on a table shorter than block_size
        fail(f"an index past the end of the block table ({error}): are block and offset swapped? Position p is in "
             "the (p // block_size)-th block of the table, at offset p % block_size")
    got = assert_tensor(got, "slot_mapping(...)")
    assert_shape(got, (10,), "slot_mapping(table, positions, 4)")
    expected = [table[p // 4].item() * 4 + p % 4 for p in range(10)]  # the definition, one position at a time
    got = [int(x) for x in got.tolist()]
    if got == list(range(10)):
        fail("you returned the positions themselves: a sequence's blocks are scattered over the pool; position p "
             "lives in block block_table[p // block_size]")
    if got[:3] == [table[0].item() * 4, table[1].item() * 4, table[2].item() * 4]:  # positions 0, 1, 2 in blocks 0, 1, 2
        fail("block and offset are swapped: position p is in the (p // block_size)-th block of the table, at offset "
             "p % block_size")
    if got == [table[p // 4].item() + p % 4 for p in range(10)]:
        fail("block + offset is not a slot: block b's slots are b * block_size .. b * block_size + block_size - 1")
    if got != expected:
        fail(f"block table {table.tolist()}, block_size 4, positions 0..9: expected slots {expected}, got {got}")
    passed("slot_mapping")


def contiguous_attention(q, key_pool, value_pool, block_tables, context_lens) -> torch.Tensor:
    """The oracle: each sequence's keys and values copied out position by position, attention in float64: (B, H, Dh)."""
    S = key_pool.shape[1]
    out = []
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        keys = torch.stack([key_pool[block_tables[b, p // S], p % S] for p in range(n)]).double()  # (n, H, Dh)
        values = torch.stack([value_pool[block_tables[b, p // S], p % S] for p in range(n)]).double()
        scores = torch.einsum("hd,nhd->hn", q[b].double(), keys) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values))
    return torch.stack(out).to(q.dtype)


def paged_example(seed: int, lengths, block_size: int, n_blocks: int = 24, H: int = 2, Dh: int = 8, garbage: float = 0.0):
    """A pool (N, S, H, Dh) with scattered block tables for sequences of the given lengths, queries and lengths.

    Slots past each sequence's length hold `garbage` added to random numbers (a stale, partly filled block).
    Returns (q (B, H, Dh), key_pool, value_pool, block_tables (B, M), context_lens (B,))."""
    g = torch.Generator().manual_seed(seed)
    key_pool = torch.randn(n_blocks, block_size, H, Dh, generator=g) + garbage
    value_pool = torch.randn(n_blocks, block_size, H, Dh, generator=g) + garbage
    M = max(math.ceil(n / block_size) for n in lengths)
    order = torch.randperm(n_blocks, generator=g)
    tables = torch.full((len(lengths), M), int(order[-1]))  # padding entries: a valid block of other numbers
    used = 0
    for b, n in enumerate(lengths):
        k = math.ceil(n / block_size)
        tables[b, :k] = order[used:used + k]
        used += k
        for p in range(n):  # the real slots: ordinary numbers
            key_pool[tables[b, p // block_size], p % block_size] -= garbage
            value_pool[tables[b, p // block_size], p % block_size] -= garbage
    q = torch.randn(len(lengths), H, Dh, generator=g)
    return q, key_pool, value_pool, tables, torch.tensor(lengths)


def check_paged_attention(paged_attention) -> None:
    """Visible checks for chapter 12, exercise 2: one decode step through block tables equals contiguous attention."""
    args = paged_example(0, [5, 8, 1], block_size=4, garbage=0.0)
    got = assert_tensor(paged_attention(*args), "paged_attention(...)")
    assert_shape(got, (3, 2, 8), "paged_attention(q (3, 2, 8), ...)")
    if got.dtype != args[0].dtype:
        fail(f"paged_attention should return q's dtype ({args[0].dtype}), got {got.dtype}: compute in q's dtype "
             "(or convert the result back); the engine and the tests compare with float32 results")
    expected = contiguous_attention(*args)
    q, key_pool, value_pool, tables, lengths = args
    unscaled = contiguous_attention(q * math.sqrt(8), key_pool, value_pool, tables, lengths)
    if torch.allclose(got, unscaled, atol=1e-4) and not torch.allclose(got, expected, atol=1e-4):
        fail("the scores are not scaled: divide q . k by sqrt(Dh)")
    everything = contiguous_attention(q, key_pool, value_pool, tables, tables.shape[1] * 4 * torch.ones_like(lengths))
    if torch.allclose(got, everything, atol=1e-4) and not torch.allclose(got, expected, atol=1e-4):
        fail("you attend to every slot of the blocks: sequence b may see only its positions 0 .. context_lens[b] - 1 "
             "(the rest of a partly filled block, and the padding entries of its table, hold other numbers)")
    one_less = contiguous_attention(q, key_pool, value_pool, tables, (lengths - 1).clamp(min=1))
    if torch.allclose(got[:2], one_less[:2], atol=1e-4) and not torch.allclose(got, expected, atol=1e-4):
        fail("off by one: context_lens[b] counts the newest token too; sequence b attends to positions 0 .. context_lens[b] - 1")
    one_more = contiguous_attention(q, key_pool, value_pool, tables, (lengths + 1).clamp(max=tables.shape[1] * 4))
    if torch.allclose(got[[0, 2]], one_more[[0, 2]], atol=1e-4) and not torch.allclose(got, expected, atol=1e-4):
        fail("off by one: sequence b attends to positions 0 .. context_lens[b] - 1, context_lens[b] positions in all; "
             "you included position context_lens[b] too (mask with p < context_lens[b], not <=)")
    first_table = contiguous_attention(q, key_pool, value_pool, tables[:1].expand_as(tables), lengths)
    if torch.allclose(got, first_table, atol=1e-4) and not torch.allclose(got, expected, atol=1e-4):
        fail("every sequence read the blocks of sequence 0: sequence b's keys and values are in the blocks of ITS row "
             "of the table, block_tables[b]")
    over_dh = contiguous_attention(q / math.sqrt(8), key_pool, value_pool, tables, lengths)
    if torch.allclose(got, over_dh, atol=1e-4) and not torch.allclose(got, expected, atol=1e-4):
        fail("the scores are divided by Dh: divide q . k by sqrt(Dh)")
    assert_close(got, expected, "paged_attention (against contiguous attention in float64)")
    passed("paged_attention")


def fake_sequence(name: str, n_tokens: int, n_cached: int, held: int, block_size: int = 4, freed: int | None = None):
    """A hand-made sequence for the scheduler: blocks_needed(n) = ceil((n_cached + n) / block_size) - held
    (at least 0), blocks_freed() = held (or `freed`)."""
    return SimpleNamespace(name=name, n_tokens=n_tokens, n_cached=n_cached,
                           blocks_needed=lambda n: max(0, math.ceil((n_cached + n) / block_size) - held),
                           blocks_freed=lambda: held if freed is None else freed)


def _call(schedule_step, running, waiting, free, budget, what):
    result = schedule_step(running, waiting, free, budget)
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"schedule_step should return a tuple (scheduled, preempted), got {type(result).__name__} ({what})")
    scheduled, preempted = result
    try:
        pairs = [(s.name, int(n)) for s, n in scheduled]
        gone = [s.name for s in preempted]
    except (TypeError, ValueError, AttributeError):
        fail(f"scheduled should be a list of (sequence, n) pairs and preempted a list of sequences ({what})")
    return pairs, gone


def check_schedule_step(schedule_step) -> None:
    """Visible checks for chapter 12, exercise 3: one scheduler step under the policy of section 3."""
    def state():
        return ([fake_sequence("a", 9, 8, 2), fake_sequence("b", 5, 4, 1)],
                [fake_sequence("c", 10, 0, 0), fake_sequence("d", 3, 0, 0)])
    running, waiting = state()
    pairs, gone = _call(schedule_step, running, waiting, 10, 8, "two decoding, two waiting, budget 8")
    if [s.name for s in running] != ["a", "b"] or [s.name for s in waiting] != ["c", "d"]:
        fail("schedule_step changed the lists it was given: the engine moves sequences itself")
    if pairs[:2] != [("a", 1), ("b", 1)]:
        fail(f"the running sequences come first, in order, one token each when they decode: expected [('a', 1), ('b', 1)] "
             f"first, got {pairs}")
    if ("c", 10) in pairs:
        fail("c's prompt of 10 tokens does not fit in what is left of the budget of 8: it gets a chunk of 6 (chunked prefill)")
    if pairs != [("a", 1), ("b", 1), ("c", 6)] or gone:
        fail(f"budget 8, 10 free blocks: expected [('a', 1), ('b', 1), ('c', 6)] and nothing preempted, got {pairs}, {gone}")
    running, waiting = state()
    pairs, gone = _call(schedule_step, running, waiting, 3, 20, "a and b take one block each, c needs 3, 1 is left")
    if any(name == "c" for name, _ in pairs):
        fail(f"c was admitted with {pairs}: a and b took 2 of the 3 free blocks and c needs 3, only 1 is left. Subtract "
             "each scheduled sequence's blocks_needed(n) from the free blocks")
    if ("d", 3) in pairs:
        fail("d overtook c: when the first waiting request does not fit, admission stops (first come, first served)")
    if pairs != [("a", 1), ("b", 1)] or gone:
        fail(f"3 free blocks, a and b take one each, c needs 3 and 1 is left: expected [('a', 1), ('b', 1)], got {pairs}, "
             f"preempted {gone}")
    running = [fake_sequence("a", 9, 8, 2), fake_sequence("b", 5, 4, 1), fake_sequence("c", 13, 12, 3)]
    pairs, gone = _call(schedule_step, running, [fake_sequence("w", 2, 0, 0)], 0, 50, "no free block")
    if gone == ["a"] or gone[:1] == ["b"]:
        fail(f"preempted {gone}: the victim is the most recent running sequence (the last of the list), not the oldest")
    if ("w", 2) in pairs:
        fail("a waiting request was admitted in a step that preempted: admit only when nothing was preempted")
    if gone != ["c"] or pairs != [("a", 1), ("b", 1)]:
        fail(f"no free block and a needs one: c (the most recent) is preempted, its 3 blocks are enough for a and b: "
             f"expected c preempted and [('a', 1), ('b', 1)], got {pairs}, {gone}")
    running = [fake_sequence("a", 9, 8, 1), fake_sequence("b", 5, 4, 1), fake_sequence("c", 5, 4, 1)]
    pairs, gone = _call(schedule_step, running, [], 0, 50, "no free block, a needs 2, b and c hold 1 each")
    if gone == ["c", "a"]:
        fail("preempted ['c', 'a']: a needs 2 blocks and preempting c freed only 1; keep preempting the most recent "
             "running sequence (b next) while fewer blocks are free than a needs. a itself goes only when nobody "
             "else is left")
    if gone != ["c", "b"] or pairs != [("a", 1)]:
        fail(f"no free block, a needs 2, b and c hold 1 each: c then b are preempted and a is scheduled; expected "
             f"[('a', 1)] and preempted ['c', 'b'], got {pairs}, preempted {gone}")
    running = [fake_sequence("a", 40, 8, 2)]  # prefilling: 32 tokens need 8 new blocks
    pairs, gone = _call(schedule_step, running, [fake_sequence("w", 3, 0, 0)], 1, 64, "a alone does not fit")
    if gone != ["a"]:
        fail(f"a is the only running sequence, wants 32 tokens and 8 blocks, and 1 block is free: nobody else is left "
             f"to preempt, so a itself is preempted (and step 1 ends, nothing is admitted); a running sequence that "
             f"does not fit is never skipped. Expected [] and preempted ['a'], got {pairs}, preempted {gone}")
    if pairs:
        fail(f"a was preempted, so nothing is scheduled: expected [], got {pairs}")
    running = [fake_sequence("a", 9, 8, 2), fake_sequence("p", 30, 8, 2)]  # p prefills: 22 tokens to go
    pairs, gone = _call(schedule_step, running, [fake_sequence("w", 3, 0, 0)], 20, 8, "a running prefill, budget 8")
    if pairs[:1] == [("a", 1)] and not any(name == "p" for name, _ in pairs):
        fail(f"got {pairs}: the running p (30 tokens, 8 cached) was skipped because its 22 tokens exceed the 7 left of "
             "the budget. A running prefill gets a chunk too: min(n_tokens - n_cached, tokens left) = 7")
    if pairs != [("a", 1), ("p", 7)] or gone:
        fail(f"budget 8, 20 free blocks, a decodes and the running p has 22 tokens to prefill: expected [('a', 1), "
             f"('p', 7)] (w gets no token: the budget is spent), got {pairs}, preempted {gone}")
    running = [fake_sequence("p", 30, 8, 2), fake_sequence("a", 9, 8, 2)]  # p, the older, in the middle of its prompt
    pairs, gone = _call(schedule_step, running, [fake_sequence("w", 3, 0, 0)], 20, 8, "an older running prefill, budget 8")
    if ("a", 1) in pairs and pairs[:1] != [("p", 8)]:
        fail(f"got {pairs}: a's decode was scheduled before the chunk of p, the older request (first in running) in the "
             "middle of its prompt. The running sequences go in their order, mid-prompt or decoding alike: p takes "
             "min(22, 8) = 8 tokens, the whole budget, and a waits a step")
    if pairs != [("p", 8)] or gone:
        fail(f"budget 8, 20 free blocks, running p (the older, 22 tokens to prefill) then a (decoding): expected "
             f"[('p', 8)] and nothing preempted, got {pairs}, preempted {gone}")
    resumed = fake_sequence("p", 20, 8, 2)  # waiting, 8 of its 20 tokens already cached (a shared prefix found)
    pairs, gone = _call(schedule_step, [], [resumed], 10, 16, "a waiting sequence with 8 tokens cached")
    if pairs != [("p", 12)] or gone:
        fail(f"a waiting sequence with n_tokens 20 and n_cached 8 wants its 12 uncached tokens (budget 16): expected "
             f"[('p', 12)], got {pairs}, preempted {gone}")
    passed("schedule_step")
