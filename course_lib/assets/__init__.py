"""Small pretrained checkpoints shipped with the course, made by ``course pretrain`` (see course_lib/pretrain.py).

    char-gpt          4 layers, 4 heads, 128 dims, context 128: the target model of chapters 05-07
    char-gpt-draft    1 layer, 4 heads, 64 dims, context 128: its draft for speculative decoding (chapter 07)

Both are character-level models of the default corpus (``course_lib.data.default_corpus()``);
``<name>.json`` records how each was trained and the losses it reached.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..data import CharTokenizer
from ..gpt import GPT, GPTConfig

FOLDER = Path(__file__).resolve().parent


def names() -> list[str]:
    """The checkpoints available: ['char-gpt', 'char-gpt-draft']."""
    return sorted(p.stem for p in FOLDER.glob("*.pt"))


def _path(name: str, suffix: str) -> Path:
    path = FOLDER / f"{name}{suffix}"
    if not path.is_file():
        raise ValueError(f"name must be one of {names()}, got {name!r}")
    return path


def info(name: str) -> dict:
    """The training record of a checkpoint: config, steps, losses, seconds, size on disk."""
    return json.loads(_path(name, ".json").read_text())


def _checkpoint(name: str) -> dict:
    return torch.load(_path(name, ".pt"), map_location="cpu", weights_only=True)


def load(name: str) -> GPT:
    """The pretrained GPT called name, in eval mode."""
    checkpoint = _checkpoint(name)
    model = GPT(GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def tokenizer(name: str) -> CharTokenizer:
    """The character tokenizer the checkpoint was trained with."""
    return CharTokenizer(_checkpoint(name)["vocab"])
