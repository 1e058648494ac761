"""Visible checks of chapter 07 (speculative decoding), and the independent oracles they compare against.

Oracles: the acceptance rule written as one float64 vectorised formula (``speculative_accept_oracle``),
plain greedy decoding by full forward passes of the model (no cache), and fresh caches filled from the
committed tokens; never course_lib.speculative's reference solutions.
"""
from __future__ import annotations

import traceback

import torch

from .core import assert_close, fail, greedy_oracle, passed

__all__ = ["check_speculative_accept", "check_speculative_step", "speculative_accept_oracle", "tiny_gpt_pair",
           "cache_matches_tokens"]


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




@torch.no_grad()
def cache_matches_tokens(model, cache, tokens) -> float:
    """How far the cache is from holding exactly tokens[:, :cache.length]: feed the rest of tokens and compare the
    last logits with a full forward pass of tokens (no cache); the cache is cropped back afterwards."""
    from ..kv_cache import cached_forward  # chapter 05's cached forward: not a chapter 07 solution

    length = cache.length
    logits = cached_forward(model, tokens[:, length:], cache)[:, -1]
    cache.crop(length)
    return (logits - model(tokens)[0][:, -1]).abs().max().item()


def _run_step(speculative_step, round_, target, draft, tokens, tc, dc, K, **sampling):
    """speculative_step's result, or a failure that says what the exception most likely means."""
    n, before = tokens.shape[1], dc.length
    sampling = sampling or {"do_sample": False}
    try:
        return speculative_step(target, draft, tokens, tc, dc, K, accept=speculative_accept_oracle, **sampling)
    except NotImplementedError:
        raise  # not written yet: nothing to explain
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything; say what it means
        where = f"round {round_} (n = {n} tokens, K = {K} drafts) raised {type(error).__name__}: {error}"
        if any(frame.name == "crop" for frame in traceback.extract_tb(error.__traceback__)):
            fail(f"{where}. crop can only forget slots: the draft cache never fed its last proposal, so it holds "
                 f"one slot less than n + a when all K drafts are accepted; crop it to min(draft_cache.length, n + a)")
        if K == 0:
            fail(f"{where}. K = 0 must work (the last round of a generation may have no room for drafts): no draft "
                 f"pass, one target pass over what its cache lacks, a = 0 and one token drawn from p[0] "
                 f"(the draft cache held {before} slots)")
        fail(where)


def check_speculative_step(speculative_step) -> None:
    """Visible checks for chapter 07, exercise 2, with the course's acceptance rule (so only the step is tested)."""
    from ..kv_cache import KVCache

    target, draft = tiny_gpt_pair(702)
    tokens = torch.tensor([[0, 3, 1, 2]])
    expected = greedy_oracle(target, tokens, 30)
    tc, dc = KVCache.for_model(target, 1), KVCache.for_model(draft, 1)
    for round_ in range(10):
        n, K, before = tokens.shape[1], (1 + round_) % 5, dc.length  # K = 1, 2, 3, 4, 0, 1, ...
        result = _run_step(speculative_step, round_, target, draft, tokens, tc, dc, K)
        if not isinstance(result, tuple) or len(result) != 2:
            fail(f"speculative_step should return (tokens, a), got {type(result).__name__}")
        new, a = result
        a = int(a)
        if a == K and tuple(new.shape) == (1, n + K):
            fail(f"round {round_}: all K = {K} drafts were accepted, so the step must add K + 1 = {K + 1} tokens (the last "
                 f"one is the bonus token, drawn from the target's distribution after the drafts); yours added {K}")
        if not 0 <= a <= K or tuple(new.shape) != (1, n + a + 1):
            fail(f"round {round_}: with n = {n} tokens, K = {K} drafts and a = {a} accepted, the tokens must have shape "
                 f"(1, n + a + 1) = (1, {n + a + 1}), got {tuple(new.shape)}")
        if not torch.equal(new[:, :n], tokens):
            fail(f"round {round_}: the first n = {n} tokens must stay as they were")
        if tc.length != n + a:
            fail(f"round {round_}: after the step the target cache holds {tc.length} slots, expected n + a = {n + a} "
                 "(every committed token but the newest): roll back with target_cache.crop(n + a)")
        if dc.length > n + a:
            fail(f"round {round_}: after the step the draft cache holds {dc.length} slots, more than n + a = {n + a}: "
                 "it still holds rejected draft tokens (roll it back with draft_cache.crop)")
        # K draft passes leave n + K - 1 slots (the last draft is not fed); K = 0 needs no draft pass (one that only
        # feeds what the draft cache lacks does no harm)
        kept = min(n + K - 1, n + a) if K else before
        if dc.length < kept or (K and dc.length != kept):
            fail(f"round {round_} (K = {K}, a = {a}): after the step the draft cache holds {dc.length} slots, expected "
                 f"min(its length, n + a) = {kept}. Either it was cropped too far (forget only the rejected drafts, "
                 "draft_cache.crop(min(draft_cache.length, n + a)); cropping more re-feeds the whole prefix to the "
                 "draft every round), or its first pass did not feed every committed token it lacked "
                 "(tokens[:, draft_cache.length:])")
        for model, cache, name in ((target, tc, "target"), (draft, dc, "draft")):
            gap = cache_matches_tokens(model, cache, new)
            if gap > 1e-4:
                fail(f"round {round_}: the {name} cache does not hold the committed tokens: continuing from it gives "
                     f"logits off by {gap:.3g} from a fresh forward pass (rejected drafts left in the cache?)")
        tokens = new
        if not torch.equal(tokens, expected[:, :tokens.shape[1]]):
            fail(f"round {round_}: greedy verification must reproduce the target's greedy tokens exactly; "
                 f"expected {expected[0, n:tokens.shape[1]].tolist()} after position {n}, got {tokens[0, n:].tolist()}")
    _check_target_lacking_more(speculative_step, target, draft, expected)
    tc, dc = KVCache.for_model(target, 1), KVCache.for_model(target, 1)
    tokens = torch.tensor([[1, 2]])
    for K in (1, 3):
        n = tokens.shape[1]
        tokens, a = _run_step(speculative_step, f"identical draft, K = {K}", target, target, tokens, tc, dc, K)
        if tokens.shape[1] - n != K + 1:
            fail(f"with a draft identical to the target all K = {K} drafts are accepted, and the step must add K + 1 = "
                 f"{K + 1} tokens (the last one is the bonus token, drawn from the target's distribution after the "
                 f"drafts); yours added {tokens.shape[1] - n}")
    _check_sampling(speculative_step, target, draft, expected)
    passed("speculative_step")


def _check_target_lacking_more(speculative_step, target, draft, expected) -> None:
    """A target cache that lacks 4 committed tokens, not just the newest: all of them are fed first."""
    from ..kv_cache import KVCache, cached_forward

    tokens, K = expected[:, :6], 2
    tc, dc = KVCache.for_model(target, 1), KVCache.for_model(draft, 1)
    with torch.no_grad():
        cached_forward(target, tokens[:, :2], tc)  # the target cache holds 2 of the 6 tokens
        cached_forward(draft, tokens[:, :5], dc)  # the draft cache holds all but the newest
    what = ("the target cache held 2 of the n = 6 committed tokens (4 lacking): feed it everything it lacks, "
            "tokens[:, target_cache.length:], then the K drafts, in one pass (not just the newest token)")
    try:
        new, a = speculative_step(target, draft, tokens, tc, dc, K, do_sample=False, accept=speculative_accept_oracle)
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything; say what it means
        fail(f"{what}; your step raised {type(error).__name__}: {error}")
    a = int(a)
    if (tuple(new.shape) != (1, 6 + a + 1) or not torch.equal(new, expected[:, :new.shape[1]]) or tc.length != 6 + a
            or cache_matches_tokens(target, tc, new) > 1e-4):
        fail(f"{what}. Expected the target's greedy tokens {expected[0, 6:6 + a + 1].tolist()} after position 6 and "
             f"{6 + a} slots in the target cache, got {new[0, 6:].tolist()} and {tc.length}")


def _check_sampling(speculative_step, target, draft, expected) -> None:
    """Sampling: the seeded generator makes every draw; the target's probabilities honour the temperature."""
    from ..kv_cache import KVCache

    runs = []
    for global_seed in (1, 2):  # the global random state differs, the generator's does not
        with torch.random.fork_rng():
            torch.manual_seed(global_seed)
            tokens, generator = expected[:, :4], torch.Generator().manual_seed(7)
            tc, dc = KVCache.for_model(target, 1), KVCache.for_model(draft, 1)
            for round_ in range(3):
                tokens, _ = _run_step(speculative_step, f"sampled {round_}", target, draft, tokens, tc, dc, 3,
                                      do_sample=True, generator=generator)
            runs.append(tokens[0, 4:].tolist())
    if runs[0] != runs[1]:
        fail(f"two sampled runs with the same seeded generator gave different tokens ({runs[0]}, then {runs[1]}): every "
             "random draw must use `generator`: the drafts, u = torch.rand(K, generator=generator, ...) and the next "
             "token (draw_token(probs, generator))")
    # K = 0 with temperature 5 at a point where the target is sure of token 5 (0.944 at temperature 1): token 5 has
    # probability 0.331 at temperature 5, so about 20 of 60 draws
    tokens, generator, T = expected[:, :12], torch.Generator().manual_seed(8), 5.0
    with torch.no_grad():
        target_p = torch.softmax(target(tokens)[0][0, -1].double() / T, dim=-1)
        top = int(target_p.argmax())
    tc, dc = KVCache.for_model(target, 1), KVCache.for_model(draft, 1)
    drawn = []
    for round_ in range(60):
        tc.crop(min(tc.length, 11))
        new, _ = _run_step(speculative_step, f"K = 0, temperature {T}", target, draft, tokens, tc, dc, 0,
                           do_sample=True, temperature=T, generator=generator)
        drawn.append(int(new[0, -1]))
    if len(set(drawn)) == 1:
        fail(f"K = 0, temperature {T}: 60 sampled steps all gave token {drawn[0]}, whose probability is "
             f"{target_p[drawn[0]]:.3f}: draw the next token from next_probs (draw_token(next_probs, generator)), "
             "do not take its argmax")
    if drawn.count(top) > 40:
        fail(f"K = 0, temperature {T}: token {top} has probability {target_p[top]:.3f} (softmax(logits / {T:g})), "
             f"about {60 * target_p[top]:.0f} of 60 draws, but you drew it {drawn.count(top)} times: the target's "
             "probabilities ignore the temperature; use probs_from_logits(logits, do_sample, temperature) for the target as for the draft")
    # a draft identical to the target, sampled at temperature 5: p = q at every draft, so p/q = 1 > u and every
    # draft is accepted, whatever the draws
    tc, dc = KVCache.for_model(target, 1), KVCache.for_model(target, 1)
    for round_ in range(15):
        tc.crop(min(tc.length, 11))
        dc.crop(min(dc.length, 11))
        new, a = _run_step(speculative_step, f"identical draft, temperature {T}", target, target, tokens, tc, dc, 2,
                           do_sample=True, temperature=T, generator=generator)
        if int(a) != 2:
            fail(f"a draft identical to the target, sampled at temperature {T}: p = q at every draft, so p/q = 1 > u "
                 f"and all K = 2 drafts must be accepted, but sampled round {round_} accepted {int(a)}. q must be the "
                 "distribution each draft was drawn from, softmax(draft logits / temperature), the same as p")
