"""Shared fixtures. Shared helpers (the repository root, the tolerance policy) are in tests/helpers.py."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test, as in the notebooks (several threads on a busy 2-core machine make tiny
    models crawl); the thread count is restored afterwards. Use with pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
