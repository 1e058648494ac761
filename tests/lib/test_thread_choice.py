"""course_lib.kernels.ThreadChoice and threads: the thread count a pass runs on, decided by timed probes.

The decisions are tested on a fake clock: each probe call advances it by the seconds its thread count is given here
(one thread faster, as on a loaded machine, or two, as on a quiet one), so no test sleeps or reads wall-clock time,
and a busy machine cannot change what they see. The oracle is the rule itself, counted by hand: which count wins
each call by the margin, how many calls decide, what the probe cost.
"""
from __future__ import annotations

import pytest
import torch

from course_lib.bench import timing
from course_lib.kernels import ThreadChoice, threads


class FakeClock:
    """Seconds that move only when a probe says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_threads_sets_the_count_only_if_it_differs_and_restores_it_even_on_an_error(monkeypatch):
    before, sets = torch.get_num_threads(), []
    set_num_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (sets.append(n), set_num_threads(n)))
    with threads(before) as n:
        assert n == before and torch.get_num_threads() == before
    assert sets == []  # the count it already had: not set (OpenMP's pool is not resized for nothing)
    other = before + 1
    with pytest.raises(KeyError):
        with threads(other):
            assert torch.get_num_threads() == other
            raise KeyError("inside")
    assert torch.get_num_threads() == before and sets == [other, before]
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        with threads(0):
            pass
    assert timing.threads is threads  # the benchmarks' is the library's one


def test_threads_restores_a_count_the_block_set_itself_even_when_it_asked_for_the_one_it_found():
    # yours.yours_from runs an earlier notebook (whose set-up cell sets its own count) inside threads(current)
    before = torch.get_num_threads()
    other = before + 1
    with threads(before):
        torch.set_num_threads(other)
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError):
        with threads(other):
            torch.set_num_threads(other + 1)
            raise KeyError("inside")
    assert torch.get_num_threads() == before


def test_thread_choice_probes_both_counts_keeps_the_faster_and_probes_again_after_explore_times_the_probe():
    delay = {1: 0.001, 2: 0.010}  # one thread faster (as on a loaded machine)
    probes = []

    def probe():
        probes.append(torch.get_num_threads())
        clock.now += delay[torch.get_num_threads()]

    clock = FakeClock()
    with threads(2):
        choice, model = ThreadChoice(explore=5.0, calls=3, margin=1.25, clock=clock), ("C", "L")
        first = choice.pick(model, 8, 2, probe)
        assert first.threads == 1 and probes == [1, 2, 1, 2]  # each count in turn, until one has won most of 3 calls
        assert first.seconds == pytest.approx(2 * (0.001 + 0.010))  # the probe's four calls, on the clock
        choice.record(model, 2, first, 8, 8, 4.9 * first.seconds)
        assert choice.pick(model, 8, 2, probe) is first and len(probes) == 4  # not yet: passes took < 5 x the probe
        assert choice.pick(model, 4, 2, probe) is first and len(probes) == 4  # one thread for 8 rows: for 4 too
        sixteen = choice.pick(model, 16, 2, probe)  # ... but not for more rows: probed
        assert sixteen.rows == 16 and sixteen.threads == 1 and len(probes) == 8
        delay[1] = 0.030  # the load moves: now two threads are faster
        choice.record(model, 2, first, 8, 8, 0.2 * first.seconds)  # the 8-row probe is stale, the 16-row one not
        assert choice.pick(model, 8, 2, probe) is sixteen and len(probes) == 8  # one thread for 16 rows: for 8 too
        choice.record(model, 2, sixteen, 16, 16, 5 * sixteen.seconds)
        second = choice.pick(model, 8, 2, probe)
        assert second.threads == 2 and len(probes) == 12  # probed again, and noticed
        assert torch.get_num_threads() == 2  # the caller's count, restored
        assert choice.pick(model, 16, 2, probe) is second and len(probes) == 12  # two threads for 8 rows: for 16 too
        assert choice.pick(model, 4, 2, probe).rows == 4 and len(probes) == 16  # fewer rows: a probe of their own
        assert choice.pick(("C2", "L"), 8, 2, probe).rows == 8 and len(probes) == 20  # another model: probed afresh
        delay[3] = 0.010
        assert choice.pick(model, 8, 3, probe).rows == 8 and len(probes) == 24  # another thread count: probed afresh


def test_thread_choice_the_nearest_of_the_probes_that_speak_for_a_pass_decides_it():
    delay = {1: 0.001, 2: 0.010}  # one thread faster

    def probe():
        clock.now += delay[torch.get_num_threads()]

    clock = FakeClock()
    with threads(2):
        choice, model = ThreadChoice(explore=5.0, calls=3, margin=1.25, clock=clock), ("C", "L")
        old = choice.pick(model, 16, 2, probe)
        choice.record(model, 2, old, 16, 16, 100 * old.seconds)  # stale
        eight = choice.pick(model, 8, 2, probe)
        sixteen = choice.pick(model, 16, 2, probe)  # probed again: kept before the 8-row probe
        assert eight.threads == sixteen.threads == 1 and sixteen is not old
        assert choice.pick(model, 4, 2, probe) is eight  # both speak for 4 rows; the nearest decides


def test_thread_choice_probes_again_at_once_when_a_pass_on_n_threads_stalls():
    # A stall: two passes in a row on n threads, each more than `stall` times slower per token than the fastest
    # pass of its rows that the same probe decided. It makes the probes that chose n stale, not those that chose one
    # thread; slow passes on one thread say nothing.
    quiet_delays = {1: 0.020, 2: 0.002}  # two threads faster (a quiet machine)
    delay = dict(quiet_delays)

    def probe():
        clock.now += delay[torch.get_num_threads()]

    clock = FakeClock()
    with threads(2):
        choice, model = ThreadChoice(explore=1000.0, calls=3, margin=1.25, stall=2.0, clock=clock), ("C", "L")
        quiet = choice.pick(model, 8, 2, probe)
        delay.update({1: 0.002, 2: 0.020})
        one = choice.pick(model, 4, 2, probe)  # a one-thread probe for fewer rows
        delay.update(quiet_delays)
        assert quiet.threads == 2 and one.threads == 1
        choice.record(model, 2, quiet, 8, 8, 0.080)  # the fastest pass so far: 0.01 s per token
        choice.record(model, 2, quiet, 8, 4, 0.076)  # 1.9 times slower per token: not a stall
        choice.record(model, 2, quiet, 16, 16, 1.000)  # another size's first pass: nothing to compare with
        choice.record(model, 2, one, 4, 4, 0.004)
        for _ in range(3):
            choice.record(model, 2, one, 4, 4, 3.0)  # 750 times slower per token, on one thread: not a stall
        assert choice.pick(model, 8, 2, probe) is quiet and choice.pick(model, 4, 2, probe) is one
        delay[2] = 0.100  # load comes
        choice.record(model, 2, quiet, 8, 8, 0.170)  # 2.1 times slower per token than the fastest: one slow pass
        assert choice.pick(model, 8, 2, probe) is quiet  # one slow pass could be a burst, or another mix of chunks
        choice.record(model, 2, quiet, 8, 8, 0.060)  # a fast one between: the count starts again
        choice.record(model, 2, quiet, 8, 8, 0.170)
        assert choice.pick(model, 8, 2, probe) is quiet
        choice.record(model, 2, quiet, 8, 8, 0.170)  # two slow passes in a row: a stall
        assert choice.pick(model, 4, 2, probe) is one  # the one-thread probe still holds
        loaded = choice.pick(model, 8, 2, probe)
        assert loaded is not quiet and loaded.threads == 1  # probed again at once (explore is far off)


@pytest.mark.parametrize("speedup, chosen", [(1.2, 1), (1.3, 2)])
def test_thread_choice_takes_n_threads_only_when_they_win_by_the_margin(speedup, chosen):
    clock, delay = FakeClock(), {1: 0.012, 2: 0.012 / speedup}  # n faster by `speedup`; the margin is 1.25

    def probe():
        clock.now += delay[torch.get_num_threads()]

    with threads(2):
        assert ThreadChoice(calls=3, margin=1.25, clock=clock).pick(("C", "L"), 8, 2, probe).threads == chosen
