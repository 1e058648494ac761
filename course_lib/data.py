"""Data that needs no download: synthetic toy tasks (and, from chapter 04, the embedded corpus)."""
from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

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


# --- chapter 04: the embedded corpus, a character-level tokenizer, language-model batches ---------------------


#: the default corpus, shipped: Python's help topics as Python 3.11.7 has them (another Python version has
#: slightly different help texts, and the shipped checkpoints and the notebooks' outputs must not depend on it)
HELP_TOPICS = Path(__file__).resolve().parent / "assets" / "python-help-topics.txt.gz"
HELP_TOPICS_PYTHON = "3.11.7"


def help_topics_text() -> str:
    """The running Python's help topics: the entries of ``pydoc_data.topics.topics`` (the source of
    ``help('if')`` and friends) in sorted key order, joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip("\n") for key in sorted(topics)) + "\n"


def snapshot_help_topics(path: Path = HELP_TOPICS) -> None:
    """Write help_topics_text() to path, gzip-compressed (byte-identical for the same text). It made the
    shipped HELP_TOPICS, on Python HELP_TOPICS_PYTHON."""
    path.write_bytes(gzip.compress(help_topics_text().encode("utf-8"), compresslevel=9, mtime=0))


def default_corpus(path=None) -> str:
    """The course's text corpus: Python's own help topics, or any UTF-8 text file.

    With no ``path``, the shipped snapshot HELP_TOPICS of Python HELP_TOPICS_PYTHON's help topics
    (``help_topics_text()`` there): the same text on every machine, whatever its Python version.
    With a ``path``, that file's contents.
    """
    if path is None:
        return gzip.decompress(HELP_TOPICS.read_bytes()).decode("utf-8")
    text = Path(path).read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"path must name a non-empty text file, got an empty file: {path}")
    return text


class CharTokenizer:
    """Character-level tokenizer: every distinct character of a text is one token, numbered in sorted order.

    ``encode(text) -> list[int]`` and ``decode(ids) -> str`` are inverses on texts made of known
    characters; an unknown character raises a ValueError naming it.
    """

    def __init__(self, text: str):
        if not text:
            raise ValueError("text must contain at least one character")
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as error:
            raise ValueError(f"text contains the character {error.args[0]!r}, which is not in the vocabulary") from None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"token ids must be in [0, {len(self.chars) - 1}], got {bad[0]}")
        return "".join(self.chars[i] for i in ids)


#: The JSON records of chapter 15's json-gpt: their schema, and the values the generator draws from
RECORD_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 16},
    "age": {"type": "integer"},
    "city": {"enum": ["Paris", "Lyon", "Nice", "Lille", "Brest"]},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"]}
RECORD_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Tony", "Leslie",
                "Margaret", "Niklaus", "Sophie", "Dennis", "Ken", "Guido", "Hedy", "Claude", "Karen"]
RECORD_TAGS = ["math", "code", "chess", "music", "radio", "logic", "art", "tea", "maps", "boats"]


def json_records(n: int = 4000, seed: int = 0) -> str:
    """n synthetic JSON records of RECORD_SCHEMA, one per line, compact (no spaces), properties in the schema's
    order: the same text on every machine (Python's random, seeded). Names are one or two of RECORD_NAMES, ages
    18..90, tags 0..3 distinct RECORD_TAGS."""
    import json
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        record = {"name": " ".join(rng.sample(RECORD_NAMES, rng.choice((1, 1, 2)))), "age": rng.randint(18, 90),
                  "city": rng.choice(RECORD_SCHEMA["properties"]["city"]["enum"]),
                  "tags": rng.sample(RECORD_TAGS, rng.randint(0, 3))}
        lines.append(json.dumps(record, separators=(",", ":")))
    return "\n".join(lines) + "\n"


def train_val_split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into (train, val): the first 1 - val_fraction of it, then the rest.

    A contiguous split (not a shuffle): validation text is text the model never saw, not a
    re-ordering of sentences it trained on.
    """
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def get_batch(data: torch.Tensor, block_size: int, batch_size: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of a 1-D token tensor for next-token prediction.

    Returns (x, y), both (batch_size, block_size) int64: x = data[i : i + T] at random starts i,
    y = data[i + 1 : i + T + 1], the same block shifted by one, so y[b, t] is the token that follows
    x[b, t].
    """
    if block_size < 1 or batch_size < 1:
        raise ValueError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
    if len(data) < block_size + 1:
        raise ValueError(f"data must hold at least block_size + 1 = {block_size + 1} tokens, got {len(data)}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = data[starts[:, None] + offsets]  # (B, T)
    y = data[starts[:, None] + offsets + 1]  # (B, T): shifted by one
    return x.long(), y.long()
