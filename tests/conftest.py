"""Shared fixtures. Shared helpers (the repository root, the tolerance policy) are in tests/helpers.py."""
from __future__ import annotations

import os

# Waiting OpenMP threads sleep instead of spinning. Two test processes (xdist's workers, or a notebook's kernel beside
# a test) each running torch on several threads over-subscribe a 2-core machine, and spinning threads then steal the
# cores that would finish the work: a 3-step pretraining run took 77 s instead of 15 s beside a busy core. Set before
# torch loads OpenMP, and inherited by xdist's workers and nbval's kernels; `make test` sets it for the nbval-only run.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

# torch is imported by the fixtures, not here: xdist's main process loads this file before it starts the workers and
# runs no test, and importing torch here (a second of one core) delayed both workers' start by as much.


@pytest.fixture
def generator():
    import torch

    return torch.Generator().manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test, as in the notebooks (several threads on a busy 2-core machine make tiny
    models crawl); the thread count is restored afterwards. Use with pytest.mark.usefixtures("one_thread")."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def round_trips(request, tmp_path_factory):
    """Every chapter round trip of the session, graded in one run: chapter name -> its results (tests/roundtrip.py)."""
    from tests.roundtrip import grade_round_trips

    return grade_round_trips(tmp_path_factory, request.session)
