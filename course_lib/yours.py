"""Your code runs the chapter: the learner's function once it passes its visible check, else the course's.

After an exercise, the chapter's demonstrations call the learner's own function as soon as it passes the
exercise's visible check, and the course's reference until then, saying which in one line:

    masked_softmax = yours(masked_softmax, checks.check_masked_softmax, attention.masked_softmax)
    # using your masked_softmax
    # or: your masked_softmax does not pass its check yet: the course's version runs below

The check runs again, quietly (what it prints is dropped); any exception it raises, a failed check or an
unfinished exercise's NotImplementedError, means "not yet". Grading is not affected: the clean room
grades the answer cells alone.

The one way the course runs the learner's function inside its own machinery: a keyword argument named
after the course function it replaces, whose default is the course's own, in every module and chapter:

    generate(model, idx, 50, do_sample=True, top_k=10, top_k_filter=top_k_filter)   # chapter 06
    generate(model, idx, 50, num_beams=4, beam_search=beam_search)
    mine = dict(top_k_filter=top_k_filter, beam_search=beam_search); generate(..., **mine)

and, for a class, the same keyword given to its constructor (``attention=``). No {name: function} mapping
is looked up by name anywhere.
"""
from __future__ import annotations

import contextlib
import io
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def passes(function: Callable, check: Callable[[Callable], None]) -> bool:
    """Whether ``check(function)`` returns without raising; what the check prints is dropped, and the random
    numbers it draws (building layers, say) are given back, so that the cells after it draw the same ones
    whether the learner's function passed, failed early or is not written yet."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), torch.random.fork_rng():
            check(function)
    except Exception:  # noqa: BLE001 - any failure of the learner's code or of the check means "not yet"
        return False
    return True


def yours(function: F, check: Callable[[Callable], None], reference: F) -> F:
    """``function`` (the learner's) if it passes ``check``, else ``reference``; prints which one runs below."""
    name = getattr(reference, "__name__", None) or getattr(function, "__name__", "function")
    if passes(function, check):
        print(f"using your {name}")
        return function
    print(f"your {name} does not pass its check yet: the course's version runs below")
    return reference
