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

``speculative_accept`` (the acceptance rule) and ``speculative_generate`` (the whole loop) are the reference
solutions of chapter 07's exercises; the notebook's solution cells are the same code
(``tests/grading/test_solution_drift.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import torch
import torch.nn.functional as F

from .decoding import apply_temperature, check_settings
from .kv_cache import KVCache, cached_forward
from .validation import check_positive


def probs_from_logits(logits: torch.Tensor, do_sample: bool = True, temperature: float = 1.0) -> torch.Tensor:
    """The distribution each next token is drawn from: logits (..., V) -> float64 probabilities (..., V).

    Sampling: softmax(logits / temperature), at the temperature of ``decoding.apply_temperature`` (which
    range-checks it; temperature 0 puts all the mass on the largest logit(s)). Greedy (do_sample=False): the
    one-hot vector of the argmax, so that greedy decoding is sampling from a distribution that puts all its mass
    on one token.
    """
    if not do_sample:
        return F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).double()
    return torch.softmax(apply_temperature(logits.double(), temperature), dim=-1)


def draw_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id drawn from probs (V,) (which need not be normalised): a (1, 1) int64 tensor."""
    return torch.multinomial(probs, 1, generator=generator).view(1, 1)


def speculative_accept(p, q, draft_tokens, u):
    """Verify k draft tokens: how many to keep, and the distribution of the token that follows them.

    p (k + 1, V): the target's probabilities at each draft position and at the position after them;
    q (k, V): the draft's probabilities each draft token was drawn from; draft_tokens (k,) int64;
    u (k,): uniform numbers in [0, 1), u[i] the one section 3's acceptance test draws for draft token i
    (the only randomness: the function is deterministic). Returns (n, next_probs): n in 0..k, how many leading draft tokens are kept, and
    next_probs (V,), a distribution (non-negative, summing to 1) for the token after them. Invariant: with
    each draft token drawn from its q and u uniform, every token output (kept drafts, then a draw from
    next_probs) follows the target's p (section 3). Tests: the rule by hand, the distribution after a
    rejection, the one after k kept tokens, and random cases against a float64 formula.
    """
    K = draft_tokens.shape[0]
    for i in range(K):
        x = draft_tokens[i]
        if u[i] >= p[i, x] / q[i, x]:  # rejected (accepted when u < p/q: with probability min(1, p/q))
            residual = (p[i] - q[i]).clamp(min=0)
            return i, residual / residual.sum()
    return K, p[K]


@dataclass
class SpeculativeOutput:
    """What ``speculative_generate`` returns: the tokens, and what each round proposed and kept.

    One entry per round (= per target forward pass) in each list; every statistic the chapter measures
    follows from them. ``reached[i]``: rounds in which draft token i was judged (the tokens before it were
    all accepted); ``accepted_at[i]``: rounds in which it was accepted. Their ratio is the acceptance rate
    at position i.
    """

    tokens: torch.Tensor  # (1, T + max_new_tokens)
    num_draft_tokens: int  # K
    proposed_per_round: list[int] = field(default_factory=list)  # k of each round: K, fewer near the end
    accepted_per_round: list[int] = field(default_factory=list)  # a of each round, 0 <= a <= k

    @property
    def rounds(self) -> int:
        """Draft-then-verify rounds = target forward passes."""
        return len(self.proposed_per_round)

    @property
    def target_forwards(self) -> int:
        return self.rounds

    @property
    def proposed(self) -> int:
        return sum(self.proposed_per_round)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def new_tokens(self) -> int:
        """Each round adds its accepted proposals and one token drawn from the target's side."""
        return self.accepted + self.rounds

    @property
    def reached(self) -> list[int]:
        return [sum(k > i and a >= i for k, a in zip(self.proposed_per_round, self.accepted_per_round))
                for i in range(self.num_draft_tokens)]

    @property
    def accepted_at(self) -> list[int]:
        return [sum(a > i for a in self.accepted_per_round) for i in range(self.num_draft_tokens)]

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


def check_speculative_arguments(target, draft, input_ids, max_new_tokens, num_draft_tokens, do_sample,
                                temperature) -> None:
    """ValueError, naming the argument and what it allows, for arguments ``speculative_generate`` cannot serve."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, T) with T >= 1 (speculative decoding here runs one sequence "
                         f"at a time), got {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_positive("num_draft_tokens", num_draft_tokens)
    check_settings(target.config.vocab_size, temperature=temperature)  # by its processor, greedy or not, as generate
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft must share one vocabulary: target vocab_size = {target.config.vocab_size}, "
                         f"draft vocab_size = {draft.config.vocab_size}")
    block_size = min(target.config.block_size, draft.config.block_size)
    if input_ids.shape[1] + max_new_tokens > block_size:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) must fit in "
                         f"the context, block_size = {block_size} (the smaller of target's and draft's)")


@torch.no_grad()
def speculative_generate(target, draft, input_ids, max_new_tokens: int, *, num_draft_tokens: int = 4,
                         do_sample: bool = False, temperature: float = 1.0, generator: torch.Generator | None = None,
                         speculative_accept=speculative_accept) -> SpeculativeOutput:
    """Extend input_ids (1, T) by exactly max_new_tokens tokens with speculative decoding.

    target, draft: chapter 04's GPT models, in eval mode, one vocabulary of V tokens. Rounds: the draft
    proposes up to K = num_draft_tokens tokens, the target judges them in one forward pass, and
    ``speculative_accept(p, q, draft_tokens, u)`` (exercise 1's function, or the one passed in its place, with
    its contract: p (k + 1, V), q (k, V), draft_tokens (k,), u (k,) float64 uniform in [0, 1), k proposals)
    gives a, how many are kept, and next_probs (V,), the distribution of the round's last token. The
    probabilities are those of probs_from_logits(logits, do_sample, temperature) for both models.

    What the tests check:
    * tokens (1, T + max_new_tokens), the prompt first: with do_sample=False exactly the target's greedy
      tokens; with do_sample=True they follow the target's distribution softmax(logits / temperature), and
      every random draw uses `generator`, in this order in each round: the k proposals (draw_token), then
      u = torch.rand(k, generator=generator, dtype=torch.float64), then the round's last token (draw_token);
      so the same seed gives the same tokens as the course's loop.
    * a round that starts with r tokens still to generate proposes k = min(K, r - 1) tokens (the last
      round may propose none), calls ``speculative_accept`` once, and adds its a kept proposals and one token
      drawn from next_probs.
    * each round makes ONE target forward pass (the first also reads the prompt), with chapter 05's KV
      caches: over the whole generation the target reads T + (proposals) + (rounds - 1) positions.
    * the result is SpeculativeOutput(tokens, K, proposed_per_round, accepted_per_round): k and a of
      each round, in order.
    Bad arguments raise ValueError (check_speculative_arguments).
    """
    check_speculative_arguments(target, draft, input_ids, max_new_tokens, num_draft_tokens, do_sample, temperature)
    if not do_sample:
        generator = torch.Generator()  # greedy draws nothing that matters: leave the global random state alone
    total = input_ids.shape[1] + max_new_tokens
    target_cache, draft_cache = KVCache.for_model(target, 1, total), KVCache.for_model(draft, 1, total)
    tokens, proposed, accepted = input_ids, [], []
    while tokens.shape[1] < total:
        n = tokens.shape[1]
        K = min(num_draft_tokens, total - n - 1)  # a round adds at most K + 1 tokens: none past the end
        # 1. draft K tokens, one cached pass each (the first also feeds what the draft's cache lacks)
        new, drafted, q = tokens[:, draft_cache.length:], [], []
        for _ in range(K):
            probs = probs_from_logits(cached_forward(draft, new, draft_cache)[0, -1], do_sample, temperature)  # (V,)
            new = draw_token(probs, generator)  # (1, 1)
            drafted.append(new)
            q.append(probs)
        drafts = torch.cat([tokens[:, :0], *drafted], dim=1)  # (1, K)
        # 2. verify: ONE target pass over what its cache lacks and the K drafts; keep the last K + 1 positions
        logits = cached_forward(target, torch.cat([tokens[:, target_cache.length:], drafts], dim=1), target_cache)
        p = probs_from_logits(logits[0, -(K + 1):], do_sample, temperature)  # (K + 1, V)
        # 3. accept a prefix of the drafts, then draw the correction (or bonus) token
        u = torch.rand(K, generator=generator, dtype=torch.float64)
        a, next_probs = speculative_accept(p, torch.stack(q) if K else p[:0], drafts[0], u)
        a = int(a)
        tokens = torch.cat([tokens, drafts[:, :a], draw_token(next_probs, generator)], dim=1)
        # 4. roll back both caches to the committed tokens but the newest (the next round feeds it)
        target_cache.crop(n + a)
        draft_cache.crop(min(draft_cache.length, n + a))  # it never fed its last draft: crop can only forget
        proposed.append(K)
        accepted.append(a)
    return SpeculativeOutput(tokens, num_draft_tokens, proposed, accepted)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Expected new tokens per round when each draft token is accepted independently with probability alpha:
    1 + alpha + ... + alpha^k = (1 - alpha^(k + 1)) / (1 - alpha)  (k + 1 when alpha = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
