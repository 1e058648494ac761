"""course_lib.speculative: exact greedy equality, the target's distribution by simulation, and the classic bugs.

Oracles: plain greedy decoding without any cache (course_lib.gpt.gpt_sample, a full forward per token),
the target's own next-token distributions from a full forward pass, and float64 formulas.

Distribution tests are chi-square goodness-of-fit tests at significance level ALPHA = 0.001 on N seeded
samples: a correct implementation passes (the seed is fixed, so the outcome is too), and each classic
bug, planted below, gives a p-value far below ALPHA: the tests have the power to see it.
p-value = P(chi2_df >= stat) = Q(df / 2, stat / 2), the regularised upper incomplete gamma function
torch.special.gammaincc.
"""
from __future__ import annotations

import pytest
import torch

from course_lib.gpt import GPT, GPTConfig, gpt_sample
from course_lib.kv_cache import KVCache
from course_lib.checks import AcceptSpy
from course_lib.decoding import apply_temperature, generate
from course_lib.speculative import (SpeculativeOutput, draw_token, expected_tokens_per_round,
                                    probs_from_logits, speculative_accept, speculative_generate)

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks

ALPHA = 0.001


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of observed counts (C,) to probabilities (C,): cells expecting < 5 are pooled into one.

    An outcome of probability 0 that occurs refutes the distribution outright: p-value 0."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[small].sum().view(1)])
    expected = torch.cat([expected[big], expected[small].sum().view(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def test_chi_square_pvalue_matches_known_values():
    # chi2 with 2 degrees of freedom: P(X >= x) = exp(-x / 2) exactly
    counts, probs = torch.tensor([60.0, 20.0, 20.0]), torch.tensor([1 / 3, 1 / 3, 1 / 3])
    stat = ((counts - 100 / 3) ** 2 / (100 / 3)).sum()
    assert chi_square_pvalue(counts, probs) == pytest.approx(torch.exp(-stat / 2).item(), rel=1e-10)
    assert chi_square_pvalue(torch.tensor([500.0, 500.0]), torch.tensor([0.5, 0.5])) == pytest.approx(1.0)


def tiny_gpt(seed: int, n_layer: int = 1, n_embd: int = 16, vocab_size: int = 5, block_size: int = 32, scale: float = 0.5):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=n_embd))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "ln" in name and name.endswith("weight") else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def shipped():
    from course_lib import assets

    return assets.load("char-gpt"), assets.load("char-gpt-draft"), assets.tokenizer("char-gpt")


# --- the acceptance / residual step ------------------------------------------------------------------------

def accept_unnormalised(p, q, draft_tokens, u):  # classic bug: the residual max(0, p - q) is not renormalised
    for i in range(draft_tokens.shape[0]):
        x = draft_tokens[i]
        if u[i] >= p[i, x] / q[i, x]:
            return i, (p[i] - q[i]).clamp(min=0)
    return draft_tokens.shape[0], p[-1]


def accept_swapped(p, q, draft_tokens, u):  # classic bug: q and p swapped (accept with min(1, q/p), residual q - p)
    for i in range(draft_tokens.shape[0]):
        x = draft_tokens[i]
        if u[i] >= q[i, x] / p[i, x]:
            residual = (q[i] - p[i]).clamp(min=0)
            return i, residual / residual.sum()
    return draft_tokens.shape[0], p[-1]


def accept_no_bonus(p, q, draft_tokens, u):  # classic bug: no bonus distribution when all K are accepted
    n, next_probs = speculative_accept(p, q, draft_tokens, u)
    return n, (next_probs if n < draft_tokens.shape[0] else None)


def sample_from(probs: torch.Tensor, v: float) -> int:
    """Inverse CDF: probs is taken as it is (a distribution that does not sum to 1 is wrong, and shows)."""
    return min(int(torch.searchsorted(probs.cumsum(0), torch.tensor([v], dtype=probs.dtype), right=True)), len(probs) - 1)


def simulate_first_token(accept, p, q, n_samples: int, seed: int) -> torch.Tensor:
    """Counts (V,) of the first token a round outputs, draft tokens drawn from q, u uniform (fixed context)."""
    gen = torch.Generator().manual_seed(seed)
    K, V = q.shape
    counts = torch.zeros(V)
    drafts = torch.stack([torch.multinomial(q[i], n_samples, replacement=True, generator=gen) for i in range(K)], 1)
    us = torch.rand(n_samples, K, generator=gen, dtype=torch.float64)
    vs = torch.rand(n_samples, generator=gen, dtype=torch.float64).tolist()
    for s in range(n_samples):
        n, next_probs = accept(p, q, drafts[s], us[s])
        counts[drafts[s, 0] if n > 0 else sample_from(next_probs, vs[s])] += 1
    return counts


P_Q_CASES = {
    # (p (K + 1, V), q (K, V)), K = 1 and 2, V = 4
    "different": ([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], [[0.4, 0.3, 0.2, 0.1]]),
    "q has zeros where p > 0": ([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]], [[0.5, 0.5, 0.0, 0.0]]),
    "p has zeros where q > 0": ([[0.0, 0.5, 0.0, 0.5], [0.1, 0.2, 0.3, 0.4]], [[0.25, 0.25, 0.25, 0.25]]),
    "p == q": ([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]], [[0.1, 0.2, 0.3, 0.4]]),
    "K = 2": ([[0.1, 0.2, 0.3, 0.4], [0.3, 0.3, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]], [[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4]]),
}
N_ACCEPT = 20_000


@pytest.mark.parametrize("case", list(P_Q_CASES))
def test_accept_step_outputs_follow_the_target_distribution(case):
    p, q = (torch.tensor(t, dtype=torch.float64) for t in P_Q_CASES[case])
    counts = simulate_first_token(speculative_accept, p, q, N_ACCEPT, seed=7)
    assert chi_square_pvalue(counts, p[0]) > ALPHA


@pytest.mark.parametrize("bug,case", [(accept_unnormalised, "different"), (accept_unnormalised, "q has zeros where p > 0"),
                                      (accept_swapped, "different"), (accept_swapped, "p has zeros where q > 0")])
def test_the_simulation_sees_the_classic_accept_bugs(bug, case):
    p, q = (torch.tensor(t, dtype=torch.float64) for t in P_Q_CASES[case])
    assert chi_square_pvalue(simulate_first_token(bug, p, q, N_ACCEPT, seed=7), p[0]) < 1e-6


def test_accept_rule_and_residual_by_hand():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    # token 1: p/q = 0.4: accepted when u < 0.4
    assert speculative_accept(p, q, torch.tensor([1]), torch.tensor([0.39], dtype=torch.float64))[0] == 1
    n, residual = speculative_accept(p, q, torch.tensor([1]), torch.tensor([0.4], dtype=torch.float64))
    assert n == 0
    torch.testing.assert_close(residual, torch.tensor([0.0, 0.0, 0.3, 0.4], dtype=torch.float64) / 0.7)
    # p > q at the draft token: accepted whatever u; then the next token comes from the target's p[K] (bonus)
    uniform = torch.full((1, 4), 0.25, dtype=torch.float64)
    n, bonus = speculative_accept(p, uniform, torch.tensor([3]), torch.tensor([0.999], dtype=torch.float64))
    assert n == 1 and torch.equal(bonus, p[1])
    # p == 0 at the draft token: rejected whatever u
    zero = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    n, residual = speculative_accept(zero, uniform, torch.tensor([0]), torch.tensor([0.0], dtype=torch.float64))
    assert n == 0
    torch.testing.assert_close(residual, torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64))


def test_greedy_is_the_accept_rule_on_one_hot_distributions():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    p = probs_from_logits(logits, do_sample=False)
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    q = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)  # the draft proposed token 0, the target wants 1
    for u in (0.0, 0.5, 0.999):
        n, next_probs = speculative_accept(p, q, torch.tensor([0]), torch.tensor([u], dtype=torch.float64))
        assert n == 0 and torch.equal(next_probs, p[0])  # residual of one-hots = the target's argmax
        n, next_probs = speculative_accept(p, p[:1], torch.tensor([1]), torch.tensor([u], dtype=torch.float64))
        assert n == 1 and torch.equal(next_probs, p[1])


# --- whole generations: exact greedy equality ----------------------------------------------------------------

@pytest.mark.parametrize("K,max_new", [(1, 10), (2, 17), (4, 13), (5, 20), (8, 3), (3, 0)])
def test_greedy_speculative_equals_plain_greedy_of_the_target(K, max_new):
    target, draft = tiny_gpt(1, n_layer=2), tiny_gpt(2)
    for seed in range(3):
        prompt = torch.randint(0, 5, (1, 4 + seed), generator=torch.Generator().manual_seed(seed))
        out = speculative_generate(target, draft, prompt, max_new, num_draft_tokens=K)
        assert torch.equal(out.tokens, gpt_sample(target, prompt, max_new, greedy=True))  # no cache at all
        assert out.new_tokens == max_new and out.proposed <= K * out.rounds


def test_greedy_speculative_on_the_shipped_pair(shipped):
    target, draft, tok = shipped
    for text, K in (("The for statement is used to", 4), ("Exceptions", 3), ("If the ", 7)):
        prompt = torch.tensor([tok.encode(text)])
        out = speculative_generate(target, draft, prompt, 61, num_draft_tokens=K)
        assert torch.equal(out.tokens, generate(target, prompt, 61))
        assert torch.equal(out.tokens, gpt_sample(target, prompt, 61, greedy=True))
        assert 0 < out.accepted < out.proposed  # the draft is useful but not perfect


def test_a_draft_identical_to_the_target_is_always_accepted_and_earns_the_bonus_token():
    target = tiny_gpt(3)
    prompt = torch.tensor([[1, 2, 3]])
    for do_sample in (False, True):
        out = speculative_generate(target, target, prompt, 20, num_draft_tokens=4, do_sample=do_sample,
                                   generator=torch.Generator().manual_seed(0))
        assert out.accepted == out.proposed == 16 and out.rounds == 4  # 4 rounds of 4 + 1 tokens
        assert out.accepted_per_round == [4, 4, 4, 4] and out.position_rates() == [1.0] * 4


def test_statistics_add_up():
    target, draft = tiny_gpt(1, n_layer=2), tiny_gpt(2)
    out = speculative_generate(target, draft, torch.tensor([[0, 1]]), 25, num_draft_tokens=3, do_sample=True,
                               generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (1, 27) and out.new_tokens == 25 == out.accepted + out.rounds
    assert out.accepted == sum(out.accepted_at) and out.reached[0] == sum(k > 0 for k in out.proposed_per_round)
    assert all(a <= r for a, r in zip(out.accepted_at, out.reached)) and out.target_forwards == out.rounds
    assert out.acceptance_rate == out.accepted / out.proposed


def test_sampling_is_reproducible_with_a_generator_and_greedy_leaves_the_global_rng_alone():
    target, draft = tiny_gpt(1), tiny_gpt(2)
    prompt = torch.tensor([[0, 1]])
    a, b = (speculative_generate(target, draft, prompt, 20, do_sample=True, temperature=0.7,
                                 generator=torch.Generator().manual_seed(5)).tokens for _ in range(2))
    assert torch.equal(a, b)
    state = torch.get_rng_state()
    speculative_generate(target, draft, prompt, 20)
    assert torch.equal(state, torch.get_rng_state())


# --- whole generations: the target's distribution, rollback, bonus ----------------------------------------------

def first_two(target, draft, prompt, K, generator, generate=speculative_generate, speculative_accept=speculative_accept):
    """The first two tokens after prompt, from a generation of three."""
    out = generate(target, draft, prompt, 3, num_draft_tokens=K, do_sample=True, generator=generator,
                   speculative_accept=speculative_accept)
    return out.tokens[0, prompt.shape[1]:prompt.shape[1] + 2]


def joint_target_probs(target, prompt) -> torch.Tensor:
    """p(x1, x2 | prompt) (V, V) from full forward passes of the target (no cache)."""
    V = target.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target(prompt)[0][0, -1].double(), -1)
        seconds = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        p2 = torch.softmax(target(seconds)[0][:, -1].double(), -1)  # (V, V): row x1
    return p1[:, None] * p2


N_GENERATIONS = 1000


def generation_counts(speculative_accept=speculative_accept, K=2):
    target, draft = tiny_gpt(11, n_layer=2, vocab_size=4, scale=0.6), tiny_gpt(12, vocab_size=4, scale=0.6)
    prompt = torch.tensor([[0, 3, 1, 2, 2, 0]])
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(4, 4)
    for _ in range(N_GENERATIONS):
        x1, x2 = first_two(target, draft, prompt, K, gen, speculative_accept=speculative_accept)
        counts[x1, x2] += 1
    return counts, joint_target_probs(target, prompt)


def test_whole_generations_follow_the_target_distribution():
    counts, probs = generation_counts(K=2)
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_the_generation_simulation_sees_a_missing_rollback(monkeypatch):
    monkeypatch.setattr(KVCache, "crop", lambda self, length: None)  # planted: the caches keep the rejected drafts
    try:
        counts, probs = generation_counts(K=2)
    except (IndexError, ValueError, RuntimeError):  # here the stale cache runs ahead of the tokens: nothing left to feed
        return
    assert chi_square_pvalue(counts, probs) < 1e-6


def test_the_generation_simulation_sees_swapped_p_and_q():
    counts, probs = generation_counts(speculative_accept=accept_swapped, K=2)
    assert chi_square_pvalue(counts, probs) < 1e-6


def test_greedy_equality_fails_without_rollback(monkeypatch):
    target, draft = tiny_gpt(1, n_layer=2), tiny_gpt(2)
    prompt = torch.tensor([[0, 1, 2]])
    expected = gpt_sample(target, prompt, 20, greedy=True)
    monkeypatch.setattr(KVCache, "crop", lambda self, length: None)
    with pytest.raises((AssertionError, ValueError, IndexError, RuntimeError)):  # wrong tokens, or the stale cache runs ahead
        assert torch.equal(speculative_generate(target, draft, prompt, 20, num_draft_tokens=4).tokens, expected)


@pytest.mark.parametrize("do_sample", [False, True])
def test_every_round_sees_what_full_forward_passes_see(do_sample):
    """Each round's p and q (what speculative_accept is given) equal the target's and the draft's distributions from full forward
    passes over the committed tokens and the proposals: both caches were rolled back to the committed tokens."""
    target, draft = tiny_gpt(1, n_layer=2), tiny_gpt(2)
    prompt = torch.tensor([[0, 1, 2]])

    def one_hot_next(p, n):  # one-hot next_probs, so that the spy knows every committed token
        return torch.nn.functional.one_hot(p[n].argmax(), p.shape[-1]).double()

    spy = AcceptSpy((target, draft), prompt, 24, 4, do_sample=do_sample, temperature=1.3,
                    override=one_hot_next if do_sample else None, what="test")
    out = speculative_generate(target, draft, prompt, 24, num_draft_tokens=4, do_sample=do_sample, temperature=1.3,
                               generator=torch.Generator().manual_seed(0), speculative_accept=spy)
    assert torch.equal(out.tokens, spy.tokens) and len(spy.calls) == out.rounds
    assert any(a < k for k, a in zip(out.proposed_per_round, out.accepted_per_round))  # some rounds rolled back


# --- small helpers and argument checks ------------------------------------------------------------------------

def test_speculative_generate_runs_the_speculative_accept_it_is_given():
    target, draft = tiny_gpt(0, 2), tiny_gpt(1, 1)
    prompt = torch.tensor([[1, 2, 3]])
    calls = {"speculative_accept": 0}

    def counting_accept(*args):
        calls["speculative_accept"] += 1
        return speculative_accept(*args)

    out = speculative_generate(target, draft, prompt, 12, num_draft_tokens=3, speculative_accept=counting_accept)
    assert torch.equal(out.tokens, speculative_generate(target, draft, prompt, 12, num_draft_tokens=3).tokens)
    assert calls["speculative_accept"] == out.rounds >= 4


def test_the_last_round_may_propose_nothing_and_is_one_plain_step_of_the_target():
    target, draft = tiny_gpt(0, 2), tiny_gpt(1, 1)
    tokens = torch.tensor([[1, 2, 3]])
    out = speculative_generate(target, draft, tokens, 1, num_draft_tokens=3)
    with torch.no_grad():
        expected = target(tokens)[0][0, -1].argmax()
    assert out.proposed_per_round == [0] and out.accepted_per_round == [0]
    assert out.tokens.shape == (1, 4) and out.tokens[0, -1] == expected


def test_expected_tokens_per_round_formula():
    for alpha in (0.0, 0.3, 0.8, 0.999):
        for k in (1, 4, 8):
            assert expected_tokens_per_round(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    assert expected_tokens_per_round(1.0, 4) == 5.0
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        expected_tokens_per_round(1.5, 2)


def test_probs_from_logits_and_draw_token():
    logits = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(probs_from_logits(logits, True, 0.5), torch.softmax(logits.double() * 2, -1))
    assert draw_token(torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)).item() == 2
    # temperature 0: chapter 06's greedy limit, all the mass on the largest logit
    torch.testing.assert_close(probs_from_logits(logits, True, 0.0), torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))


def test_temperature_is_range_checked_by_chapter_06s_processor_only():
    """probs_from_logits and speculative_generate's argument check raise apply_temperature's own ValueError for a
    negative temperature, sampling or greedy, as generate does (a second check with its own range or words fails)."""
    with pytest.raises(ValueError, match=r"temperature must be >= 0") as processor:
        apply_temperature(torch.zeros(1, 5), -0.5)
    with pytest.raises(ValueError) as ours:
        probs_from_logits(torch.zeros(5), True, -0.5)
    assert str(ours.value) == str(processor.value)
    target, draft = tiny_gpt(1), tiny_gpt(2)
    for do_sample in (True, False):
        with pytest.raises(ValueError) as ours:
            speculative_generate(target, draft, torch.zeros(1, 3, dtype=torch.long), 5, do_sample=do_sample,
                                 temperature=-0.5)
        assert str(ours.value) == str(processor.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_draft_tokens=0), "num_draft_tokens must be an integer >= 1"),
    (dict(do_sample=True, temperature=-1.0), "temperature must be >= 0"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=30), r"must fit in the context, block_size = 32"),
    (dict(input_ids=torch.zeros(2, 3, dtype=torch.long)), r"input_ids must have shape \(1, T\)"),
    (dict(draft_vocab=7), "target and draft must share one vocabulary: target vocab_size = 5, draft vocab_size = 7"),
])
def test_bad_arguments_raise_clear_errors(kwargs, message):
    target, draft = tiny_gpt(1), tiny_gpt(2, vocab_size=kwargs.pop("draft_vocab", 5))
    args = dict(input_ids=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=5) | kwargs
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, draft, args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_the_output_keeps_K_and_each_rounds_proposals_up_to_the_end():
    """num_draft_tokens is the K asked, even where no round can propose K (4 new tokens: the first round proposes
    min(K, r - 1) = 3); one entry per round, each round adding its kept proposals and one token, to the end."""
    out = speculative_generate(tiny_gpt(1), tiny_gpt(2), torch.tensor([[0]]), 4)
    assert type(out) is SpeculativeOutput and out.num_draft_tokens == 4 and len(out.reached) == 4
    assert out.tokens.shape == (1, 5) and out.proposed_per_round[0] == 3
    left = 4
    for k, a in zip(out.proposed_per_round, out.accepted_per_round, strict=True):
        assert k == min(4, left - 1) and 0 <= a <= k
        left -= a + 1
    assert left == 0
