"""Chapter 07's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import pytest
import torch

from course_lib import checks
from course_lib.speculative import speculative_accept, speculative_generate
from tests.helpers import mutant

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
    return mutant(function, (old, new), *zip(more[::2], more[1::2]))


G = speculative_generate
CROP_T, CROP_D = "target_cache.crop(n + a)", "draft_cache.crop(min(draft_cache.length, n + a))"
APPEND = "tokens = torch.cat([tokens, drafts[:, :a], draw_token(next_probs, generator)], dim=1)"
P_ROWS = "p = probs_from_logits(logits[0, -(K + 1):], do_sample, temperature)"

no_rollback = planted(G, CROP_T, "pass", CROP_D, "pass")
target_not_rolled_back = planted(G, CROP_T, "pass")
draft_not_rolled_back = planted(G, CROP_D, "pass")
bonus_dropped = planted(G, APPEND, "tokens = torch.cat([tokens, drafts[:, :a]] + ([draw_token(next_probs, generator)] if a < K else []), dim=1)")
bonus_always = planted(G, APPEND, APPEND + "\n        if a < K:\n            tokens = torch.cat([tokens, draw_token(p[K], generator)], dim=1)")
p_one_early = planted(G, P_ROWS, "p = probs_from_logits(logits[0, -(K + 2):-1], do_sample, temperature)")
overshoots = planted(G, "K = min(num_draft_tokens, total - n - 1)", "K = min(num_draft_tokens, total - n)")
drawn_from_p = planted(G, "draw_token(next_probs, generator)", "draw_token(p[a], generator)")
next_by_argmax = planted(G, "draw_token(next_probs, generator)", "next_probs.argmax().view(1, 1)")
u_without_generator = planted(G, "u = torch.rand(K, generator=generator, dtype=torch.float64)", "u = torch.rand(K, dtype=torch.float64)")
target_ignores_temperature = planted(G, P_ROWS, "p = probs_from_logits(logits[0, -(K + 1):], do_sample, 1.0)")
q_without_temperature = planted(  # drafts drawn at the temperature, but q reported at temperature 1
    G, "probs = probs_from_logits(cached_forward(draft, new, draft_cache)[0, -1], do_sample, temperature)",
    "logits_d = cached_forward(draft, new, draft_cache)[0, -1]; probs = probs_from_logits(logits_d, do_sample, temperature)",
    "q.append(probs)", "q.append(probs_from_logits(logits_d, do_sample, 1.0))")
draft_at_temperature_one = planted(  # drafts drawn at temperature 1 and q reported as such: exact, but not the contract
    G, "probs = probs_from_logits(cached_forward(draft, new, draft_cache)[0, -1], do_sample, temperature)",
    "probs = probs_from_logits(cached_forward(draft, new, draft_cache)[0, -1], do_sample, 1.0)")
u_drawn_first = planted(  # a correct loop that draws u before the proposals: the other order of draws
    G, "        u = torch.rand(K, generator=generator, dtype=torch.float64)\n", "",
    "new, drafted, q = tokens[:, draft_cache.length:], [], []",
    "new, drafted, q = tokens[:, draft_cache.length:], [], []\n        u = torch.rand(K, generator=generator, dtype=torch.float64)")
fails_at_k_zero = planted(G, "torch.stack(q) if K else p[:0]", "torch.stack(q)")
cropped_too_far = planted(G, CROP_T, "target_cache.crop(n + a - 1)", CROP_D, "draft_cache.crop(min(draft_cache.length, n + a - 1))")
draft_cropped_without_min = planted(G, CROP_D, "draft_cache.crop(n + a)")
separate_prefill = planted(G, "        # 2. verify", "        if target_cache.length == 0:\n            cached_forward(target, tokens[:, :-1], target_cache)\n        # 2. verify")


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_speculative_accept, unnormalised, r"your next_probs sums to 0\.7, expected 1: .* must be renormalised"),
    (checks.check_speculative_accept, swapped, r"u = 0\.41 >= 0\.4: the token must be rejected .*are p and q swapped"),
    (checks.check_speculative_accept, no_bonus, r"next_probs must be the target's distribution after them, p\[K\] .* \(the bonus token\)"),
    (checks.check_speculative_accept, residual_not_clamped, r"with negative entries: the residual is max\(0, p - q\), clamped at 0"),
    (checks.check_speculative_accept, residual_swapped, r"your next_probs is max\(0, q - p\), normalised"),
    (checks.check_speculative_accept, counts_every_acceptance, r"before the FIRST rejection"),
    (checks.check_speculative_generate, no_rollback, r"do your caches still hold rejected proposals\? .*roll both caches back"),
    (checks.check_speculative_generate, target_not_rolled_back, r"target's cache still hold rejected proposals"),
    (checks.check_speculative_generate, draft_not_rolled_back, r"do your caches still hold rejected proposals\?"),
    (checks.check_speculative_generate, bonus_dropped, r"Did a round that kept all its proposals add only those\? .*the bonus token"),
    (checks.check_speculative_generate, bonus_always, r"added one token too many: after a rejection"),
    (checks.check_speculative_generate, p_one_early, r"one position too early"),
    (checks.check_speculative_generate, overshoots, r"proposed k = \d tokens, expected min\(K, r - 1\)"),
    (checks.check_speculative_generate, drawn_from_p, r"draw the round's last token from next_probs .*not from the target's p\[a\]"),
    (checks.check_speculative_generate, next_by_argmax, r"all \d+ rounds ended with the likelier one .*do not take its argmax"),
    (checks.check_speculative_generate, u_without_generator, r"same seeded generator gave different tokens .*u \(torch.rand\(k, generator=generator"),
    (checks.check_speculative_generate, target_ignores_temperature, r"the p you passed to speculative_accept ignores the temperature"),
    (checks.check_speculative_generate, q_without_temperature, r"the q you passed to speculative_accept ignores the temperature"),
    (checks.check_speculative_generate, draft_at_temperature_one, r"ignores the temperature: it is the draft's distribution at temperature 1, not at 2\. The contract samples both models"),
    (checks.check_speculative_generate, u_drawn_first, r"round 1: you draw u before the proposals\. The contract fixes the order of the draws"),
    (checks.check_speculative_generate, fails_at_k_zero, r"room for no proposal at all, k = 0"),
    (checks.check_speculative_generate, cropped_too_far, r"target passes read \d+ positions in all, expected T \+ proposals \+ rounds - 1"),
    (checks.check_speculative_generate, draft_cropped_without_min, r"crop can only forget slots: the draft's cache never fed its last proposal"),
    (checks.check_speculative_generate, separate_prefill, r"made \d+ target forward passes, expected one per round"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_a_different_correct_design_passes(capsys):
    """A loop written otherwise: a separate catch-up pass for the draft, drafts fed one at a time, the round's
    tokens built in a list, and the target's chunk assembled from the token list."""
    catch_up = planted(G, "new, drafted, q = tokens[:, draft_cache.length:], [], []",
                       "new, drafted, q = tokens[:, draft_cache.length:], [], []\n        if K and new.shape[1] > 1:\n"
                       "            cached_forward(draft, new[:, :-1], draft_cache)\n            new = new[:, -1:]")
    checks.check_speculative_generate(catch_up)
    assert "all visible checks passed" in capsys.readouterr().out
