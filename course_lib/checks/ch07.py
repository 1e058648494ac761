"""Visible checks of chapter 07 (speculative decoding), and the independent oracles they compare against.

Oracles: the acceptance rule written as one float64 vectorised formula (``speculative_accept_oracle``),
plain greedy decoding by full forward passes of the model (no cache), the rounds of greedy speculative
decoding run by full forward passes (``greedy_rounds_oracle``), and each model's distributions from one
full forward pass; never course_lib.speculative's reference solutions. The learner's loop is observed
through its documented interface only: the ``speculative_accept`` it is given (``AcceptSpy``, which records and
checks every round) and the target's forward passes (``TargetPasses``, a hook on its LM head).
"""
from __future__ import annotations

import traceback

import torch

from .core import CheckFailed, assert_close, fail, greedy_oracle, passed

__all__ = ["check_speculative_accept", "check_speculative_generate", "speculative_accept_oracle", "tiny_gpt_pair",
           "greedy_rounds_oracle", "TargetPasses", "AcceptSpy"]


def speculative_accept_oracle(p, q, draft_tokens, u):
    """(n, next_probs) by formula: n = the number of leading draft tokens with u < p/q; then the normalised
    residual max(0, p[n] - q[n]), or p[K] when n = K. p (K + 1, V), q (K, V), draft_tokens (K,), u (K,)."""
    p, q, u = p.double(), q.double(), u.double()
    K = draft_tokens.shape[0]
    rows = torch.arange(K)
    accepted = u < p[rows, draft_tokens] / q[rows, draft_tokens]  # (K,)
    n = int(accepted.long().cumprod(0).sum()) if K else 0
    if n == K:
        return n, p[K]
    residual = torch.clamp(p[n] - q[n], min=0.0)
    return n, residual / residual.sum()


def _dist(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def _call_accept(fn, p, q, x, u, what):
    result = fn(p, q, torch.tensor(x), torch.tensor(u, dtype=torch.float64))
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"speculative_accept should return a tuple (n, next_probs), got {type(result).__name__} ({what})")
    n, probs = result
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (p.shape[1],):
        fail(f"next_probs should be a tensor of shape (V,) = ({p.shape[1]},), got "
             f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__} ({what})")
    return int(n), probs


def check_speculative_accept(speculative_accept) -> None:
    """Visible checks for chapter 07, exercise 1: the acceptance rule, the residual, the bonus distribution."""
    p = _dist([0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1])
    q = _dist([0.5, 0.5, 0.0, 0.0])
    # token 1: p/q = 0.2/0.5 = 0.4
    n, _ = _call_accept(speculative_accept, p, q, [1], [0.39], "u = 0.39")
    if n != 1:
        fail(f"p = 0.2 and q = 0.5 at the draft token, so p/q = 0.4, and u = 0.39 < 0.4: the token must be accepted "
             f"(n = 1), you returned n = {n}. Accept when u < p/q (are p and q swapped?)")
    n, residual = _call_accept(speculative_accept, p, q, [1], [0.41], "u = 0.41")
    if n != 0:
        fail(f"p/q = 0.4 at the draft token and u = 0.41 >= 0.4: the token must be rejected (n = 0), you returned n = {n}. "
             "Accept only when u < p/q (are p and q swapped?)")
    if (residual.double() < 0).any():
        fail(f"after a rejection your next_probs is {[round(v, 4) for v in residual.double().tolist()]}, with negative "
             "entries: the residual is max(0, p - q), clamped at 0, then divided by its sum")
    if torch.allclose(residual.double(), torch.clamp(q[0] - p[0], min=0) / torch.clamp(q[0] - p[0], min=0).sum()):
        fail("after a rejection your next_probs is max(0, q - p), normalised: the residual is max(0, p - q), the mass "
             "the target wants and acceptance left short (are p and q swapped?)")
    total = residual.double().sum().item()
    if abs(total - 1) > 1e-6:
        fail(f"after a rejection your next_probs sums to {total:.4g}, expected 1: max(0, p - q) = [0, 0, 0.3, 0.4] must "
             "be renormalised (divided by its sum, 0.7)")
    assert_close(residual.double(), _dist(0.0, 0.0, 0.3, 0.4) / 0.7,
                 "your residual for p = [0.1, 0.2, 0.3, 0.4], q = [0.5, 0.5, 0, 0] (expected max(0, p - q) / 0.7)")
    n, _ = _call_accept(speculative_accept, _dist([0.0, 0.5, 0.0, 0.5], [0.25] * 4), _dist([0.25] * 4), [0], [0.0], "p = 0")
    if n != 0:
        fail(f"p = 0 at the draft token: the target never produces it, so it must be rejected whatever u (here u = 0); "
             f"you returned n = {n}. Accept when u < p/q, not q/p")
    n, bonus = _call_accept(speculative_accept, p, _dist([0.25] * 4), [3], [0.999], "all accepted")
    if n != 1:
        fail(f"p = 0.4 > q = 0.25 at the draft token: p/q >= 1, so it is accepted whatever u (here 0.999); you returned n = {n}")
    if not torch.allclose(bonus.double(), p[1]):
        fail(f"all K = 1 draft tokens were accepted, so next_probs must be the target's distribution after them, p[K] = "
             f"{p[1].tolist()} (the bonus token); you returned {[round(v, 4) for v in bonus.double().tolist()]}")
    # random cases against the formula
    gen = torch.Generator().manual_seed(701)
    for case in range(60):
        K, V = 1 + case % 4, 3 + case % 5
        p = torch.softmax(torch.randn(K + 1, V, generator=gen, dtype=torch.float64) * 1.5, -1)
        q = torch.softmax(torch.randn(K, V, generator=gen, dtype=torch.float64) * 1.5, -1)
        x = torch.multinomial(q, 1, generator=gen)[:, 0]
        u = torch.rand(K, generator=gen, dtype=torch.float64)
        n, probs = _call_accept(speculative_accept, p, q, x.tolist(), u.tolist(), f"random case {case}")
        n_exp, probs_exp = speculative_accept_oracle(p, q, x, u)
        if n != n_exp:
            fail(f"random case {case} (K = {K}): the ratios p/q at the draft tokens are "
                 f"{[round(v, 3) for v in (p[torch.arange(K), x] / q[torch.arange(K), x]).tolist()]} and u = "
                 f"{[round(v, 3) for v in u.tolist()]}: expected n = {n_exp} accepted, you returned {n} (n counts the "
                 "draft tokens before the FIRST rejection, in order; later ones are not judged)")
        assert_close(probs.double(), probs_exp, f"next_probs in random case {case} (K = {K}, n = {n})")
    passed("speculative_accept")


def tiny_gpt_pair(seed: int, vocab_size: int = 6, block_size: int = 48):
    """A random 2-layer target and 1-layer draft GPT (course_lib.gpt, chapter 04) sharing a vocabulary, in eval mode."""
    from ..gpt import GPT, GPTConfig  # chapter 04's model: not a chapter 07 solution

    models = []
    for i, layers in enumerate((2, 1)):
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=layers, n_head=2, n_embd=16))
        gen = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.5
                                + (1.0 if "ln" in name and name.endswith("weight") else 0.0))
        models.append(model.eval())
    return tuple(models)




_ORACLE_PASSES = [0]  # > 0 while an oracle runs a model


def _oracle_probs(model, context, do_sample: bool, temperature: float) -> torch.Tensor:
    """(m, V) float64: the distribution of the token after each prefix of context (1, m), by one full forward pass
    (no cache): softmax(logits / temperature), or the one-hot argmax when greedy."""
    _ORACLE_PASSES[0] += 1  # not the learner's: TargetPasses does not count it
    try:
        with torch.no_grad():
            logits = model(context)[0][0].double()
    finally:
        _ORACLE_PASSES[0] -= 1
    if not do_sample:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return torch.softmax(logits / temperature, dim=-1)


def greedy_rounds_oracle(target, draft, prompt, max_new_tokens: int, K: int):
    """(proposed_per_round, accepted_per_round) of greedy speculative decoding, by full forward passes (no cache):
    each round the draft's greedy continuation of k = min(K, r - 1) tokens (r still to generate), kept while it
    agrees with the target's greedy choice, then the target's own choice."""
    tokens, total, proposed, accepted = prompt, prompt.shape[1] + max_new_tokens, [], []
    while tokens.shape[1] < total:
        n = tokens.shape[1]
        k = min(K, total - n - 1)
        guess = greedy_oracle(draft, tokens, k)  # (1, n + k): the draft's greedy proposals
        with torch.no_grad():
            choices = target(guess)[0][0, n - 1:].argmax(-1)  # (k + 1,): the target's choice at each position
        a = 0
        while a < k and int(guess[0, n + a]) == int(choices[a]):
            a += 1
        tokens = torch.cat([tokens, guess[:, n:n + a], choices[a].view(1, 1)], dim=1)
        proposed.append(k)
        accepted.append(a)
    return proposed, accepted


class TargetPasses:
    """Counts a GPT's forward passes and the positions they read (a hook on its lm_head, which every pass,
    cached or not, runs once over its new positions). Use as a context manager."""

    def __init__(self, model):
        self.model, self.calls, self.positions = model, 0, 0

    def _hook(self, module, inputs, output):
        if _ORACLE_PASSES[0]:
            return
        self.calls += 1
        self.positions += inputs[0].shape[-2]

    def __enter__(self):
        self._handle = self.model.lm_head.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


class AcceptSpy:
    """A ``speculative_accept`` for the learner's loop: the course's rule (speculative_accept_oracle), recording
    every call.

    With ``models=(target, draft)``, ``prompt``, ``max_new_tokens``, ``K`` and the sampling settings, it also
    checks each call as it comes, against full forward passes of both models (no cache): the number of
    proposals, p and q. It follows the committed tokens itself, so the next_probs it returns must be one-hot
    (greedy, or ``override(p, n)`` returning one): the round's last token is then known.
    """

    def __init__(self, models=None, prompt=None, max_new_tokens=0, K=0, do_sample=False, temperature=1.0,
                 override=None, what=""):
        self.calls, self.models, self.override, self.what = [], models, override, what
        self.K, self.do_sample, self.temperature = K, do_sample, temperature
        self.tokens = prompt
        self.total = None if prompt is None else prompt.shape[1] + max_new_tokens

    def __call__(self, p, q, draft_tokens, u):
        p, u = torch.as_tensor(p).double(), torch.as_tensor(u).double()
        q, x = torch.as_tensor(q).double(), torch.as_tensor(draft_tokens)
        k = x.shape[0] if x.dim() == 1 else -1
        V = p.shape[-1]
        if x.dim() != 1 or tuple(u.shape) != (k,) or (k and tuple(q.shape) != (k, V)) or p.dim() != 2:
            fail(f"{self.what}: speculative_accept must be called as speculative_accept(p (k + 1, V), q (k, V), "
                 f"draft_tokens (k,), u (k,)) for "
                 f"k proposals; yours passed p {tuple(p.shape)}, q {tuple(q.shape)}, draft_tokens {tuple(x.shape)}, "
                 f"u {tuple(u.shape)}")
        if k and not ((u >= 0) & (u < 1)).all():
            fail(f"{self.what}: u must hold uniform numbers in [0, 1), one per proposal; yours passed {u.tolist()}")
        if self.models is not None:
            self._verify(p, q, x)
        n, probs = speculative_accept_oracle(p, q, x, u) if k else (0, p[0])
        if self.override is not None:
            probs = self.override(p, n)
        self.calls.append((p, q, x, u, n, probs))
        if self.models is not None:
            self.tokens = torch.cat([self.tokens, x[:n].view(1, -1).long(), probs.argmax().view(1, 1)], dim=1)
        return n, probs

    def _probs(self, model, context, temperature=None):
        return _oracle_probs(model, context, self.do_sample, self.temperature if temperature is None else temperature)

    def _verify(self, p, q, x):
        target, draft = self.models
        tokens, r, k = self.tokens, len(self.calls), x.shape[0]
        n, total = tokens.shape[1], self.total
        at = f"{self.what}, round {r + 1} (n = {n} committed tokens, {total - n} still to generate"
        if n >= total:  # the learner's loop is behind the committed tokens
            self._explain_p(p, None, x, f"{self.what}, round {r + 1} (your loop went on after all new tokens were there")
        context = torch.cat([tokens, x.view(1, -1).long()], dim=1)
        want_p = self._probs(target, context)[n - 1:]  # (k + 1, V)
        if tuple(p.shape) != tuple(want_p.shape) or not torch.allclose(p, want_p, atol=1e-4, rtol=0):
            self._explain_p(p, want_p, x, at)
        if k != min(self.K, total - n - 1):
            fail(f"{at}): it proposed k = {k} tokens, expected min(K, r - 1) = {min(self.K, total - n - 1)}: K = {self.K} "
                 "unless fewer fit (a round adds its kept proposals plus one token, so with r tokens to go it proposes "
                 "at most r - 1; none are wasted, none go past the end)")
        if k:
            want_q = self._probs(draft, context)[n - 1:n - 1 + k]  # (k, V)
            if not torch.allclose(q, want_q, atol=1e-4, rtol=0):
                if self.do_sample and torch.allclose(q, self._probs(draft, context, 1.0)[n - 1:n - 1 + k], atol=1e-4, rtol=0):
                    fail(f"{at}): the q you passed to speculative_accept ignores the temperature: it is the draft's "
                         f"distribution at temperature 1, not at {self.temperature:g}. The contract samples both models "
                         "at the temperature asked, probs_from_logits(logits, do_sample, temperature): draw the proposals "
                         "from that q and pass it. (A draft sampled at temperature 1 and reported as such would still give "
                         "the target's distribution, since any q does, section 3, but it is not this contract)")
                fail(f"{at}): the q you passed to speculative_accept is not the draft's distribution after the committed "
                     f"tokens and the proposals before each one (full forward passes of the draft disagree by "
                     f"{(q - want_q).abs().max():.3g})" + (": does the draft's cache still hold rejected proposals of an "
                     "earlier round? Roll it back too" if r else ""))

    def _matches(self, p, context, start):
        rows = self._probs(self.models[0], context)[start:]
        return tuple(rows.shape) == tuple(p.shape) and torch.allclose(p, rows, atol=1e-4, rtol=0)

    def _explain_p(self, p, want_p, x, at):
        tokens, k, r = self.tokens, x.shape[0], len(self.calls)
        n, xs = tokens.shape[1], x.view(1, -1).long()
        context = torch.cat([tokens, xs], dim=1)
        if want_p is not None and self.do_sample and self._matches_at_temperature_one(p, context, n - 1):
            fail(f"{at}): the p you passed to speculative_accept ignores the temperature ({self.temperature:g}): "
                 "the target's probabilities are probs_from_logits(logits, do_sample, temperature), as the draft's")
        for shift in (-1, 1) if want_p is not None else ():  # p one position early or late
            lo = n - 1 + shift
            rows = self._probs(self.models[0], context)
            if (lo >= 0 and lo + k + 1 <= rows.shape[0] and p.shape == rows[lo:lo + k + 1].shape
                    and torch.allclose(p, rows[lo:lo + k + 1], atol=1e-4, rtol=0)):
                fail(f"{at}): the p you passed to speculative_accept is the target's distribution one position too "
                     f"{'early' if shift < 0 else 'late'}: p[i] is the distribution of proposal i's position, from the "
                     "logits of the token before it (the last committed token for p[0]), and p[k] the one after the "
                     "last proposal: the last k + 1 positions of the verification pass")
        if r:
            (_, _, _, _, pa, probs), pk = self.calls[-1], len(self.calls[-1][2])
            if p.shape[0] < k + 1 and any(c[4] == len(c[2]) for c in self.calls):
                fail(f"{at}): p has shape {tuple(p.shape)}, expected (k + 1, V) = ({k + 1}, {p.shape[-1]}): the target "
                     "pass read fewer tokens than it should, as if its cache held a token the text does not. Did a "
                     "round that kept all its proposals add only those? It must add one more token drawn from "
                     "next_probs (then the target's p[k]: the bonus token)")
            if p.shape[0] < k + 1:
                fail(f"{at}): p has shape {tuple(p.shape)}, expected (k + 1, V) = ({k + 1}, {p.shape[-1]}): the target "
                     "pass read fewer tokens than it should: does the target's cache still hold rejected proposals "
                     "of an earlier round? After each round roll both caches back to the committed tokens but the "
                     "newest (KVCache.crop)")
            for y in range(p.shape[-1]):  # the previous round's last token was another one
                if y != int(tokens[0, -1]) and self._matches(p, torch.cat([tokens[:, :-1], torch.tensor([[y]]), xs], 1), n - 1):
                    fail(f"{self.what}, round {r}: after the {pa} kept proposals you added token {y}, to which next_probs, "
                         f"the distribution speculative_accept returned, gives probability {probs[y].item():.3g}: "
                         "draw the round's last token from next_probs (after a rejection the residual, after k kept proposals the "
                         "target's p[k]), not from the target's p[a] and not by an argmax")
            if self._matches(p, torch.cat([tokens[:, :-1], xs], 1), n - 2):
                fail(f"{self.what}, round {r} (a = {pa} of k = {pk} kept) added only its kept proposals: the round ends "
                     "with one more token drawn from next_probs (when all k are kept, from the target's p[k]: the "
                     "bonus token)")
            for y in range(p.shape[-1]):
                if self._matches(p, torch.cat([tokens, torch.tensor([[y]]), xs], 1), n):
                    fail(f"{self.what}, round {r} (a = {pa} of k = {pk} kept) added one token too many: after a rejection "
                         "the round ends with the one token drawn from next_probs, no bonus token")
            fail(f"{at}): the first round's p was right, this one's is not the target's distribution after the "
                 f"committed tokens and the proposals ({self._gap(p, want_p)}): does the target's cache still hold "
                 "rejected proposals of an earlier round? After each round roll both caches back to the committed "
                 "tokens but the newest (KVCache.crop)")
        fail(f"{at}): the p you passed to speculative_accept is not the target's distribution at each proposal's "
             f"position and one beyond ({self._gap(p, want_p)}): p must be the last k + 1 positions of ONE target pass over what its "
             "cache lacks and the k proposals")

    def _matches_at_temperature_one(self, p, context, start):
        rows = self._probs(self.models[0], context, 1.0)[start:]
        return tuple(rows.shape) == tuple(p.shape) and torch.allclose(p, rows, atol=1e-4, rtol=0)

    @staticmethod
    def _gap(p, want_p):
        if want_p is None:
            return "there was nothing left to generate"
        if tuple(p.shape) != tuple(want_p.shape):
            return f"p has shape {tuple(p.shape)}, expected (k + 1, V) = {tuple(want_p.shape)}"
        return f"full forward passes disagree by {(p - want_p).abs().max():.3g}"


def _run_generate(speculative_generate, what, target, draft, prompt, max_new_tokens, K, spy, **kwargs):
    """The learner's result, or a failure that says what the exception most likely means."""
    try:
        out = speculative_generate(target, draft, prompt, max_new_tokens, num_draft_tokens=K,
                                   speculative_accept=spy, **kwargs)
    except (NotImplementedError, CheckFailed):
        raise  # not written yet, or a failure the spy already explained
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything; say what it means
        calls = spy.calls
        n = prompt.shape[1] + sum(c[4] + 1 for c in calls)
        k = min(K, prompt.shape[1] + max_new_tokens - n - 1)
        where = (f"{what}: your speculative_generate raised {type(error).__name__} in round {len(calls) + 1} "
                 f"(n = {n} committed tokens, k = {k} proposals): {error}")
        if "crop" in [frame.name for frame in traceback.extract_tb(error.__traceback__)]:
            fail(f"{where}. crop can only forget slots: the draft's cache never fed its last proposal, so after a "
                 "round that kept every proposal it holds one slot less than the committed tokens but the newest; "
                 "crop it to whichever is smaller")
        if k == 0:
            fail(f"{where}. The last round of a generation may have room for no proposal at all, k = 0: it must work "
                 "too, with no draft pass, one target pass and speculative_accept called with empty q, draft_tokens and u")
        if any(c[4] < len(c[2]) for c in calls):
            fail(f"{where}. An earlier round rejected a proposal: do your caches still hold rejected proposals? A cache "
                 "ahead of the committed tokens leaves nothing (or the wrong tokens) to feed; after each round roll "
                 "both caches back to the committed tokens but the newest (KVCache.crop)")
        fail(where)
    if not all(hasattr(out, name) for name in ("tokens", "proposed_per_round", "accepted_per_round")):
        fail(f"{what}: speculative_generate must return SpeculativeOutput(tokens, num_draft_tokens, proposed_per_round, "
             f"accepted_per_round), got {type(out).__name__}")
    return out


def _check_result(out, spy, what):
    """The tokens the spy followed round by round, and the rounds' k and a, are what the learner returns."""
    tokens, want = out.tokens, spy.tokens
    if tuple(tokens.shape) != tuple(want.shape) or not torch.equal(tokens, want):
        if tokens.dim() == 2 and tokens.shape[1] > want.shape[1]:
            fail(f"{what}: your tokens have shape {tuple(tokens.shape)}, expected (1, T + max_new_tokens) = "
                 f"{tuple(want.shape)}: each round adds its kept proposals and exactly one more token (no extra "
                 "token after a rejection), and no round goes past max_new_tokens")
        fail(f"{what}: your tokens {tokens.tolist()} are not the committed tokens of your rounds {want.tolist()}: each "
             "round adds its a kept proposals and then one token drawn from next_probs, the distribution "
             "speculative_accept returned")
    k_a = ([len(c[2]) for c in spy.calls], [c[4] for c in spy.calls])
    if (list(out.proposed_per_round), list(out.accepted_per_round)) != k_a:
        fail(f"{what}: proposed_per_round {list(out.proposed_per_round)} and accepted_per_round "
             f"{list(out.accepted_per_round)} must be the k and a of each round, in order: expected {k_a[0]} and {k_a[1]}")


def _check_drawn(speculative_generate, target, draft, prompt) -> None:
    """next_probs that splits its mass 0.55 / 0.45 between two tokens: the round's last token is drawn, not the argmax.
    A correct loop ends all of its R >= 20 rounds with the likelier token with probability 0.55^R < 7e-6."""
    def split(p, n):
        low = p[n].argsort()[:2]  # the target's two least likely tokens: nothing else could give them so often
        probs = torch.zeros_like(p[n])
        probs[low[0]], probs[low[1]] = 0.55, 0.45
        return probs

    spy, what = AcceptSpy(override=split), "sampling, K = 1, 40 new tokens"
    out = _run_generate(speculative_generate, what, target, draft, prompt, 40, 1, spy, do_sample=True,
                        generator=torch.Generator().manual_seed(11))
    ends, n = [], prompt.shape[1]
    for *_, a, probs in spy.calls:
        ends.append((int(out.tokens[0, n + a]), probs))
        n += a + 1
    if any(probs[token] == 0 for token, probs in ends):
        fail(f"{what}: a round ended with a token to which next_probs, the distribution speculative_accept returned, gives "
             "probability 0: draw the round's last token from next_probs")
    likelier = {int(probs.argmax()) for _, probs in ends}
    if all(token == int(probs.argmax()) for token, probs in ends):
        fail(f"{what}: next_probs split its mass 0.55 / 0.45 between two tokens, and all {len(ends)} rounds ended "
             f"with the likelier one ({sorted(likelier)}): draw the round's last token from next_probs "
             "(draw_token(next_probs, generator)), do not take its argmax")


def _check_draw_order(speculative_generate, target, draft, prompt) -> None:
    """The contract's order of random draws in each round: the k proposals (torch.multinomial(q_i, 1, generator), as
    draw_token), then u = torch.rand(k, generator=generator, dtype=torch.float64), then the round's last token from
    next_probs. A replay generator, seeded alike, makes the same draws in that order; the first round whose proposals
    or u differ is named, and a loop that draws u before the proposals is told so."""
    what, seed = "sampling, K = 3, 16 new tokens, seeded", 5
    replay = torch.Generator().manual_seed(seed)
    committed = [prompt]

    def draws(state, q, k, u_first):
        replay.set_state(state)
        u = torch.rand(k, generator=replay, dtype=torch.float64) if u_first else None
        x = [int(torch.multinomial(q[i], 1, generator=replay)) for i in range(k)]
        return x, torch.rand(k, generator=replay, dtype=torch.float64) if u is None else u

    def spy(p, q, draft_tokens, u):
        p, q, u = torch.as_tensor(p).double(), torch.as_tensor(q).double(), torch.as_tensor(u).double()
        x, k, state = torch.as_tensor(draft_tokens).long(), len(draft_tokens), replay.get_state()
        want_x, want_u = draws(state, q, k, u_first=False)
        if x.tolist() != want_x or not torch.equal(u, want_u):
            at = f"{what}, round {len(committed)}"
            alt_x, alt_u = draws(state, q, k, u_first=True)
            if k and x.tolist() == alt_x and torch.equal(u, alt_u):
                fail(f"{at}: you draw u before the proposals. The contract fixes the order of the draws in each round: "
                     "the k proposals (draw_token, one per draft pass), then u = torch.rand(k, generator=generator, "
                     "dtype=torch.float64), then the round's last token. Another order follows the target's "
                     "distribution too, but gives other tokens for the same seed, and the chapter's measured numbers "
                     "are those of the contract's order")
            fail(f"{at}: your proposals {x.tolist()} and u {[round(v, 4) for v in u.tolist()]} are not the draws the "
                 f"contract's order gives from the seeded generator ({want_x} and {[round(v, 4) for v in want_u.tolist()]}): "
                 "in each round draw the k proposals (draw_token(q_i, generator)), then u (torch.rand(k, "
                 "generator=generator, dtype=torch.float64)), then the round's last token (draw_token(next_probs, "
                 "generator)), and nothing else from the generator")
        n, probs = speculative_accept_oracle(p, q, x, u) if k else (0, p[0])
        committed.append(torch.tensor([want_x[:n] + [int(torch.multinomial(probs, 1, generator=replay))]]))
        spy.calls.append((p, q, x, u, n, probs))
        return n, probs

    spy.calls = []  # as AcceptSpy's: _run_generate reads how far the rounds got when the loop raises
    out = _run_generate(speculative_generate, what, target, draft, prompt, 16, 3, spy, do_sample=True,
                        generator=torch.Generator().manual_seed(seed))
    want = torch.cat(committed, dim=1)
    if not torch.equal(out.tokens, want):
        fail(f"{what}: your tokens {out.tokens[0].tolist()} are not those of the contract's order of draws "
             f"{want[0].tolist()}: end each round with draw_token(next_probs, generator), after its proposals and u")


def check_speculative_generate(speculative_generate) -> None:
    """Visible checks for chapter 07, exercise 2, with the course's acceptance rule (so only the loop is tested)."""
    import copy

    target, draft = tiny_gpt_pair(702)
    prompt, T = torch.tensor([[0, 3, 1, 2]]), 4
    # 1. greedy, with a draft that sometimes agrees: every round against full forward passes, and the cost
    K, new, what = 3, 13, "greedy, K = 3"
    spy = AcceptSpy((target, draft), prompt, new, K, what=what)
    with TargetPasses(target) as passes:
        out = _run_generate(speculative_generate, what, target, draft, prompt, new, K, spy, do_sample=False)
    _check_result(out, spy, what)
    rounds = len(spy.calls)
    if passes.calls != rounds:
        fail(f"{what}: {rounds} rounds made {passes.calls} target forward passes, expected one per round: the target "
             "judges all of a round's proposals (and reads what its cache lacks) in ONE pass")
    expected_positions = T + sum(len(c[2]) for c in spy.calls) + rounds - 1
    if passes.positions != expected_positions:
        fail(f"{what}: your target passes read {passes.positions} positions in all, expected T + proposals + rounds - 1 "
             f"= {expected_positions}: with its KV cache the target reads each token once, the prompt, every proposal and "
             "each round's last token but the final one (feed it only what its cache lacks; a cache cropped too far, or the whole text fed every round, "
             "reads more)")
    if not torch.equal(out.tokens, greedy_oracle(target, prompt, new)):
        fail(f"{what}: your tokens differ from the target's greedy decoding")
    # 2. a draft identical to the target: every proposal is kept, and every round earns the bonus token
    twin, what = copy.deepcopy(target), "a draft identical to the target, K = 3"
    spy = AcceptSpy((target, twin), prompt, 12, 3, what=what)
    out = _run_generate(speculative_generate, what, target, twin, prompt, 12, 3, spy, do_sample=False)
    _check_result(out, spy, what)
    if list(out.accepted_per_round) != [3, 3, 3]:
        fail(f"{what}, 12 new tokens: every proposal is kept and each round adds K + 1 = 4 tokens (the last the bonus "
             f"token), so 3 rounds that keep 3 each; you reported accepted_per_round = {list(out.accepted_per_round)}")
    # 3. sampling at temperature 2: the round's last token comes from next_probs, whatever it is
    def least_likely(p, n):  # a next_probs no correct loop could confuse with the target's own p[n]
        return torch.nn.functional.one_hot(p[n].argmin(), p.shape[-1]).double()

    what = "sampling at temperature 2, K = 2"
    spy = AcceptSpy((target, draft), prompt, 10, 2, do_sample=True, temperature=2.0, override=least_likely, what=what)
    out = _run_generate(speculative_generate, what, target, draft, prompt, 10, 2, spy, do_sample=True, temperature=2.0,
                        generator=torch.Generator().manual_seed(7))
    _check_result(out, spy, what)
    _check_drawn(speculative_generate, target, draft, prompt)
    # 4. the seeded generator makes every draw
    runs = []
    for global_seed in (1, 2):  # the global random state differs, the generator's does not
        with torch.random.fork_rng():
            torch.manual_seed(global_seed)
            out = _run_generate(speculative_generate, "sampling", target, draft, prompt, 10, 2, AcceptSpy(),
                                do_sample=True, generator=torch.Generator().manual_seed(7))
            runs.append(out.tokens[0, T:].tolist())
    if runs[0] != runs[1]:
        fail(f"two sampled runs with the same seeded generator gave different tokens ({runs[0]}, then {runs[1]}): every "
             "random draw must use `generator`: the proposals, u (torch.rand(k, generator=generator, ...)) and each "
             "round's last token")
    # 5. the contract's order of the draws
    _check_draw_order(speculative_generate, target, draft, prompt)
    passed("speculative_generate")
