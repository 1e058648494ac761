"""Visible checks of chapter 06 (decoding strategies), with independent float64 oracles.

Oracles: softmax / sort / cumsum formulas in float64 written here, and a toy "model" that is a
lookup table (the next token's logits depend on the last token only), so the expected greedy text is
known by construction; never course_lib.decoding.
"""
from __future__ import annotations

import torch

from .core import assert_close, assert_shape, assert_tensor, fail, passed

__all__ = ["check_apply_temperature", "check_top_k_filter", "check_top_p_filter", "check_apply_repetition_penalty",
           "check_greedy_search", "check_beam_search_step", "table_model", "greedy_table_oracle"]



def _kept(result, name: str) -> torch.Tensor:
    result = assert_tensor(result, name)
    if torch.isnan(result).any():
        fail(f"{name} contains NaN at {torch.isnan(result).nonzero()[0].tolist()}")
    return torch.isfinite(result)


def check_apply_temperature(apply_temperature) -> None:
    """softmax(z / tau) against float64 for tau in (0.5, 1, 2); tau = 0 gives the argmax, tau < 0 raises."""
    logits = torch.tensor([[2.0, 1.4, 1.1, 1.0, 0.8, 0.2, 0.1], [-1.0, 0.5, 3.0, 0.0, -2.0, 1.0, 0.25]])
    for tau in (0.5, 1.0, 2.0):
        out = assert_tensor(apply_temperature(logits.clone(), tau), f"apply_temperature(logits, {tau})")
        assert_shape(out, (2, 7), f"apply_temperature(logits (2, 7), {tau})")
        expected = torch.softmax(logits.double() / tau, dim=-1)
        if tau != 1.0 and torch.allclose(torch.softmax(out.double(), -1), torch.softmax(logits.double() * tau, -1)):
            fail(f"apply_temperature(logits, {tau}) multiplies the logits by the temperature: divide them by it "
                 "(tau < 1 must sharpen the distribution, tau > 1 flatten it)")
        if tau != 1.0 and torch.equal(out, logits):
            fail(f"apply_temperature(logits, {tau}) returned the logits unchanged: divide them by the temperature")
        if (out >= 0).all() and torch.allclose(out.double().sum(-1), torch.ones(2, dtype=torch.float64)):
            fail(f"apply_temperature(logits, {tau}) returned rows summing to 1: those are probabilities; return logits, "
                 "logits / tau (the sampler applies the softmax)")
        assert_close(torch.softmax(out.double(), dim=-1), expected, f"softmax of your output for temperature {tau} "
                     f"(expected p(token 0) = {expected[0, 0].item():.4f})", rtol=1e-5, atol=1e-6)
    out = apply_temperature(logits.clone(), 0.0)
    probs = torch.softmax(out.double(), dim=-1)
    if torch.isnan(probs).any():
        fail("temperature 0 gave NaN probabilities: 0 is the limit tau -> 0 (all mass on the argmax), not z / 0")
    if torch.isfinite(out).all() and not torch.allclose(probs, torch.nn.functional.one_hot(logits.argmax(-1), 7).double()):
        fail(f"temperature 0 returned {out[0].tolist()} for row 0: return logits whose softmax is one-hot, 0 at the "
             "maximum and -inf elsewhere (a 1/0 one-hot is probabilities, and its softmax is not one-hot)")
    assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 7).double(),
                 "softmax of your output for temperature 0 (one-hot on the argmax)")
    is_max = logits == logits.amax(-1, keepdim=True)
    if not ((out[is_max] == 0).all() and torch.isneginf(out[~is_max]).all()):
        fail(f"temperature 0 returned {out[0].tolist()} for row 0: its softmax is one-hot, but return exactly 0 at the "
             "maximum and -inf elsewhere (dividing by a tiny temperature gives huge finite logits instead)")
    try:
        apply_temperature(logits, -1.0)
    except ValueError:
        pass
    else:
        fail("apply_temperature(logits, -1.0) should raise ValueError (temperature must be >= 0)")
    passed("apply_temperature")


def check_top_k_filter(top_k_filter) -> None:
    """Keeps the k largest logits unchanged (ties with the k-th kept), -inf elsewhere; k > V keeps all."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 3.0, 0.0], [1.0, 1.0, 1.0, 0.0, -2.0, 4.0]])
    out = assert_tensor(top_k_filter(logits.clone(), 2), "top_k_filter(logits, 2)")
    assert_shape(out, (2, 6), "top_k_filter(logits (2, 6), 2)")
    kept = _kept(out, "top_k_filter(logits, 2)")
    if kept.all() and (out >= 0).all() and torch.allclose(out.double().sum(-1), torch.ones(2, dtype=torch.float64)):
        fail(f"top_k_filter(logits, 2) returned rows summing to {out.sum(-1).tolist()}: they look like probabilities, "
             "not logits: return the input logits, with -inf for the filtered tokens")
    expected = torch.tensor([[False, True, False, False, True, False], [True, True, True, False, False, True]])
    if kept.all() and (out[~expected] == 0).all():
        fail("top_k_filter(logits, 2) set the filtered tokens to 0: a logit of 0 still has probability after the "
             "softmax; set them to -inf")
    if not torch.equal(kept, expected):
        fail(f"top_k_filter(logits, 2) keeps {kept.int().tolist()}, expected {expected.int().tolist()} "
             f"(row 1 has three logits tied at the 2nd largest value 1.0: all three are kept)")
    assert_close(out[kept], logits[kept], "the kept entries (they must be the original logits, not probabilities)")
    try:
        out = top_k_filter(logits.clone(), 10)
    except NotImplementedError:
        raise
    except (RuntimeError, IndexError) as error:
        fail(f"top_k_filter(logits, 10) with only V = 6 tokens raised {type(error).__name__} ({error}): a k larger "
             "than the vocabulary keeps every token; clamp k to V (torch.topk refuses k > V)")
    assert_close(out, logits, "top_k_filter(logits, 10) with only 6 tokens (everything is kept)")
    passed("top_k_filter")


def check_top_p_filter(top_p_filter) -> None:
    """The smallest most-probable set with mass >= p, crossing token included, in vocabulary order."""
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    logits = probs.log().float()
    cases = [(0.6, [[False, True, False, True], [False, False, True, True]]),
             (0.9, [[False, True, True, True], [False, True, True, True]]),
             (0.01, [[False, True, False, False], [False, False, False, True]])]
    for p, expected in cases:
        out = assert_tensor(top_p_filter(logits.clone(), p), f"top_p_filter(logits, {p})")
        kept = _kept(out, f"top_p_filter(logits, {p})")
        if kept.tolist() != expected:
            counts, wanted = kept.sum(-1).tolist(), torch.tensor(expected).sum(-1).tolist()
            if 0 in counts:
                fail(f"top_p_filter(logits, {p}) keeps no token in row {counts.index(0)}: the most probable token is "
                     "always kept (the mass before it is 0 < p), however small p")
            if counts == wanted:
                fail(f"top_p_filter(logits, {p}) keeps the right number of tokens per row, {counts}, but the wrong ones "
                     f"({kept.int().tolist()}, expected {[[int(b) for b in r] for r in expected]}): put the mask back "
                     "in vocabulary order (scatter it with the indices of the sort) before filtering the logits")
            mass = (probs * kept).sum(-1).tolist()
            fail(f"top_p_filter(logits, {p}) keeps {kept.int().tolist()} (mass {[round(m, 3) for m in mass]}), "
                 f"expected {[[int(b) for b in r] for r in expected]}: sort by probability, keep tokens until the "
                 f"running mass reaches p, the token that crosses p included")
        assert_close(out[kept], logits[kept], f"the kept logits of top_p_filter(logits, {p})")
    passed("top_p_filter")


def check_apply_repetition_penalty(apply_repetition_penalty) -> None:
    """Divide positive, multiply negative logits of the tokens seen, once each; others unchanged."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [1.0, 1.0, -2.0, 0.0, 4.0]])
    ids = torch.tensor([[0, 1, 1, 1], [4, 2, 2, 4]])
    out = apply_repetition_penalty(logits.clone(), ids, 2.0)
    assert_shape(out, (2, 5), "apply_repetition_penalty(logits (2, 5), ids (2, 4), 2.0)")
    expected = torch.tensor([[1.0, -2.0, 0.5, -3.0, 1.0], [1.0, 1.0, -4.0, 0.0, 2.0]])
    for b, v in ((0, 1), (1, 2)):
        if out[b, v] > logits[b, v]:
            fail(f"row {b}, token {v}: the negative logit {logits[b, v].item()} became {out[b, v].item():.4f}: "
                 "dividing a negative logit by the penalty RAISES it; multiply negative logits instead")
    if abs(out[0, 1].item() - expected[0, 1].item()) > 1e-6 and abs(out[0, 1].item() + 8.0) < 1e-4:
        fail("row 0, token 1 occurs 3 times and its logit -1.0 became -8.0 = -1.0 * 2 ** 3: a token is penalised once, "
             "however often it occurs (expected -2.0)")
    if out[0, 4].item() != logits[0, 4].item() or out[1, 0].item() != logits[1, 0].item():
        fail(f"row 0's token 4 ({logits[0, 4].item()} -> {out[0, 4].item():.4g}) or row 1's token 0 "
             f"({logits[1, 0].item()} -> {out[1, 0].item():.4g}) changed, but each occurs only in the OTHER row's "
             "history: penalise each row by its own input_ids only")
    assert_close(out, expected, "apply_repetition_penalty(logits, ids, 2.0) (token 1 of row 0 occurs 3 times, "
                 "penalised once: -1.0 -> -2.0)")
    passed("apply_repetition_penalty")


def table_model(table: torch.Tensor):
    """A toy language model: the logits of the next token are table[last token]. model(idx) -> (logits, None)."""
    def model(idx):
        return table[idx], None
    return model


def greedy_table_oracle(table: torch.Tensor, prompt: torch.Tensor, max_new_tokens: int, eos=None, pad=None) -> torch.Tensor:
    """Greedy text of table_model(table), one row at a time in plain Python."""
    rows = []
    for row in prompt.tolist():
        out, done = list(row), False
        for _ in range(max_new_tokens):
            nxt = pad if done else int(table[out[-1]].argmax())
            out.append(nxt)
            done = done or (eos is not None and nxt == eos)
        rows.append(out)
    return torch.tensor(rows)


def _greedy_until_all_finished(table, prompt, max_new_tokens, eos, pad) -> torch.Tensor:
    """The oracle's text, cut where the last row has produced its EOS (the loop stops there)."""
    expected = greedy_table_oracle(table, prompt, max_new_tokens, eos=eos, pad=pad)
    T = prompt.shape[1]
    done = [(r == eos).nonzero() for r in expected[:, T:]]
    if all(len(d) for d in done):
        return expected[:, :T + max(int(d[0]) for d in done) + 1]
    return expected


def check_greedy_search(greedy_search) -> None:
    """Greedy against a lookup-table model: argmax text, per-row EOS, finished rows padded (pad_token_id, else EOS),
    early stop, an EOS in the prompt finishes nothing."""
    g = torch.Generator().manual_seed(60)
    table = torch.randn(8, 8, generator=g)
    model = table_model(table)
    prompt = torch.tensor([[1, 2], [3, 4], [5, 6]])
    out = assert_tensor(greedy_search(model, prompt, 6), "greedy_search(model, prompt (3, 2), 6)")
    expected = greedy_table_oracle(table, prompt, 6)
    assert_shape(out, (3, 8), "greedy_search(model, prompt (3, 2), 6) without EOS")
    if not torch.equal(out, expected):
        fail(f"greedy_search without EOS gave {out.tolist()}, expected the argmax text {expected.tolist()}: greedy "
             "appends the argmax of the LAST position's logits at every step, and never samples")
    eos = int(expected[0, 3])  # row 0 emits it at its 2nd new token
    out = greedy_search(model, prompt, 6, eos_token_id=eos, pad_token_id=eos)
    expected = _greedy_until_all_finished(table, prompt, 6, eos, eos)
    if out.shape[0] == expected.shape[0] and out.shape[1] > expected.shape[1] \
            and torch.equal(out[:, :expected.shape[1]], expected):
        fail(f"greedy_search with eos_token_id={eos}, pad_token_id={eos} went on to {out.shape[1]} tokens after every "
             f"row had finished at {expected.shape[1]}: stop the loop as soon as all rows have produced EOS")
    if out.shape != expected.shape or not torch.equal(out, expected):
        fail(f"greedy_search with eos_token_id={eos}, pad_token_id={eos} gave {out.tolist()}, expected "
             f"{expected.tolist()} (a row that produced EOS emits padding; the other rows go on)")
    pad = 0  # a pad that is not EOS: finished rows must emit it, not EOS
    out = greedy_search(model, prompt, 6, eos_token_id=eos, pad_token_id=pad)
    expected = _greedy_until_all_finished(table, prompt, 6, eos, pad)
    if not (out.shape == expected.shape and torch.equal(out, expected)):
        as_eos = _greedy_until_all_finished(table, prompt, 6, eos, eos)
        hint = (f"your finished rows emit EOS ({eos}), not pad_token_id: is pad_token_id ignored?"
                if out.shape == as_eos.shape and torch.equal(out, as_eos) else
                "a finished row emits pad_token_id at every later step")
        fail(f"greedy_search with eos_token_id={eos}, pad_token_id={pad} gave {out.tolist()}, expected "
             f"{expected.tolist()}: {hint}")
    out = greedy_search(model, prompt, 6, eos_token_id=eos)
    expected = _greedy_until_all_finished(table, prompt, 6, eos, eos)
    if not (out.shape == expected.shape and torch.equal(out, expected)):
        fail(f"greedy_search with eos_token_id={eos} and no pad_token_id gave {out.tolist()}, expected "
             f"{expected.tolist()}: pad_token_id=None means pad with eos_token_id ({eos}), not with 0 or any other "
             "token")
    eos_prompt = torch.tensor([[eos, 2], [3, 4], [5, 6]])  # row 0's prompt holds EOS: it still generates
    out = greedy_search(model, eos_prompt, 6, eos_token_id=eos, pad_token_id=pad)
    expected = _greedy_until_all_finished(table, eos_prompt, 6, eos, pad)
    if not (out.shape == expected.shape and torch.equal(out, expected)):
        fail(f"greedy_search with eos_token_id={eos}, pad_token_id={pad} and the prompt {eos_prompt.tolist()} gave "
             f"{out.tolist()}, expected {expected.tolist()}: an EOS already in the prompt does not finish a row, "
             "only a generated EOS does (start with no row finished)")
    passed("greedy_search")


def check_beam_search_step(beam_search_step) -> None:
    """Top candidates over all beams x tokens (flattened), beam and token recovered, generated-length penalty."""
    g = torch.Generator().manual_seed(61)
    log_probs = torch.randn(2, 3, 5, generator=g).double().log_softmax(-1).float()
    beam_scores = torch.tensor([[-1.0, -1.5, -4.0], [-0.5, -0.6, -0.7]])
    result = beam_search_step(log_probs, beam_scores, 6, 7, 4, 2.0)
    if not isinstance(result, tuple) or len(result) != 4:
        fail("beam_search_step should return a tuple (scores, beam, token, finished_scores)")
    scores, beam, token, finished = result
    for name, index in (("beam", beam), ("token", token)):
        if not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
            fail(f"{name} must be an int64 tensor of indices (flat // V and flat % V of torch.topk's indices), got "
                 f"{index.dtype if isinstance(index, torch.Tensor) else type(index).__name__}")
    total = (beam_scores[:, :, None].double() + log_probs.double()).reshape(2, 15)
    best = total.sort(dim=-1, descending=True)
    assert_shape(scores, (2, 6), "scores (B, num_candidates)")
    assert_close(scores, best.values[:, :6].float(), "scores: the 6 best of beam_scores + log_probs over all 3 x 5 "
                 "(beam, token) pairs, best first")
    assert_close(beam.double(), (best.indices[:, :6] // 5).double(), "beam: the beam of each candidate (index // V)")
    assert_close(token.double(), (best.indices[:, :6] % 5).double(), "token: the token of each candidate (index % V)")
    assert_close(finished, (best.values[:, :6] / (7 + 1 - 4) ** 2.0).float(),
                 "finished_scores with cur_len 7, prompt_len 4, length_penalty 2 (divide by (7 + 1 - 4) ** 2 = 16)")
    passed("beam_search_step")

