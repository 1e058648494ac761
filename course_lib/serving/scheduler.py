"""The scheduler: which sequences run in a step, with how many tokens, and which are preempted (vLLM's
``core/sched/scheduler.py``, nano-vllm's ``engine/scheduler.py``).

``schedule_step`` is the reference solution of chapter 12's third exercise (``tests/grading/test_solution_drift.py``
keeps it equal to the notebook's); the engine runs it, or the learner's, once per step.
"""
from __future__ import annotations


def schedule_step(running: list, waiting: list, num_free_blocks: int, token_budget: int):
    """One step of the scheduler: which sequences run, with how many tokens, and which are preempted.

    Inputs: running, the running sequences, oldest admission first; waiting, the waiting ones, first come
    first; num_free_blocks, int >= 0; token_budget, int >= 1. A sequence has ``n_tokens`` and ``n_cached``
    (ints, n_cached < n_tokens), ``blocks_needed(n)`` and ``blocks_freed()`` (ints).
    Returns (scheduled, preempted): scheduled, a list of (sequence, n) pairs, the running sequences first,
    then the waiting ones, each in the order of its list; preempted, a list of running sequences in the
    order they were preempted. The policy that decides them is chapter 12's, section 3.
    Invariants: 1 <= n <= n_tokens - n_cached for every pair; the n sum to at most token_budget; the
    blocks_needed(n) of the pairs sum to at most num_free_blocks plus the blocks_freed() of the preempted;
    no sequence is both scheduled and preempted; a waiting sequence is scheduled only if nothing was
    preempted and every waiting sequence before it was scheduled. Neither list is changed (the engine moves
    the sequences itself). Raises nothing: the engine passes only valid sequences.
    Hidden tests (hand-made sequences, ``checks.fake_sequence``): which sequences are preempted and in what
    order, when blocks run out (the freed count is blocks_freed(), a sequence that cannot fit preempts
    itself, no admission after a preemption); the budget capping running and waiting sequences alike, a
    prefill continuing with its next chunk, a waiting sequence with tokens already cached.
    """
    scheduled, preempted = [], []
    budget, free = token_budget, num_free_blocks
    candidates = list(running)  # the running sequences not yet scheduled or preempted
    while candidates and budget > 0:
        seq = candidates.pop(0)
        n = min(seq.n_tokens - seq.n_cached, budget)
        need = seq.blocks_needed(n)
        while need > free and candidates:
            victim = candidates.pop()  # the most recently admitted one
            preempted.append(victim)
            free += victim.blocks_freed()
        if need > free:  # nobody else left to preempt: seq itself goes
            preempted.append(seq)
            break
        scheduled.append((seq, n))
        budget -= n
        free -= need
    if not preempted:
        for seq in waiting:
            if budget <= 0:
                break
            n = min(seq.n_tokens - seq.n_cached, budget)
            need = seq.blocks_needed(n)
            if need > free:
                break
            scheduled.append((seq, n))
            budget -= n
            free -= need
    return scheduled, preempted
