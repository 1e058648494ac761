"""Data that needs no download: synthetic toy tasks (and, from chapter 04, the embedded corpus)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
#: digits 0-9 are tokens 3..12
DIGIT_OFFSET = 3
DIGIT_VOCAB_SIZE = DIGIT_OFFSET + 10


@dataclass
class Seq2SeqBatch:
    """A padded batch of a toy sequence-to-sequence task.

    src: (B, S) source tokens, right-padded with PAD
    src_lengths: (B,) true source lengths
    tgt: (B, T) target tokens ending in EOS, right-padded with PAD
    """

    src: torch.Tensor
    src_lengths: torch.Tensor
    tgt: torch.Tensor

    @property
    def src_mask(self) -> torch.Tensor:
        """(B, S) bool, True on real source tokens."""
        return self.src != PAD


def reversal_batch(batch_size: int, min_len: int = 3, max_len: int = 10, generator=None) -> Seq2SeqBatch:
    """Random digit strings and their reversals: "3 1 4" -> "4 1 3 <eos>".

    Lengths are uniform in [min_len, max_len]; the batch is padded to its longest string.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=generator)
    longest = int(lengths.max())
    src = torch.full((batch_size, longest), PAD)
    tgt = torch.full((batch_size, longest + 1), PAD)
    for row, length in enumerate(lengths.tolist()):
        digits = torch.randint(DIGIT_OFFSET, DIGIT_VOCAB_SIZE, (length,), generator=generator)
        src[row, :length] = digits
        tgt[row, :length] = digits.flip(0)
        tgt[row, length] = EOS
    return Seq2SeqBatch(src, lengths, tgt)


def digits_to_text(tokens) -> str:
    """Render digit tokens as a string, stopping at EOS and skipping PAD/BOS."""
    out = []
    for token in (int(t) for t in tokens):
        if token == EOS:
            break
        if token >= DIGIT_OFFSET:
            out.append(str(token - DIGIT_OFFSET))
    return "".join(out)
