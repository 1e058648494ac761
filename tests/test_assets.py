"""The shipped checkpoints: they load, their recorded losses are reproducible, `course pretrain` is deterministic."""
from __future__ import annotations

import json

import pytest
import torch

from course_lib import assets
from course_lib.data import CharTokenizer, default_corpus
from course_lib.gpt import GPT, estimate_loss
from course_lib.pretrain import MODELS, corpus_splits, pretrain
from course_lib.train import fixed_batches


@pytest.fixture(scope="module")
def splits():
    return corpus_splits()


def test_every_model_of_pretrain_is_shipped():
    assert assets.names() == sorted(MODELS)
    for name in MODELS:
        assert (assets.FOLDER / f"{name}.json").is_file()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpoint_loads_and_its_validation_loss_is_the_recorded_one(name, splits):
    _, _, val = splits
    model = assets.load(name)
    record = assets.info(name)
    assert isinstance(model, GPT) and not model.training
    assert model.lm_head.weight is model.transformer.wte.weight
    assert record["config"] == {**vars(model.config)}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert record["bytes"] == (assets.FOLDER / f"{name}.pt").stat().st_size < 5_000_000
    e = record["eval"]
    batches = fixed_batches(val, model.config.block_size, e["batch_size"], e["batches"], e["val_seed"])
    with torch.no_grad():
        val_loss = estimate_loss(model, batches)
    assert abs(val_loss - record["val_loss"]) < 0.02, (val_loss, record["val_loss"])
    assert record["val_loss"] < record["history"][0]["val"]  # training helped


def test_the_tokenizer_is_the_default_corpus_one():
    for name in assets.names():
        assert assets.tokenizer(name).chars == CharTokenizer(default_corpus()).chars


def test_unknown_checkpoint_names_are_rejected():
    with pytest.raises(ValueError, match="name must be one of"):
        assets.load("gpt-5")


def test_pretrain_is_deterministic(tmp_path):
    first = pretrain("char-gpt-draft", tmp_path / "a", steps=3, progress=False)
    second = pretrain("char-gpt-draft", tmp_path / "b", steps=3, progress=False)
    for key in ("train_loss", "val_loss", "history", "parameters", "bytes"):
        assert first[key] == second[key], key
    assert (tmp_path / "a" / "char-gpt-draft.pt").read_bytes() == (tmp_path / "b" / "char-gpt-draft.pt").read_bytes()
    assert json.loads((tmp_path / "a" / "char-gpt-draft.json").read_text())["train"]["steps"] == 3
