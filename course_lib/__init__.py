"""From Attention to Decoding: the library the course notebooks import.

Each chapter's reference implementations live here (``course_lib.attention`` for
chapter 01, ...). Notebooks import earlier chapters from this package, never from
another notebook, so every notebook runs on its own.
"""
from __future__ import annotations

import random

__version__ = "0.1.0"

#: Thread count every notebook runs with. Results of large reductions depend on the
#: number of threads, so the stored notebook outputs are only reproducible with a
#: fixed count; one thread also lets CI run two notebooks side by side on 2 cores.
NOTEBOOK_THREADS = 1


def setup_notebook(seed: int = 0, threads: int = NOTEBOOK_THREADS, precision: int = 4) -> None:
    """Make a notebook reproducible: fixed seeds, thread count and print precision.

    Every chapter calls this in its first code cell.
    """
    import numpy as np
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_printoptions(precision=precision, sci_mode=False)
    np.set_printoptions(precision=precision, suppress=True)
    try:  # inside IPython: render figures inline, at a fixed size
        import matplotlib

        matplotlib.rcParams.update({"figure.figsize": (6.0, 3.5), "figure.dpi": 90})
    except ImportError:  # pragma: no cover - matplotlib is a pinned dependency
        pass
