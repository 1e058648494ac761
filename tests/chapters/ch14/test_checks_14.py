"""Chapter 14's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import checks, tiled
from tests.helpers import mutant


def variant(function, *replacements):
    """The reference `function` with each (old, new) replacement applied to its source."""
    namespace = {"torch": torch, "math": math}
    return mutant(function, *replacements, namespace=namespace)


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_online_softmax(tiled.online_softmax)
    checks.check_merge_partials(tiled.merge_partials)
    checks.check_tiled_attention(tiled.tiled_attention)
    assert capsys.readouterr().out.count("all visible checks passed") == 3


OS_SUM = "l = l * torch.exp(m - m_safe) + torch.exp(x - m_safe[..., None]).sum(-1)"
TA_ACC = "acc = acc * alpha[..., None] + p @ v[..., j:j + n_k, :]"
TA_SAFE = "m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # no key seen yet: nothing to rescale, no NaN"
TA_KEEP = "keep = torch.arange(i, i + n_q, device=q.device)[:, None] >= torch.arange(j, j + n_k, device=q.device)"


def full_scores(q, k, v, mask=None, causal=False, block_q=64, block_k=64):
    """Correct values, no tiles: the whole score matrix at once."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    keep = torch.ones(Tq, Tk, dtype=torch.bool).tril() if causal else torch.ones(Tq, Tk, dtype=torch.bool)
    keep = keep if mask is None else keep & mask
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return (w @ v).nan_to_num(), lse


def no_max_online(blocks):
    l = m = None
    for x in blocks:
        m = x.amax(-1) if m is None else torch.maximum(m, x.amax(-1))
        l = torch.exp(x).sum(-1) if l is None else l + torch.exp(x).sum(-1)
    return m, l / torch.exp(m)


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_online_softmax, variant(tiled.online_softmax, (OS_SUM, "l = l + torch.exp(x - m_safe[..., None]).sum(-1)")),
     "the running sum is not rescaled"),
    (checks.check_online_softmax, variant(tiled.online_softmax, ("m_new = torch.maximum(m, x.amax(-1))", "m_new = m"),
                                          ("        m = m_new\n", "        m = torch.maximum(m, x.amax(-1))\n")),
     "Is the max updated after the sum"),
    (checks.check_online_softmax, variant(tiled.online_softmax, ("m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)", "m_safe = m_new")),
     "NaN for a row that is -inf everywhere"),
    (checks.check_online_softmax, no_max_online, "exp\\(1000\\) overflows"),
    (checks.check_online_softmax, lambda blocks: (lambda x: (x.amax(-1), torch.exp(x - x.amax(-1, keepdim=True)).sum(-1)))(blocks[0]),
     "blocks is an iterable read once"),
    (checks.check_merge_partials, lambda outs, lses: (outs.mean(0), torch.logsumexp(lses, 0)), "plain average"),
    (checks.check_merge_partials, lambda outs, lses: ((torch.exp(lses)[..., None] * outs).sum(0), torch.logsumexp(lses, 0)),
     "is not normalised"),
    (checks.check_merge_partials, variant(tiled.merge_partials, ("return terms.sum(0), lse", "return terms.sum(0), lses.max(0).values")),
     "lse is the largest partial lse"),
    (checks.check_merge_partials, lambda outs, lses: (((torch.exp(lses) / torch.exp(lses).sum(0))[..., None] * outs).sum(0),
                                                     torch.log(torch.exp(lses).sum(0))), "exp\\(1000\\) overflows"),
    (checks.check_merge_partials, variant(tiled.merge_partials, (
        "torch.where(weights[..., None] > 0, weights[..., None] * outs, torch.zeros_like(outs))", "weights[..., None] * outs")),
     "must contribute nothing"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, (TA_ACC, "acc = acc + p @ v[..., j:j + n_k, :]")),
     "must both be rescaled"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, (TA_KEEP, TA_KEEP.replace(">=", ">"))),
     "each query misses its own key"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, (TA_KEEP, TA_KEEP.replace(">=", ">= -1 +")),
                                           ("if causal and j + n_k - 1 > i:", "if causal:"),
                                           ("last = min(Tk, i + n_q) if causal else Tk", "last = Tk")),
     "one key too many"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, (TA_KEEP, "keep = torch.arange(n_q)[:, None] >= torch.arange(n_k)")),
     "compare global positions"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, (TA_SAFE, "m_safe = m_new")), "a fully masked row"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("p = torch.exp(s - m_safe[..., None])", "p = torch.exp(s - m[..., None])")),
     "is the max updated after the sum"),
    (checks.check_tiled_attention, full_scores, "Nothing may grow with Tq \\* Tk"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("last = min(Tk, i + n_q) if causal else Tk",
                                                                   "last = min(Tk, (i // block_q + 1) * block_k) if causal else Tk")),
     "the loop over key tiles stops too early"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("last = min(Tk, i + n_q) if causal else Tk", "last = Tk")),
     "do not compute it"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("mask = mask.expand(*lead, Tq, Tk)",
                                                                   "mask = mask.expand(*lead, Tq, Tk).contiguous()")),
     "with a \\(B, 1, 1, Tk\\) padding mask: your function created a tensor"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("lse = q.new_full((*lead, Tq), -math.inf)",
                                                                   "lse = torch.full((*lead, Tq), -math.inf, dtype=torch.float64)")),
     "out and lse should have q's dtype"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("k[..., j:j + block_k, :].to(work).transpose(-2, -1)",
                                                                   "k[..., j:j + block_k, :].to(work).permute(3, 2, 1, 0)")),
     "transpose the last two axes only"),
    (checks.check_online_softmax, variant(tiled.online_softmax, ("torch.exp(m - m_safe)", "torch.exp(m_safe - m)")),
     "rescaling factor upside down"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("mask = mask.expand(*lead, Tq, Tk)", "pass")),
     "tiled_attention on a \\(B, 1, 1, Tk\\) padding mask raised"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, (TA_KEEP, TA_KEEP.replace("torch.arange(i, i + n_q,", "torch.arange(i + Tk - Tq, i + n_q + Tk - Tq,")),
                                           ("if causal and j + n_k - 1 > i:", "if causal:"),
                                           ("last = min(Tk, i + n_q) if causal else Tk", "last = max(0, min(Tk, i + n_q + Tk - Tq)) if causal else Tk")),
     "aligned at the bottom right"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype",
                                                                   "work = q.dtype")),
     "running max, sum and accumulator kept in bfloat16"),
    # only the running sum rounded to bfloat16 after each tile: 1.5-1.8 times SDPA's error over 256 keys, below 1.5 for
    # some draws; over 1024 keys (64 tiles) 2.6-3.3
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("l = l * alpha + p.sum(-1)",
                                                                   "l = (l * alpha + p.sum(-1)).to(q.dtype).to(work)")),
     "running max, sum and accumulator kept in bfloat16"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("lse = q.new_full((*lead, Tq), -math.inf)",
                                                                   "lse = torch.full((*lead, Tq), -math.inf, dtype=work)"),
                                           ("torch.full_like(l, -math.inf)).to(q.dtype)", "torch.full_like(l, -math.inf))")),
     "out and lse should have q's dtype \\(bfloat16\\), got torch.bfloat16 and torch.float32"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype",
                                                                   "work = torch.float32 if q.dtype == torch.bfloat16 else q.dtype")),
     "running max, sum and accumulator kept in float16"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("or v.shape[-2] != k.shape[-2]:", ":")),
     "v with more rows than k: expected ValueError"),
    (checks.check_tiled_attention, variant(tiled.tiled_attention, ("if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:", "if False:")),
     "v with more rows than k: expected ValueError"),
])
def test_each_classic_bug_gets_its_message(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)
