"""The next token of each sequence from its logits (vLLM's ``sample/sampler.py``, nano-vllm's ``layers/sampler.py``):
the argmax for greedy requests, one operation for the whole step; chapter 06's processors and the course's one sampler
(``gpt.sample_choice``) on the request's own ``torch.Generator`` for the others. A step's sampled requests are drawn
row by row: each has its own generator, so its draws do not depend on the batch it runs in.
"""
from __future__ import annotations

import torch

from ..decoding import process_logits
from ..gpt import greedy_choice, sample_choice


#: Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): logits divided by a temperature near 0
#: overflow float32 (1e-45 gives inf and NaN probabilities), and the limit tau -> 0+ is the argmax anyway.
GREEDY_BELOW = 1e-5
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")  # the processors a greedy request keeps


def constrain(logits: torch.Tensor, constraint) -> tuple:
    """(masked logits (V,), their argmax): one constrained sequence's row of logits (V,) masked by its
    ``structured.Constraint`` (its state's allowed tokens kept, EOS only in an accepting state, -inf elsewhere), and
    the greedy token of the masked row, for ``choose_token``.

    Where: on the model's logits, BEFORE chapter 06's processors (penalties, temperature, top-k, top-p, min-p) and the
    choice, as vLLM does (its model runner applies the grammar's bitmask to the logits, ``apply_grammar_bitmask``,
    then hands them to its sampler): a -inf stays -inf through every processor, so the processors act among the
    allowed tokens only (top-p's nucleus is taken from the allowed tokens' renormalised probabilities), and the
    log-probabilities reported (``token_logprobs``) give every forbidden token -inf. Only a constrained sequence
    calls this: a free one's row is never copied or masked."""
    masked = constraint.mask(logits)
    return masked, int(greedy_choice(masked[None])[0, 0])


def choose_token(logits: torch.Tensor, greedy: int, tokens: list, prompt_len: int, sampling: dict | None, generator,
                 processors: dict | None = None) -> int:
    """The next token from one row of logits (V,): `greedy` (the row's argmax, ``argmaxes``) when sampling is None;
    else chapter 06's processors, then a draw, or the argmax at a temperature below ``GREEDY_BELOW`` (0 included):
    the penalties apply before it, as in OpenAI's API and vLLM (the warpers cannot move the argmax).

    processors: the processor functions ``process_logits`` runs, as its keywords (``Engine.reset``'s); default its own."""
    if sampling is None:
        return greedy
    return _pick(*scores_drawn_from(logits, tokens, prompt_len, sampling, processors), generator)


def scores_drawn_from(logits: torch.Tensor, tokens: list, prompt_len: int, sampling: dict | None,
                      processors: dict | None = None) -> tuple:
    """(scores (1, V) float32, drawn): the scores ``choose_token`` picks the next token from, and whether it draws
    from softmax(scores) (True) or takes their argmax (False: greedy, or a temperature below ``GREEDY_BELOW``, whose
    scores are the logits after the penalties only: temperature, top-k, top-p and min-p are dropped, as vLLM does
    at temperature 0; no filter moves the argmax)."""
    if sampling is None:
        return logits[None].float(), False
    ids = torch.tensor([tokens])
    drawn = sampling.get("temperature", 1.0) >= GREEDY_BELOW
    settings = sampling if drawn else {key: value for key, value in sampling.items() if key in PENALTIES}
    return process_logits(logits[None].float(), ids, ids[:, prompt_len:], **settings, **(processors or {})), drawn


def _pick(scores: torch.Tensor, drawn: bool, generator) -> int:
    # the course's one sampler, on the request's own generator; or the argmax
    return int(sample_choice(scores, generator) if drawn else greedy_choice(scores))


def choose_with_logprobs(logits: torch.Tensor, greedy: int, tokens: list, prompt_len: int, sampling: dict | None,
                         generator, processors: dict | None, k: int) -> tuple:
    """``choose_token``'s token (the same draw from the same generator) and its ``token_logprobs`` with the top k."""
    scores, drawn = scores_drawn_from(logits, tokens, prompt_len, sampling, processors)
    token = greedy if sampling is None else _pick(scores, drawn, generator)
    return token, token_logprobs(scores[0], token, k)


def token_logprobs(scores: torch.Tensor, token: int, k: int) -> tuple:
    """(log-probability of `token`, [(token id, log-probability)] of the k most likely, most likely first) under
    log_softmax(scores), scores (V,) from ``scores_drawn_from``.

    Which distribution: the one the token was drawn from, AFTER the processors (penalties, temperature, top-k,
    top-p, min-p): a token a filter removed has log-probability -inf, and the chosen one is never -inf. A greedy
    request (no sampling settings, or a temperature below GREEDY_BELOW) takes an argmax and draws from nothing: its
    distribution is the model's softmax after the penalties only (temperature 1, no filter). vLLM returns the raw
    model's log-probabilities by default (``logprobs_mode="raw_logprobs"``, before any processor; "processed_logprobs"
    gives these): we report what the sampler actually used, so that the log-probability of a sampled sequence is
    the sum of its tokens' and its top-k are the tokens it could have drawn, which the raw model's are not."""
    logprobs = torch.log_softmax(scores.double(), dim=-1)
    values, ids = torch.topk(logprobs, k) if k else (logprobs[:0], logprobs[:0].long())
    return float(logprobs[token]), list(zip(ids.tolist(), values.tolist()))


def argmaxes(logits: torch.Tensor) -> list:
    """The argmax of every row of logits (n, V), in one operation: n ints (the greedy requests' tokens of a step)."""
    return greedy_choice(logits)[:, 0].tolist()

