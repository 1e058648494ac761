"""Visible checks of chapter 06 (decoding strategies), with independent float64 oracles.

Oracles: softmax / sort / cumsum formulas in float64 written here, and a toy "model" that is a
lookup table (the next token's logits depend on the last token only), so the expected greedy text is
known by construction; never course_lib.decoding.
"""
from __future__ import annotations

import math

import torch

from .core import assert_close, assert_shape, assert_tensor, fail, passed

__all__ = ["check_apply_temperature", "check_top_k_filter", "check_top_p_filter", "check_apply_repetition_penalty",
           "check_greedy_search", "check_beam_search", "table_model", "greedy_table_oracle", "table_gpt",
           "brute_force_beam_target", "random_sharp_gpt", "TRAP_PROBS", "beam_difference", "EARLY_STOPPING_RULES"]



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


def table_gpt(table: torch.Tensor, block_size: int = 32):
    """A course GPT whose next-token log-probabilities are log_softmax(table[last token]): (V, V) -> GPT (eval).

    It runs wherever a GPT does (``model(idx)``, chapter 05's ``cached_forward`` with a KV cache and an
    attention mask): one block whose output projections are zero, no position embedding, tokens embedded as
    [e_v, -e_v], whose final LayerNorm is a fixed multiple s of the embedding, and an untied head holding
    table.T / s. So the best continuation of a prompt is known by brute force (``brute_force_beam_target``).
    """
    from ..gpt import GPT, GPTConfig  # the model class only: the oracle is the table

    V = table.shape[0]
    model = GPT(GPTConfig(vocab_size=V, block_size=block_size, n_layer=1, n_head=1, n_embd=2 * V)).eval()
    scale = 1.0 / math.sqrt(1.0 / V + model.transformer.ln_f.eps)  # LayerNorm of [e_v, -e_v]: scale * [e_v, -e_v]
    model.lm_head = torch.nn.Linear(2 * V, V, bias=False)
    with torch.no_grad():
        for module in (model.transformer.h[0].attn.c_proj, model.transformer.h[0].mlp.c_proj):
            module.weight.zero_()
            module.bias.zero_()
        model.transformer.wpe.weight.zero_()
        eye = torch.eye(V)
        model.transformer.wte.weight.copy_(torch.cat([eye, -eye], dim=1))
        model.lm_head.weight.copy_(torch.cat([table.T.float() / scale, torch.zeros(V, V)], dim=1))
    return model


def brute_force_beam_target(table: torch.Tensor, prompt: list, max_new_tokens: int, eos: int | None,
                            length_penalty: float = 1.0):
    """The best continuation of `prompt` under table_gpt(table), by enumerating every one, in float64.

    A continuation ends at its first eos or after max_new_tokens tokens, and is ranked by its summed
    log-probability / (its length) ** length_penalty (the prompt not counted). Returns (tokens, score).
    Beam search returns this when its beams hold every prefix and nothing stops it early (early_stopping="never").
    """
    log_p = table.double().log_softmax(-1).tolist()
    best = (-math.inf, None)
    stack = [([], 0.0)]
    while stack:
        tokens, score = stack.pop()
        if tokens and (tokens[-1] == eos or len(tokens) == max_new_tokens):
            ranked = score / len(tokens) ** length_penalty
            if ranked > best[0]:
                best = (ranked, tokens)
            continue
        last = (prompt + tokens)[-1]
        stack.extend((tokens + [v], score + log_p[last][v]) for v in range(len(log_p)))
    return best[1], best[0]


#: the trap of check_beam_search: after the prompt [0], token 1 is the likeliest (greedy takes it), but the
#: text goes on badly after it; token 2, a little less likely, is followed by EOS (4) almost surely.
TRAP_PROBS = torch.tensor([[0.01, 0.50, 0.45, 0.02, 0.02],
                           [0.30, 0.25, 0.25, 0.15, 0.05],
                           [0.01, 0.01, 0.01, 0.02, 0.95],
                           [0.20, 0.20, 0.20, 0.20, 0.20],
                           [0.20, 0.20, 0.20, 0.20, 0.20]], dtype=torch.float64)


def _result(out, name: str, B: int):
    if not (isinstance(out, tuple) and len(out) == 2):
        fail(f"{name} should return a tuple (sequences (B, T + n), scores (B,)), got {type(out).__name__}")
    sequences, scores = out
    assert_tensor(sequences, f"the sequences of {name}")
    assert_tensor(scores, f"the scores of {name}")
    if sequences.dim() != 2 or sequences.shape[0] != B or tuple(scores.shape) != (B,):
        fail(f"{name} returned sequences {tuple(sequences.shape)} and scores {tuple(scores.shape)}: expected "
             f"({B}, T + n) and ({B},)")
    return sequences, scores


def _hf_beams(model, x, mask, max_new_tokens, **kwargs):
    from ..hf import to_hf  # transformers is imported on first use only

    theirs = to_hf(model).generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, **kwargs)
    return theirs.sequences, theirs.sequences_scores


def random_sharp_gpt(seed: int, vocab_size: int = 13):
    """A small random course GPT whose distributions are sharp enough for EOS and repeats to happen (eval mode)."""
    from ..gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.mul_(20)
    return model


def _check_score(score: float, expected: float, n: int, prompt_len: int, name: str) -> None:
    """The score of a best sequence of n generated tokens (length_penalty 1): expected, not its sum over prompt + n."""
    total = expected * n
    if abs(score - total / (prompt_len + n)) < 1e-4:
        fail(f"{name} returned the score {score:.4f} = {total:.4f} / {prompt_len + n}: the length penalty counts the "
             f"prompt; divide by the number of GENERATED tokens, {n} (expected {expected:.4f})")
    if abs(score - expected) > 1e-4:
        fail(f"{name} returned the score {score:.4f}, expected {expected:.4f}: the summed log-probability of the "
             "generated tokens divided by their number ** length_penalty")


#: what each early_stopping value means (Hugging Face's), for the messages that find one treated as another
EARLY_STOPPING_RULES = {
    False: "early_stopping=False: a row stops when its best running beam, scored at its CURRENT length, cannot beat its "
           "worst of K finished hypotheses",
    True: "early_stopping=True: a row stops as soon as it has K finished hypotheses",
    "never": "early_stopping=\"never\": a row stops only when its best running beam, scored at the LONGEST length it can "
             "reach (max_new_tokens generated, when length_penalty > 0), cannot beat its worst of K finished hypotheses",
}


def beam_difference(ours, theirs, prompt_len: int) -> str:
    """Where beam search's sequences `ours` first differ from `theirs` (both (B, T + n)), in a few words."""
    if not isinstance(ours, torch.Tensor) or ours.dim() != 2 or ours.shape[0] != theirs.shape[0]:
        return f"your sequences are {type(ours).__name__} {tuple(getattr(ours, 'shape', ()))}, expected {tuple(theirs.shape)}"
    width = max(ours.shape[1], theirs.shape[1])
    pad = lambda t: torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), -1)], dim=1)  # noqa: E731 (-1: past the end)
    ours_, theirs_ = pad(ours), pad(theirs)
    rows = (ours_ != theirs_).any(1).nonzero().flatten().tolist()
    if not rows:
        return "the same tokens"
    row = rows[0]
    col = int((ours_[row] != theirs_[row]).nonzero()[0])
    show = lambda v: "(ended)" if v < 0 else str(v)  # noqa: E731
    return (f"row {row} differs from generated token {col - prompt_len} on: yours {show(int(ours_[row, col]))}, "
            f"Hugging Face's {show(int(theirs_[row, col]))} (lengths {ours.shape[1]} and {theirs.shape[1]})")


def _check_early_stopping(beam_search, model, x, mask, eos: int, free) -> None:
    """early_stopping True and "never" on the left-padded batch, against Hugging Face; a result that is the learner's
    own early_stopping=False result gets the rule named. `free`: the learner's result with early_stopping=False."""
    for rule in (True, "never"):
        theirs, _ = _hf_beams(model, x, mask, 10, num_beams=3, eos_token_id=eos, pad_token_id=12, early_stopping=rule)
        ours, _ = _result(beam_search(model, x, 10, 3, eos_token_id=eos, pad_token_id=12, attention_mask=mask,
                                      early_stopping=rule), f"beam_search(..., early_stopping={rule!r})", 2)
        if ours.shape == theirs.shape and torch.equal(ours, theirs):
            continue
        same = " Your result is your early_stopping=False one: is the rule ignored?" if torch.equal(ours, free) else ""
        fail(f"early_stopping={rule!r} on the left-padded batch: {beam_difference(ours, theirs, x.shape[1])}.{same} "
             f"{EARLY_STOPPING_RULES[rule]}. Yours: {ours.tolist()}; Hugging Face's: {theirs.tolist()}")


def _diagnose_batch(beam_search, model, x, mask, row: int, eos: int) -> str:
    """Which part of beam search makes `row` of the batch differ from Hugging Face: the row alone without padding
    and without EOS (the search itself), alone with EOS (the finished hypotheses and the stopping rule), alone
    with its padding (the attention mask), or only in the batch (rows that affect each other)."""
    def differs(prompt, prompt_mask, **kwargs):
        ours = beam_search(model, prompt, 10, 3, pad_token_id=12, attention_mask=prompt_mask, **kwargs)[0]
        theirs = _hf_beams(model, prompt, torch.ones_like(prompt) if prompt_mask is None else prompt_mask, 10,
                           num_beams=3, pad_token_id=12, **kwargs)[0]
        return not (isinstance(ours, torch.Tensor) and ours.shape == theirs.shape and torch.equal(ours, theirs))

    alone = x[row:row + 1, mask[row].bool()]  # the row's real tokens, no padding
    if differs(alone, None):
        return (f"The row alone ({alone[0].tolist()}, no padding) and without any EOS already differs: the search "
                "itself. Each step must rank all K x V candidates of the row at once (one top-k over the flattened "
                "K * V scores, not per beam), and each survivor must carry its own history: reorder the sequences and "
                "the cache rows (cache.reorder(rows)) by the beam each kept candidate came from.")
    if differs(alone, None, eos_token_id=eos):
        return (f"The row alone ({alone[0].tolist()}, no padding) is right without EOS, wrong with eos_token_id={eos}: "
                "the finished hypotheses. Only candidates among the best K of a step that end with EOS become "
                "hypotheses, and they do not run on as beams; hypotheses are ranked by score / (generated tokens) ** "
                "length_penalty; a row stops by the early_stopping rule and takes no hypotheses after it stopped.")
    if differs(x[row:row + 1], mask[row:row + 1], eos_token_id=eos):
        return ("The row alone is right without padding, wrong with its left padding and attention mask: pass the "
                "mask to the model (cached_forward(model, idx, cache, mask), the mask growing by a 1 per step) so "
                "that padding is not attended to and positions count real tokens only.")
    return ("The row gets Hugging Face's result alone (padded or not), but not in a batch: the rows affect each "
            "other. Each row keeps its own finished hypotheses and stops by its own early_stopping rule; a row that has "
            "stopped takes no more hypotheses while the others go on, and the loop ends only when every row has stopped.")


def check_beam_search(beam_search) -> None:
    """A trap greedy falls into (the best sequence known by brute force), the length penalty over the generated
    tokens only, and Hugging Face's generate(num_beams=3) on a random GPT with a left-padded batch and EOS, with
    early_stopping False, True and "never"."""
    model, eos = table_gpt(TRAP_PROBS.log().float()), 4
    prompt = torch.tensor([[0]])
    target, target_score = brute_force_beam_target(TRAP_PROBS.log(), [0], 3, eos, 1.0)
    name = "beam_search(trap model, [[0]], max_new_tokens=3, num_beams=2, eos_token_id=4)"
    sequences, scores = _result(beam_search(model, prompt, 3, 2, eos_token_id=eos), name, 1)
    got = sequences[0, 1:].tolist()
    if got[:len(target)] != target:
        greedy = [1]
        fail(f"{name} returned {got}, but the best sequence is {target} (0.45 x 0.95, length-penalised score "
             f"{target_score:.4f}): greedy's first token is 1 (0.5), a dead end." +
             (" Your beams never left greedy's path: rank the K x V candidates of ALL beams together (one top-k over "
              "the flattened K * V scores, not per beam), and let only one of the K copies of the prompt expand at "
              "the first step (give the others a score of -inf), or the K beams are K copies of one sequence."
              if got[:1] == greedy else ""))
    if got[len(target):] and set(got[len(target):]) != {eos}:
        fail(f"{name} returned {got}: after the EOS that ends it, a sequence holds pad_token_id (default: the EOS id)")
    _check_score(scores[0].item(), target_score, len(target), 1, name)

    long_prompt = torch.tensor([[3, 3, 3, 3, 3, 3, 0]])  # the last token decides the table model's next one
    name = "beam_search(trap model, a prompt of 7 tokens ending in 0, 3, num_beams=2, eos_token_id=4)"
    sequences, scores = _result(beam_search(model, long_prompt, 3, 2, eos_token_id=eos), name, 1)
    _check_score(scores[0].item(), target_score, len(target), 7, name)
    if sequences[0, 7:].tolist()[:len(target)] != target:
        fail(f"{name} returned {sequences[0, 7:].tolist()} with score {scores[0].item():.4f}, expected {target} "
             f"with {target_score:.4f} (the same as after the prompt [0]: only the last token matters here)")

    model = random_sharp_gpt(62)
    x = torch.tensor([[9, 9, 5, 1, 7, 2], [4, 8, 3, 0, 11, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    hf_free, _ = _hf_beams(model, x, mask, 10, num_beams=3, pad_token_id=12)
    eos = int(hf_free[1, 8])  # a token the search meets: an EOS that ends some hypotheses
    theirs, their_scores = _hf_beams(model, x, mask, 10, num_beams=3, eos_token_id=eos, pad_token_id=12)
    name = (f"beam_search(random GPT, a left-padded batch of 2, 10, num_beams=3, eos_token_id={eos}, pad_token_id=12, "
            "attention_mask=mask)")
    sequences, scores = _result(beam_search(model, x, 10, 3, eos_token_id=eos, pad_token_id=12, attention_mask=mask),
                                name, 2)
    for row in range(2):
        if sequences.shape != theirs.shape or not torch.equal(sequences[row], theirs[row]):
            fail(f"{name}: row {row} is {sequences[row].tolist()}, Hugging Face's generate gives "
                 f"{theirs[row].tolist()}. {_diagnose_batch(beam_search, model, x, mask, row, eos)}")
    assert_close(scores, their_scores, f"the scores of {name} (Hugging Face's sequences_scores)", rtol=1e-4, atol=1e-4)
    _check_early_stopping(beam_search, model, x, mask, eos, sequences)
    passed("beam_search")
