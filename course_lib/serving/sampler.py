"""The next token of each sequence from its logits (vLLM's ``sample/sampler.py``, nano-vllm's ``layers/sampler.py``):
the argmax for greedy requests, one operation for the whole step; chapter 06's processors and a draw from the
request's own ``torch.Generator`` for the others.
"""
from __future__ import annotations

import torch

from ..decoding import process_logits


def choose_token(logits: torch.Tensor, greedy: int, tokens: list, prompt_len: int, sampling: dict | None, generator) -> int:
    """The next token from one row of logits (V,): `greedy` (the row's argmax, ``argmaxes``) when sampling is None,
    else a draw after chapter 06's processors."""
    if sampling is None:
        return greedy
    ids = torch.tensor([tokens])
    scores = process_logits(logits[None].float(), ids, ids[:, prompt_len:], **sampling)
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def argmaxes(logits: torch.Tensor) -> list:
    """The argmax of every row of logits (n, V), in one operation: n ints (the greedy requests' tokens of a step)."""
    return logits.argmax(-1).tolist()

