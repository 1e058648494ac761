"""Chapter 12's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import checks
from course_lib.serving import paged_attention, schedule_step

def unscaled(q, key_pool, value_pool, block_tables, context_lens):
    return paged_attention(q * math.sqrt(q.shape[-1]), key_pool, value_pool, block_tables, context_lens)

def unmasked(q, key_pool, value_pool, block_tables, context_lens):
    return paged_attention(q, key_pool, value_pool, block_tables, torch.full_like(context_lens, block_tables.shape[1] * key_pool.shape[1]))

def one_past_the_end(q, key_pool, value_pool, block_tables, context_lens):
    room = block_tables.shape[1] * key_pool.shape[1]
    return paged_attention(q, key_pool, value_pool, block_tables, (context_lens + 1).clamp(max=room))

def first_table_for_all(q, key_pool, value_pool, block_tables, context_lens):
    return paged_attention(q, key_pool, value_pool, block_tables[:1].expand_as(block_tables), context_lens)

def over_dh(q, key_pool, value_pool, block_tables, context_lens):
    return paged_attention(q / math.sqrt(q.shape[-1]), key_pool, value_pool, block_tables, context_lens)

def resumed_from_zero(running, waiting, free, budget):  # a waiting sequence's n_cached ignored
    scheduled, preempted = schedule_step(running, waiting, free, budget)
    return [(s, n + s.n_cached if s in waiting else n) for s, n in scheduled], preempted

def scheduler(mistake):
    """The policy with one mistake: "skip_chunk" (a running prefill longer than the budget left is skipped),
    "skip_self" (a sequence that does not fit alone is skipped, not preempted), "one_victim" (one victim at most),
    "free_kept" (free blocks not decremented after scheduling), "decodes_first" (the decoding sequences scheduled
    before the running prompt chunks, whatever their order)."""
    def buggy(running, waiting, free, budget):
        scheduled, preempted, candidates = [], [], list(running)
        if mistake == "decodes_first":  # the decoding sequences ahead of any prompt chunk
            candidates.sort(key=lambda seq: seq.n_tokens - seq.n_cached > 1)
        while candidates and budget > 0:
            seq = candidates.pop(0)
            if mistake == "skip_chunk" and seq.n_tokens - seq.n_cached > budget:
                continue
            n = min(seq.n_tokens - seq.n_cached, budget)
            need = seq.blocks_needed(n)
            while need > free and candidates:
                preempted.append(candidates.pop())
                free += preempted[-1].blocks_freed()
                if mistake == "one_victim":
                    break
            if need > free:
                if mistake == "skip_self":
                    continue
                preempted.append(seq)
                break
            scheduled.append((seq, n))
            budget -= n
            free -= 0 if mistake == "free_kept" else need
        for seq in waiting if not preempted else []:
            n = min(seq.n_tokens - seq.n_cached, budget)
            if budget <= 0 or seq.blocks_needed(n) > free:
                break
            scheduled.append((seq, n))
            budget -= n
            free -= 0 if mistake == "free_kept" else seq.blocks_needed(n)
        return scheduled, preempted
    return buggy

@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_schedule_step, scheduler("skip_chunk"), "A running prefill gets a chunk too"),
    (checks.check_schedule_step, scheduler("skip_self"), "a itself is preempted .* never skipped"),
    (checks.check_schedule_step, scheduler("one_victim"), "keep preempting the most recent"),
    (checks.check_schedule_step, scheduler("free_kept"), "Subtract each scheduled sequence's blocks_needed"),
    (checks.check_schedule_step, scheduler(None), "all visible checks passed"),
    (checks.check_schedule_step, scheduler("decodes_first"), "a's decode was scheduled before the chunk of p, the older"),
    (checks.check_slot_mapping, lambda table, positions, S: positions, "you returned the positions themselves"),
    (checks.check_slot_mapping, lambda table, positions, S: table[positions // S] + positions % S, "block \\+ offset is not a slot"),
    (checks.check_slot_mapping, lambda table, positions, S: table[positions % S] * S + positions // S, "block and offset swapped"),
    (checks.check_paged_attention, unscaled, "not scaled"),
    (checks.check_paged_attention, lambda *args: paged_attention(*args).double(), "should return q's dtype"),
    (checks.check_schedule_step, resumed_from_zero, "wants its 12 uncached tokens"),
    (checks.check_paged_attention, unmasked, "you attend to every slot of the blocks"),
    (checks.check_paged_attention, one_past_the_end, "you included position context_lens\\[b\\] too"),
    (checks.check_paged_attention, first_table_for_all, "every sequence read the blocks of sequence 0"),
    (checks.check_paged_attention, over_dh, "divided by Dh"),
    (checks.check_schedule_step, lambda r, w, f, b: ([(s, s.n_tokens - s.n_cached) for s in r + w], []), "does not fit in what is left"),
])
def test_each_classic_bug_gets_its_message(check, buggy, message, capsys):
    if message == "all visible checks passed":  # the mistake-free twin of the buggy schedulers above
        check(buggy)
        assert message in capsys.readouterr().out
        return
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)
