"""Chapter 14's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it, and correct alternatives must
pass everything. Oracles: torch.softmax / torch.logsumexp over whole rows and F.scaled_dot_product_attention,
in float64 (checks.attention_oracle, checks.partials_oracle); the largest tensor created, measured.
"""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import checks
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "14-tiled-attention" / "tiled_attention.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "checks": checks})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

OS, MP, TA = "online_softmax", "merge_partials", "tiled_attention"
OS_SUM = "l = l * torch.exp(m - m_safe) + torch.exp(x - m_safe[..., None]).sum(-1)"
OS_SAFE = "m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)"
MP_TERMS = "torch.where(weights[..., None] > 0, weights[..., None] * outs, torch.zeros_like(outs))"
TA_ACC = "acc = acc * alpha[..., None] + p @ v[..., j:j + n_k, :]"
TA_SAFE = "m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # no key seen yet"
TA_KEEP = "keep = torch.arange(i, i + n_q, device=q.device)[:, None] >= torch.arange(j, j + n_k, device=q.device)"


def ex(exercise: str, *names: str) -> set[str]:
    return {f"{exercise}-{name}" for name in names}


CASES = [
    (OS, "no rescaling of the running sum", mutate(OS, (OS_SUM, "l = l + torch.exp(x - m_safe[..., None]).sum(-1)")),
     ex(OS, "visible", "rescale")),
    (OS, "the max updated after the sum", mutate(OS, ("m_new = torch.maximum(m, x.amax(-1))", "m_new = m"),
                                                 ("        m = m_new\n", "        m = torch.maximum(m, x.amax(-1))\n")),
     ex(OS, "visible", "rescale", "masked")),  # masked: its first block of 1e4 summed against 0 overflows
    (OS, "NaN for a fully masked row", mutate(OS, (OS_SAFE, "m_safe = m_new")), ex(OS, "visible", "masked")),
    (OS, "correct: the whole row at once", '''
def online_softmax(blocks):
    parts = list(blocks)
    if not parts:
        raise ValueError("no blocks")
    if any(part.shape[:-1] != parts[0].shape[:-1] for part in parts):
        raise ValueError("blocks of different rows")
    x = torch.cat(parts, dim=-1)
    m = x.amax(-1)
    safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    return m, torch.exp(x - safe[..., None]).sum(-1)
''', set()),
    (MP, "the plain average", mutate(MP, ("return terms.sum(0), lse", "return outs.mean(0), lse")), ex(MP, "visible", "many", "empty")),
    (MP, "0 * NaN for an empty set", mutate(MP, (MP_TERMS, "weights[..., None] * outs")), ex(MP, "visible", "empty")),
    (MP, "exp(lse) without the max", mutate(MP, ("lse = torch.logsumexp(lses, dim=0)", "lse = torch.log(torch.exp(lses).sum(0))")),
     ex(MP, "visible", "empty")),
    (MP, "correct: a pairwise fold with logaddexp", '''
def merge_partials(outs, lses):
    if lses.shape != outs.shape[:-1]:
        raise ValueError("lses")
    out, lse = torch.zeros_like(outs[0]), torch.full_like(lses[0], -math.inf)
    for o, s in zip(outs, lses):
        new = torch.logaddexp(lse, s)
        safe = torch.where(new == -math.inf, torch.zeros_like(new), new)
        a, b = torch.exp(lse - safe)[..., None], torch.exp(s - safe)[..., None]
        out = torch.where(a > 0, a * out, torch.zeros_like(out)) + torch.where(b > 0, b * o, torch.zeros_like(o))
        lse = new
    return out, lse
''', set()),
    (TA, "no rescaling of the accumulator", mutate(TA, (TA_ACC, "acc = acc + p @ v[..., j:j + n_k, :]")),
     ex(TA, "visible", "tiles", "causal", "mask", "memory")),
    (TA, "causal diagonal off by one", mutate(TA, (TA_KEEP, TA_KEEP.replace(">=", ">"))), ex(TA, "visible", "causal", "memory")),
    (TA, "tile mask in local positions", mutate(TA, (TA_KEEP, "keep = torch.arange(n_q)[:, None] >= torch.arange(n_k)")),
     ex(TA, "visible", "causal")),
    (TA, "NaN for a fully masked row", mutate(TA, (TA_SAFE, "m_safe = m_new  # no key seen yet")), ex(TA, "visible", "causal", "mask")),
    (TA, "the mask not expanded", mutate(TA, ("mask = mask.expand(*lead, Tq, Tk)", "pass")), ex(TA, "visible", "causal", "mask", "memory")),
    (TA, "key tiles counted by tile number", mutate(TA, ("last = min(Tk, i + n_q) if causal else Tk",
                                                         "last = min(Tk, (i // block_q + 1) * block_k) if causal else Tk")),
     ex(TA, "visible", "causal")),
    (TA, "every causal tile computed", mutate(TA, ("last = min(Tk, i + n_q) if causal else Tk", "last = Tk")), ex(TA, "visible")),
    (TA, "the mask copied to (..., Tq, Tk)", mutate(TA, ("mask = mask.expand(*lead, Tq, Tk)", "mask = mask.expand(*lead, Tq, Tk).contiguous()")),
     ex(TA, "visible", "memory")),
    (TA, "causal diagonal aligned bottom right", mutate(TA, (TA_KEEP, "keep = torch.arange(i + Tk - Tq, i + n_q + Tk - Tq, device=q.device)[:, None] >= torch.arange(j, j + n_k, device=q.device)"),
                                                              ("if causal and j + n_k - 1 > i:", "if causal:"),
                                                              ("last = min(Tk, i + n_q) if causal else Tk", "last = max(0, min(Tk, i + n_q + Tk - Tq)) if causal else Tk")),
     ex(TA, "visible", "causal", "memory")),  # memory: its 256 queries and 300 keys are compared with the oracle, causal too
    (TA, "running max, sum and accumulator in bfloat16", mutate(TA, ("work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype",
                                                                     "work = q.dtype")), ex(TA, "visible")),
    (TA, "the running sum alone rounded to bfloat16", mutate(TA, ("l = l * alpha + p.sum(-1)", "l = (l * alpha + p.sum(-1)).to(q.dtype).to(work)")),
     ex(TA, "visible")),
    (TA, "float16 left to accumulate in float16", mutate(TA, ("work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype",
                                                                "work = torch.float32 if q.dtype == torch.bfloat16 else q.dtype")), ex(TA, "visible")),
    (TA, "lse left in float32 for bfloat16", mutate(TA, ("lse = q.new_full((*lead, Tq), -math.inf)", "lse = torch.full((*lead, Tq), -math.inf, dtype=work)"),
                                                    ("torch.full_like(l, -math.inf)).to(q.dtype)", "torch.full_like(l, -math.inf))")),
     ex(TA, "visible")),
    (TA, "v longer than k sliced silently", mutate(TA, ("or v.shape[-2] != k.shape[-2]:", ":")), ex(TA, "visible", "tiles")),
    (TA, "no ValueError for a tile of 0", mutate(TA, ("if block_q < 1 or block_k < 1:", "if False:"),
                                                 ("for i in range(0, Tq, block_q):", "for i in range(0, Tq, max(block_q, 1)):"),
                                                 ("for j in range(0, last, block_k):", "for j in range(0, last, max(block_k, 1)):")),
     ex(TA, "tiles")),
    (TA, "correct values, whole score matrix", '''
def tiled_attention(q, k, v, mask=None, causal=False, block_q=64, block_k=64):
    if block_q < 1 or block_k < 1:
        raise ValueError("tiles")
    if v.shape[-2] != k.shape[-2] or (mask is not None and mask.dtype != torch.bool):
        raise ValueError("shapes or mask")
    Tq, Tk = q.shape[-2], k.shape[-2]
    keep = torch.ones(Tq, Tk, dtype=torch.bool)
    keep = keep.tril() if causal else keep
    keep = keep if mask is None else keep & mask
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - torch.where(lse == -math.inf, torch.zeros_like(lse), lse)[..., None])
    return w @ v, lse
''', ex(TA, "visible", "memory")),
    (TA, "correct: FlashAttention-1's order (keys outside), multiply and sum", '''
def tiled_attention(q, k, v, mask=None, causal=False, block_q=64, block_k=64):
    if block_q < 1 or block_k < 1:
        raise ValueError("tiles")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2] or (mask is not None and mask.dtype != torch.bool):
        raise ValueError("shapes or mask")
    dtype = q.dtype
    q, k, v = (t.float() if dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))  # float32 accumulators
    *lead, Tq, D = q.shape
    Tk, Dv = k.shape[-2], v.shape[-1]
    mask = None if mask is None else mask.expand(*lead, Tq, Tk)
    m = q.new_full((*lead, Tq), -math.inf)
    l = q.new_zeros(*lead, Tq)
    acc = q.new_zeros(*lead, Tq, Dv)
    for j in range(0, Tk, block_k):
        kj, vj = k[..., j:j + block_k, :], v[..., j:j + block_k, :]
        n_k = kj.shape[-2]
        for i in range(0, Tq, block_q):
            qi = q[..., i:i + block_q, :]
            n_q = qi.shape[-2]
            if causal and j > i + n_q - 1:
                continue
            s = (qi[..., :, None, :] * kj[..., None, :, :]).sum(-1) / math.sqrt(D)
            ok = torch.ones(n_q, n_k, dtype=torch.bool)
            if causal:
                ok = (torch.arange(n_q)[:, None] + i) >= (torch.arange(n_k)[None, :] + j)
            if mask is not None:
                ok = ok & mask[..., i:i + n_q, j:j + n_k]
            s = torch.where(ok, s, torch.full_like(s, -math.inf))
            mi, li, ai = m[..., i:i + n_q], l[..., i:i + n_q], acc[..., i:i + n_q, :]
            new = torch.maximum(mi, s.amax(-1))
            safe = torch.where(new == -math.inf, torch.zeros_like(new), new)
            p = torch.exp(s - safe[..., None])
            scale = torch.exp(mi - safe)
            acc[..., i:i + n_q, :] = ai * scale[..., None] + (p[..., None] * vj[..., None, :, :]).sum(-2)
            l[..., i:i + n_q] = li * scale + p.sum(-1)
            m[..., i:i + n_q] = new
    seen = l > 0
    out = torch.where(seen[..., None], acc / torch.where(seen, l, torch.ones_like(l))[..., None], torch.zeros_like(acc))
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), torch.full_like(l, -math.inf))
    return out.to(dtype), lse.to(dtype)
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {OS, MP, TA}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 3


@pytest.mark.parametrize("exercise", [OS, MP, TA])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


@pytest.mark.parametrize("cell,bug,says", [
    (f"{OS}-masked", mutate(OS, ("if x.shape[:-1] != m.shape:", "if False:")), "should raise ValueError (a block's rows"),
    (f"{MP}-empty", mutate(MP, ("if lses.shape != outs.shape[:-1]:", "if False:")), "expected ValueError (lses is outs without"),
    (f"{TA}-tiles", mutate(TA, ("if mask.dtype != torch.bool:", "if False:")), "a float mask: expected ValueError"),
])
def test_a_missing_value_error_is_named_whatever_the_code_raises_instead(cell, bug, says):
    """Without its check the learner's code fails deeper (a broadcast RuntimeError, ~ on a float TypeError): the failure
    says which ValueError was expected, then what was raised, not the raw error alone."""
    message = HARNESS.failure_message(cell, bug)
    assert says in message and ("got RuntimeError" in message or "got TypeError" in message), message
