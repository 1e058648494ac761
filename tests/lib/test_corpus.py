"""course_lib.data, chapter 04 part: the embedded corpus, the character tokenizer, train/val split and LM batches."""
from __future__ import annotations

import gzip
import platform

import pytest
import torch

from course_lib import assets
from course_lib.data import (HELP_TOPICS, HELP_TOPICS_PYTHON, CharTokenizer, default_corpus, get_batch, help_topics_text,
                             snapshot_help_topics, train_val_split)


def test_default_corpus_is_the_shipped_snapshot_of_python_3_11_7_help_topics():
    text = default_corpus()
    assert text == default_corpus()
    assert gzip.decompress(HELP_TOPICS.read_bytes()).decode("utf-8") == text
    assert len(text) > 400_000
    # the checkpoints were trained on it: their vocabulary is its characters
    assert assets.tokenizer("char-gpt").chars == sorted(set(text))
    if platform.python_version() == HELP_TOPICS_PYTHON:
        assert text == help_topics_text()
    else:  # another Python: its help texts differ a little, the shipped corpus does not
        from pydoc_data.topics import topics

        same = [key for key in topics if topics[key].strip("\n") in text]
        assert len(same) > 0.5 * len(topics)


def test_the_snapshot_is_written_byte_identically(tmp_path):
    """snapshot_help_topics writes the gzip of help_topics_text() with no time stamp: the same bytes every time."""
    snapshot_help_topics(tmp_path / "a.gz")
    snapshot_help_topics(tmp_path / "b.gz")
    assert (tmp_path / "a.gz").read_bytes() == (tmp_path / "b.gz").read_bytes()
    assert gzip.decompress((tmp_path / "a.gz").read_bytes()).decode("utf-8") == help_topics_text()
    if platform.python_version() == HELP_TOPICS_PYTHON:
        assert (tmp_path / "a.gz").read_bytes() == HELP_TOPICS.read_bytes()


def test_default_corpus_reads_any_text_file(tmp_path):
    path = tmp_path / "poem.txt"
    path.write_text("roses are red\n", encoding="utf-8")
    assert default_corpus(path) == "roses are red\n"
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="non-empty text file"):
        default_corpus(tmp_path / "empty.txt")


def test_char_tokenizer_round_trip_and_sorted_vocabulary():
    tok = CharTokenizer("hello world")
    assert tok.chars == sorted(set("hello world")) and tok.vocab_size == 8
    assert tok.encode("hello") == [tok.chars.index(c) for c in "hello"]
    assert tok.decode(tok.encode("world hello")) == "world hello"
    full = CharTokenizer(default_corpus())
    assert full.decode(full.encode(default_corpus()[:5000])) == default_corpus()[:5000]


def test_char_tokenizer_rejects_unknown_characters_and_ids():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match="'z', which is not in the vocabulary"):
        tok.encode("abz")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\], got 3"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="at least one character"):
        CharTokenizer("")


def test_train_val_split_is_contiguous():
    data = torch.arange(100)
    train, val = train_val_split(data, 0.1)
    assert torch.equal(train, torch.arange(90)) and torch.equal(val, torch.arange(90, 100))
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        train_val_split(data, 1.0)
    with pytest.raises(ValueError, match="1-D tensor"):
        train_val_split(data.view(10, 10))


def test_get_batch_targets_are_the_inputs_shifted_by_one():
    data = torch.arange(1000) * 7 % 1009  # distinct values: each token identifies its position
    x, y = get_batch(data, block_size=16, batch_size=8, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x, y):
        start = int((data == row_x[0]).nonzero())
        assert torch.equal(row_x, data[start:start + 16]) and torch.equal(row_y, data[start + 1:start + 17])


def test_get_batch_reaches_the_last_token_and_validates():
    data = torch.arange(10)
    ys = torch.cat([get_batch(data, 9, 4, torch.Generator().manual_seed(s))[1] for s in range(3)])
    assert int(ys.max()) == 9  # the only window of length 9 + 1 ends at the last token
    with pytest.raises(ValueError, match="at least block_size \\+ 1 = 11 tokens"):
        get_batch(data, 10, 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        get_batch(data, 0, 1)
