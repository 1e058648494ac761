"""Speculative decoding, chapter 07: a small draft model proposes, the target model verifies.

Generating with a large model is latency-bound: each new token needs one full forward pass, and
the passes are sequential. Speculative decoding (Leviathan et al., 2023; Chen et al., 2023) lets a
cheap *draft* model propose K tokens one at a time, then scores all K with ONE cached forward pass
of the *target* over the chunk. Draft token i is accepted with probability min(1, p_i(x) / q_i(x))
(p: target, q: draft, both at that position); at the first rejection the next token is drawn from
the residual norm(max(0, p_i - q_i)), and if all K are accepted the target's distribution after
them gives one more, *bonus*, token. The tokens produced follow the target's distribution exactly;
with greedy verification they are exactly the target's greedy tokens. Rejected draft tokens are
rolled back from both KV caches (``KVCache.crop``).

Shapes: K draft tokens, V vocabulary, n committed tokens. Batch size 1 only (each row of a batch
would accept a different number of tokens, and the caches hold one length for all rows).

``speculative_accept`` and ``speculative_step`` are the reference solutions of chapter 07's
exercises; the notebook's solution cells are the same code (``tests/grading/test_solution_drift.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .kv_cache import KVCache, cached_forward


def probs_from_logits(logits: torch.Tensor, do_sample: bool = True, temperature: float = 1.0) -> torch.Tensor:
    """The distribution each next token is drawn from: logits (..., V) -> float64 probabilities (..., V).

    Sampling: softmax(logits / temperature). Greedy (do_sample=False): the one-hot vector of the argmax,
    so that greedy decoding is sampling from a distribution that puts all its mass on one token.
    """
    if not do_sample:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).double()
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling (use do_sample=False for greedy), got {temperature}")
    return torch.softmax(logits.double() / temperature, dim=-1)


def draw_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id drawn from probs (V,) (which need not be normalised): a (1, 1) int64 tensor."""
    return torch.multinomial(probs, 1, generator=generator).view(1, 1)


def speculative_accept(p, q, draft_tokens, u):
    """Verify K draft tokens: the acceptance rule, the residual distribution and the bonus token.

    p (K + 1, V): the target's probabilities at each draft position and at the position after them;
    q (K, V): the draft's probabilities each draft token was drawn from; draft_tokens (K,) int64;
    u (K,): uniform random numbers in [0, 1), one per draft token.
    Draft token i = x is accepted when u[i] < p[i, x] / q[i, x] (probability min(1, p/q)), in order,
    until the first rejection. Returns (n, next_probs): the number n of accepted tokens (0..K) and the
    distribution (V,) of the token that follows them: the residual norm(max(0, p[n] - q[n])) after a
    rejection, or the target's own p[K] (the bonus token) when all K are accepted.
    """
    K = draft_tokens.shape[0]
    for i in range(K):
        x = draft_tokens[i]
        if u[i] >= p[i, x] / q[i, x]:  # rejected (accepted when u < p/q: with probability min(1, p/q))
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return K, p[K]


def speculative_step(target, draft, tokens, target_cache, draft_cache, num_draft_tokens, *, do_sample=False,
                     temperature=1.0, generator=None, accept=speculative_accept):
    """One round of draft-then-verify for a batch of one: tokens (1, n) -> (tokens (1, n + a + 1), a).

    Each cache holds the keys and values of (at most) the first n - 1 committed tokens; what it lacks
    is fed first. The draft proposes K = num_draft_tokens tokens (K cached forward passes), the target
    scores them in ONE cached forward pass, ``accept`` keeps a of them and gives the distribution of one
    more token. Rollback: afterwards the target cache holds exactly n + a slots, every committed token
    but the newest (which the next round feeds), and the draft cache min(its length, n + a): it never
    fed its last proposal, so it is one slot short when all K are accepted, and crop can only forget.
    Neither cache keeps a rejected proposal. K = 0 is plain decoding with the target: no draft pass,
    a = 0, one token drawn from the target's distribution. Sampling (do_sample=True): both models'
    probabilities are softmax(logits / temperature) (probs_from_logits), and every random draw (the
    drafts, u, the next token) uses `generator`, so a seeded generator repeats the round exactly.
    Returns the extended tokens and a.
    """
    n, K = tokens.shape[1], num_draft_tokens
    # 1. draft K tokens, one at a time (its first pass also feeds the committed tokens its cache lacks)
    new, drafted, q = tokens[:, draft_cache.length:], [], []
    for _ in range(K):
        probs = probs_from_logits(cached_forward(draft, new, draft_cache)[0, -1], do_sample, temperature)  # (V,)
        new = draw_token(probs, generator)  # (1, 1)
        drafted.append(new)
        q.append(probs)
    drafts = torch.cat([tokens[:, :0], *drafted], dim=1)  # (1, K)
    # 2. verify: one target pass over the tokens its cache lacks and the K drafts; keep the last K + 1 positions
    logits = cached_forward(target, torch.cat([tokens[:, target_cache.length:], drafts], dim=1), target_cache)
    p = probs_from_logits(logits[0, -(K + 1):], do_sample, temperature)  # (K + 1, V)
    # 3. accept a prefix of the drafts, then draw the correction (or bonus) token
    u = torch.rand(K, generator=generator, dtype=torch.float64)
    a, next_probs = accept(p, torch.stack(q) if K else p[:0], drafts[0], u)
    tokens = torch.cat([tokens, drafts[:, :a], draw_token(next_probs, generator)], dim=1)
    # 4. roll back both caches: forget the rejected drafts (the newest token is fed next round)
    target_cache.crop(n + a)
    draft_cache.crop(min(draft_cache.length, n + a))
    return tokens, a


@dataclass
class SpeculativeOutput:
    """What ``speculative_generate`` returns: the tokens and how the drafts fared.

    ``reached[i]``: rounds in which draft token i was judged (the tokens before it were all accepted);
    ``accepted_at[i]``: rounds in which it was accepted. Their ratio is the acceptance rate at position i.
    """

    tokens: torch.Tensor  # (1, T + max_new_tokens)
    num_draft_tokens: int
    rounds: int = 0  # draft-then-verify rounds = target forward passes
    proposed: int = 0  # draft tokens proposed (K per round, fewer near the end)
    accepted: int = 0  # draft tokens accepted
    draft_forwards: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def target_forwards(self) -> int:
        return self.rounds

    @property
    def new_tokens(self) -> int:
        return sum(self.accepted_per_round) + self.rounds

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """New tokens per target forward pass (1 for plain decoding)."""
        return self.new_tokens / self.rounds if self.rounds else float("nan")

    def position_rates(self) -> list[float]:
        """Acceptance rate of draft position i, given that it was judged: accepted_at[i] / reached[i]."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached)]


def _check_arguments(target, draft, input_ids, max_new_tokens, num_draft_tokens, do_sample, temperature) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, T) with T >= 1 (speculative decoding here runs one sequence "
                         f"at a time), got {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling (use do_sample=False for greedy), got {temperature}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft must share one vocabulary: target vocab_size = {target.config.vocab_size}, "
                         f"draft vocab_size = {draft.config.vocab_size}")
    block_size = min(target.config.block_size, draft.config.block_size)
    if input_ids.shape[1] + max_new_tokens > block_size:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) must fit in "
                         f"the context, block_size = {block_size} (the smaller of target's and draft's)")


@torch.no_grad()
def speculative_generate(target, draft, input_ids, max_new_tokens: int, *, num_draft_tokens: int = 4,
                         do_sample: bool = False, temperature: float = 1.0,
                         generator: torch.Generator | None = None, step: Callable | None = None,
                         accept: Callable | None = None) -> SpeculativeOutput:
    """Extend input_ids (1, T) by max_new_tokens tokens with speculative decoding.

    The tokens follow the target's distribution (softmax(logits / temperature)); with do_sample=False
    they are exactly the target's greedy tokens. Near the end a round drafts fewer tokens, so that no
    round goes past max_new_tokens (the last round may draft none: K = 0). Both models must be in eval
    mode and share the vocabulary; T + max_new_tokens must fit in both contexts. step and accept: the
    functions that run one round and verify its drafts (default: this module's speculative_step and
    speculative_accept; chapter 07 passes the learner's), called as
    ``step(target, draft, tokens, target_cache, draft_cache, K, do_sample=..., temperature=...,
    generator=..., accept=accept)``. Returns a SpeculativeOutput (tokens (1, T + max_new_tokens) and
    acceptance statistics).
    """
    _check_arguments(target, draft, input_ids, max_new_tokens, num_draft_tokens, do_sample, temperature)
    step, accept = step or speculative_step, accept or speculative_accept
    if not do_sample:
        generator = torch.Generator()  # greedy draws nothing that matters; keep the global random state untouched
    total = input_ids.shape[1] + max_new_tokens
    target_cache, draft_cache = KVCache.for_model(target, 1, total), KVCache.for_model(draft, 1, total)
    out = SpeculativeOutput(tokens=input_ids, num_draft_tokens=num_draft_tokens,
                            reached=[0] * num_draft_tokens, accepted_at=[0] * num_draft_tokens)
    tokens = input_ids
    while tokens.shape[1] < total:
        k = min(num_draft_tokens, total - tokens.shape[1] - 1)
        tokens, a = step(target, draft, tokens, target_cache, draft_cache, k, do_sample=do_sample,
                         temperature=temperature, generator=generator, accept=accept)
        a = int(a)
        out.rounds += 1
        out.proposed += k
        out.accepted += a
        out.draft_forwards += k
        out.accepted_per_round.append(a)
        for i in range(min(a + 1, k)):
            out.reached[i] += 1
            out.accepted_at[i] += i < a
    out.tokens = tokens
    return out


@torch.no_grad()
def plain_cached_generate(model, input_ids, max_new_tokens: int, *, do_sample: bool = False, temperature: float = 1.0,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """The baseline: extend input_ids (1, T) by max_new_tokens tokens, one cached forward pass of `model` each.

    Prefill the prompt, then feed back one token at a time (chapter 05). Returns (1, T + max_new_tokens).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if input_ids.shape[1] + max_new_tokens > model.config.block_size:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) must fit "
                         f"in the context, block_size = {model.config.block_size}")
    cache = KVCache.for_model(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
    tokens, new = input_ids, input_ids
    for _ in range(max_new_tokens):
        logits = cached_forward(model, new, cache)[:, -1]  # (B, V)
        if do_sample:
            new = torch.multinomial(probs_from_logits(logits, True, temperature), 1, generator=generator)
        else:
            new = logits.argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, new], dim=1)
    return tokens


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Expected new tokens per round when each draft token is accepted independently with probability alpha:
    1 + alpha + ... + alpha^k = (1 - alpha^(k + 1)) / (1 - alpha)  (k + 1 when alpha = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
