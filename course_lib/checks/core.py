"""Generic assertions with specific messages, and the course's tolerance policy.

Learner-facing checks: the visible test cells call these for instant, specific feedback.

A failed check raises ``CheckFailed`` (an ``AssertionError``) whose message says what is
wrong, with numbers: "row 2 of your weights sums to 0.87, expected 1"; IPython shows that message alone,
without the check's own frames. An unfinished exercise (its stub still raises ``NotImplementedError``) makes its
check raise ``NotWrittenYet``, which says so and names the function. Expected values
come from independent oracles (PyTorch built-ins or a float64 formula), never from
``course_lib``'s own reference solutions.

Tolerance policy, used everywhere in the course: float32 parity is checked with
``rtol = atol = 1e-5`` unless a check says why it needs more.
"""
from __future__ import annotations


import functools

import torch

__all__ = ["RTOL", "ATOL", "CheckFailed", "NotWrittenYet", "explain", "says_unfinished", "fail", "call_learner", "passed", "unpack_pair", "assert_tensor", "assert_shape",
           "assert_finite", "assert_close", "assert_rows_sum_to_one", "assert_masked_are_zero", "greedy_oracle"]

RTOL = 1e-5
ATOL = 1e-5


class CheckFailed(AssertionError):
    """A check found a specific, explained problem in the learner's code.

    In a notebook it reads as one message: IPython asks an exception for ``_render_traceback_`` before it formats a
    traceback, and this one is the message alone (the check's frames and source say nothing to the learner; the
    exception that led to it, if any, is named in the message). Validate shows the same lines.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31m{type(self).__name__}\x1b[0m: {self}"]


class NotWrittenYet(CheckFailed, NotImplementedError):
    """An exercise's check ran into the exercise's stub: ``raise NotImplementedError()`` is still its code.

    Also a ``NotImplementedError``, so whatever expects the stub's own error still sees one."""

    @classmethod
    def from_error(cls, error: NotImplementedError) -> "NotWrittenYet":
        """The message names the function whose code raised ``error`` (the innermost frame: the stub itself)."""
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        code = tb.tb_frame.f_code if tb is not None else None
        name = getattr(code, "co_qualname", getattr(code, "co_name", "<module>")).rpartition("<locals>.")[2]
        what = "this exercise" if code is None or name.startswith("<") else f"{name}"
        return cls(f"{what} is not written yet: its code still raises NotImplementedError. Write it and run its cell.")


def says_unfinished(check):
    """``check`` with an unfinished exercise's ``NotImplementedError`` raised as ``NotWrittenYet`` naming it."""
    @functools.wraps(check)
    def checked(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except NotWrittenYet:
            raise
        except NotImplementedError as error:
            raise NotWrittenYet.from_error(error) from error
    return checked


def explain(error: BaseException) -> str:
    """What a failed test tells the learner: a check's message, "... is not written yet", else the error's type and
    first words (``course check``'s report and the grading CSVs)."""
    if isinstance(error, NotImplementedError) and not isinstance(error, NotWrittenYet):
        error = NotWrittenYet.from_error(error)
    return f"{type(error).__name__}: {error}".strip()


def fail(message: str):
    raise CheckFailed(message)


def call_learner(call, name: str, hint: str = "", errors=(RuntimeError,)):
    """Return ``call()``, the learner's code run on a check's input. An error of `errors` (a shape that does not
    broadcast, say) becomes a ``CheckFailed`` naming the call, the error's first line and the `hint`; an
    unfinished exercise's ``NotImplementedError`` passes through as itself."""
    try:
        return call()
    except NotImplementedError:
        raise
    except errors as error:
        fail(f"{name} raised {type(error).__name__}: {(str(error).splitlines() or [''])[0]}" + (f" ({hint})" if hint else ""))


def _index(flat_index: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(shape)))


def assert_tensor(value, name: str) -> torch.Tensor:
    """The value is a torch.Tensor (not a tuple, None or ndarray)."""
    if not isinstance(value, torch.Tensor):
        fail(f"{name} should be a torch.Tensor, got {type(value).__name__}")
    return value


def assert_shape(value, expected_shape, name: str) -> None:
    """The tensor has exactly the expected shape."""
    assert_tensor(value, name)
    if tuple(value.shape) != tuple(expected_shape):
        fail(f"{name} has shape {tuple(value.shape)}, expected {tuple(expected_shape)}")


def assert_finite(value, name: str) -> None:
    """No NaN or infinity anywhere in the tensor."""
    assert_tensor(value, name)
    bad = ~torch.isfinite(value)
    if bad.any():
        where = _index(int(bad.flatten().nonzero()[0]), value.shape)
        fail(f"{name} contains {int(bad.sum())} non-finite value(s), the first at index {where}: {value[where].item()}")


def assert_close(actual, expected, name: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """actual matches expected within the course tolerance; the message names the worst entry."""
    assert_tensor(actual, name)
    expected = expected.to(actual.dtype) if actual.is_floating_point() else expected
    assert_shape(actual, expected.shape, name)
    assert_finite(actual, name)
    error = (actual.double() - expected.double()).abs()
    allowed = atol + rtol * expected.double().abs()
    if (error > allowed).any():
        worst = _index(int((error - allowed).flatten().argmax()), actual.shape)
        fail(
            f"{name} differs from the expected values in {int((error > allowed).sum())} of {error.numel()} entries; "
            f"the worst is at index {worst}: got {actual[worst].item():.6g}, expected {expected[worst].item():.6g} "
            f"(tolerance rtol={rtol:g}, atol={atol:g})"
        )


def assert_rows_sum_to_one(weights, name: str = "your weights", mask=None) -> None:
    """Each row along the last axis sums to 1 (rows with no unmasked key must sum to 0)."""
    sums = weights.double().sum(-1)
    expected = torch.ones_like(sums)
    if mask is not None:
        expected = mask.expand(weights.shape).any(-1).double()
    bad = (sums - expected).abs() > 1e-4
    if bad.any():
        row = _index(int(bad.flatten().nonzero()[0]), sums.shape)
        fail(
            f"row {row if len(row) > 1 else row[0]} of {name} sums to {sums[row].item():.4g}, expected {expected[row].item():g}"
            " (is the softmax taken over the last axis, the keys?)"
        )


def assert_masked_are_zero(weights, mask, name: str = "your weights") -> None:
    """Every position where mask is False gets exactly zero weight."""
    leaked = weights.masked_fill(mask, 0.0).abs()
    if (leaked > 0).any():
        where = _index(int(leaked.flatten().argmax()), weights.shape)
        fail(
            f"{name} give weight {weights[where].item():.4g} to a masked position {where}; masked positions "
            "(mask == False) must get exactly 0. Is the mask ignored or inverted?"
        )


def unpack_pair(result, function: str, names: tuple[str, str]):
    """The function returned a 2-tuple, such as (out, weights); return it."""
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"{function} should return a tuple ({names[0]}, {names[1]}), got {type(result).__name__}")
    return result


def passed(what: str) -> None:
    print(f"✓ {what}: all visible checks passed.")


@torch.no_grad()
def greedy_oracle(model, idx, max_new_tokens: int):
    """Greedy decoding as plainly as it gets, the oracle of chapters 05 and 07: no cache, every step runs the
    model (forward(idx) -> (logits, loss)) over the whole sequence so far. idx (B, T) -> (B, T + max_new_tokens)."""
    for _ in range(max_new_tokens):
        logits, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx
