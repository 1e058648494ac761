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


def choose_token(logits: torch.Tensor, greedy: int, tokens: list, prompt_len: int, sampling: dict | None, generator,
                 processors: dict | None = None) -> int:
    """The next token from one row of logits (V,): `greedy` (the row's argmax, ``argmaxes``) when sampling is None;
    else chapter 06's processors, then a draw, or the argmax at a temperature below ``GREEDY_BELOW`` (0 included):
    the penalties apply before it, as in OpenAI's API and vLLM (the warpers cannot move the argmax).

    processors: the processor functions ``process_logits`` runs, as its keywords (``Engine.reset``'s); default its own."""
    if sampling is None:
        return greedy
    ids = torch.tensor([tokens])
    if sampling.get("temperature", 1.0) < GREEDY_BELOW:
        settings = {key: value for key, value in sampling.items() if key != "temperature"}
        return int(greedy_choice(process_logits(logits[None].float(), ids, ids[:, prompt_len:], **settings,
                                                **(processors or {}))))
    scores = process_logits(logits[None].float(), ids, ids[:, prompt_len:], **sampling, **(processors or {}))
    return int(sample_choice(scores, generator))  # the course's one sampler, on the request's own generator


def argmaxes(logits: torch.Tensor) -> list:
    """The argmax of every row of logits (n, V), in one operation: n ints (the greedy requests' tokens of a step)."""
    return greedy_choice(logits)[:, 0].tolist()

