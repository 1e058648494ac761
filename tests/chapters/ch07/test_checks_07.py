"""Chapter 07's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import inspect

import pytest
import torch

from course_lib import checks
from course_lib.speculative import speculative_accept, speculative_step
from tests.planted import bonus_missing_step

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks


def test_the_oracle_agrees_with_the_reference_on_random_cases():
    gen = torch.Generator().manual_seed(0)
    for K in (1, 2, 5):
        for _ in range(50):
            p = torch.softmax(torch.randn(K + 1, 6, generator=gen, dtype=torch.float64) * 2, -1)
            q = torch.softmax(torch.randn(K, 6, generator=gen, dtype=torch.float64) * 2, -1)
            x, u = torch.multinomial(q, 1, generator=gen)[:, 0], torch.rand(K, generator=gen, dtype=torch.float64)
            n, r = speculative_accept(p, q, x, u)
            n_o, r_o = checks.speculative_accept_oracle(p, q, x, u)
            assert n == n_o and torch.allclose(r, r_o)


def unnormalised(p, q, draft_tokens, u):
    n, r = speculative_accept(p, q, draft_tokens, u)
    return n, (r if n == len(draft_tokens) else (p[n] - q[n]).clamp(min=0))


def swapped(p, q, draft_tokens, u):
    for i in range(len(draft_tokens)):
        x = draft_tokens[i]
        if u[i] >= q[i, x] / p[i, x]:
            r = (q[i] - p[i]).clamp(min=0)
            return i, r / r.sum()
    return len(draft_tokens), p[-1]


def no_bonus(p, q, draft_tokens, u):
    n, r = speculative_accept(p, q, draft_tokens, u)
    return n, (r if n < len(draft_tokens) else p[n - 1])


def residual_not_clamped(p, q, draft_tokens, u):
    n, r = speculative_accept(p, q, draft_tokens, u)
    return n, (r if n == len(draft_tokens) else (p[n] - q[n]) / (p[n] - q[n]).sum())


def residual_swapped(p, q, draft_tokens, u):
    n, r = speculative_accept(p, q, draft_tokens, u)
    return n, (r if n == len(draft_tokens) else (q[n] - p[n]).clamp(min=0) / (q[n] - p[n]).clamp(min=0).sum())


def counts_every_acceptance(p, q, draft_tokens, u):
    K = len(draft_tokens)
    accepted = u < p[torch.arange(K), draft_tokens] / q[torch.arange(K), draft_tokens]
    n = int(accepted.sum())  # BUG: not only the leading run of acceptances
    if n == K:
        return n, p[K]
    r = (p[n] - q[n]).clamp(min=0)
    return n, r / r.sum()


def planted(function, old: str, new: str, *more: str):
    """The course's function with one line of its source replaced (a planted bug), in its module's namespace;
    `more`: further (old, new) pairs of the same bug."""
    source = inspect.getsource(function)
    pairs = [(old, new), *zip(more[::2], more[1::2])]
    for old, new in pairs:
        assert old in source
        source = source.replace(old, new)
    namespace = dict(vars(inspect.getmodule(function)))
    exec(source, namespace)  # noqa: S102 - the course's own code, one line changed
    return namespace[function.__name__]


draft_cropped_without_min = planted(speculative_step, "draft_cache.crop(min(draft_cache.length, n + a))",
                                    "draft_cache.crop(n + a)")


draft_cropped_to_zero = planted(speculative_step, "draft_cache.crop(min(draft_cache.length, n + a))",
                                "draft_cache.crop(0)")
target_fed_newest_only = planted(speculative_step, "torch.cat([tokens[:, target_cache.length:], drafts]",
                                 "torch.cat([tokens[:, -1:] if target_cache.length else tokens, drafts]")
u_without_generator = planted(speculative_step, "u = torch.rand(K, generator=generator, dtype=torch.float64)",
                              "u = torch.rand(K, dtype=torch.float64)")
next_token_by_argmax = planted(speculative_step, "draw_token(next_probs, generator)", "next_probs.argmax().view(1, 1)")
target_ignores_temperature = planted(speculative_step, "p = probs_from_logits(logits[0, -(K + 1):], do_sample, temperature)",
                                     "p = probs_from_logits(logits[0, -(K + 1):], do_sample, 1.0)")

q_without_temperature = planted(  # drafts drawn at the temperature, but q reported at temperature 1
    speculative_step, "probs = probs_from_logits(cached_forward(draft, new, draft_cache)[0, -1], do_sample, temperature)",
    "logits_d = cached_forward(draft, new, draft_cache)[0, -1]; probs = probs_from_logits(logits_d, do_sample, temperature)",
    "q.append(probs)", "q.append(probs_from_logits(logits_d, do_sample, 1.0))")


def fails_at_k_zero(target, draft, tokens, target_cache, draft_cache, K, **kwargs):
    if K == 0:
        torch.stack([])  # what torch.stack(q) does with no drafts
    return speculative_step(target, draft, tokens, target_cache, draft_cache, K, **kwargs)


def step_without_rollback(target, draft, tokens, target_cache, draft_cache, K, **kwargs):
    crop = type(target_cache).crop
    type(target_cache).crop = lambda self, n: None
    try:
        return speculative_step(target, draft, tokens, target_cache, draft_cache, K, **kwargs)
    finally:
        type(target_cache).crop = crop


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_speculative_accept, unnormalised, r"your next_probs sums to 0\.7, expected 1: .* must be renormalised"),
    (checks.check_speculative_accept, swapped, r"u = 0\.41 >= 0\.4: the token must be rejected .*are p and q swapped"),
    (checks.check_speculative_accept, no_bonus, r"next_probs must be the target's distribution after them, p\[K\] .* \(the bonus token\)"),
    (checks.check_speculative_accept, residual_not_clamped, r"with negative entries: the residual is max\(0, p - q\), clamped at 0"),
    (checks.check_speculative_accept, residual_swapped, r"your next_probs is max\(0, q - p\), normalised"),
    (checks.check_speculative_accept, counts_every_acceptance, r"before the FIRST rejection"),
    (checks.check_speculative_step, draft_cropped_without_min, r"crop it to min\(draft_cache.length, n \+ a\)"),
    (checks.check_speculative_step, draft_cropped_to_zero, r"draft cache holds 0 slots, expected min\(its length, n \+ a\) = \d+\. .*re-feeds the whole prefix"),
    (checks.check_speculative_step, target_fed_newest_only, r"the target cache held 2 of the n = 6 committed tokens .*feed it everything it lacks"),
    (checks.check_speculative_step, u_without_generator, r"same seeded generator gave different tokens .*u = torch.rand\(K, generator=generator"),
    (checks.check_speculative_step, next_token_by_argmax, r"60 sampled steps all gave token 5.*do not take its argmax"),
    (checks.check_speculative_step, target_ignores_temperature, r"the target's probabilities ignore the temperature"),
    (checks.check_speculative_step, q_without_temperature, r"a draft identical to the target, sampled .*q must be the distribution each draft was drawn from"),
    (checks.check_speculative_step, fails_at_k_zero, r"K = 0 must work .* no draft pass"),
    (checks.check_speculative_step, step_without_rollback, r"target cache holds \d+ slots, expected n \+ a = \d+ .*crop"),
    (checks.check_speculative_step, bonus_missing_step, r"all K = \d drafts were accepted, so the step must add K \+ 1 = \d tokens \(the last one is the bonus token"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)
