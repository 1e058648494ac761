"""Small pretrained checkpoints shipped with the course, made by ``course pretrain`` (see course_lib/pretrain.py).

    char-gpt                 GPT, 4 layers, 4 heads, 128 dims, context 128: the target model of chapters 05-07
    char-gpt-draft           GPT, 1 layer, 4 heads, 64 dims, context 128: its draft for speculative decoding (chapter 07)
    gru-reversal-baseline    GRUSeq2Seq without attention, trained on digit reversal (chapter 01)
    gru-reversal-attention   GRUSeq2Seq with additive attention, the same training (chapter 01)
    transformer-reversal     Transformer, 2 + 2 post-LN layers, trained on digit reversal (chapter 03)
    bpe-gpt                  char-gpt's shape and training on 512 byte-level BPE tokens of the same text (chapter 09)
    char-llama               Llama-style (RMSNorm, SwiGLU, RoPE, 2 key/value heads, untied head), char-gpt's width,
                             depth, context and training (chapter 11)
    induction-2l             AttentionOnly, 2 layers of 2 heads, 32 dims, trained on repeated random tokens: it forms
                             a previous-token head and an induction head (chapter 13)
    induction-1l             the same with 1 layer, trained alike: the control, which cannot form one (chapter 13)

The char-* models are character-level models of the default corpus (``course_lib.data.default_corpus()``).
``<name>.pt`` holds the constructor arguments and the float32 weights (and a character model's
vocabulary); ``<name>.json`` records the model class, how it was trained and what it reached.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..bpe import BPETokenizer
from ..data import CharTokenizer
from ..gpt import GPT, GPTConfig
from ..heads import AttentionOnly
from ..llama import Llama, LlamaConfig
from ..seq2seq import GRUSeq2Seq
from ..encoder_decoder import Transformer

FOLDER = Path(__file__).resolve().parent
#: the model classes a checkpoint may hold, by the name its record gives
MODEL_CLASSES: dict[str, type[nn.Module]] = {"GPT": GPT, "Llama": Llama, "GRUSeq2Seq": GRUSeq2Seq, "Transformer": Transformer,
                                             "AttentionOnly": AttentionOnly}


def names() -> list[str]:
    """The checkpoints available, sorted: ['char-gpt', 'char-gpt-draft', 'gru-reversal-attention', ...]."""
    return sorted(p.stem for p in FOLDER.glob("*.pt"))


def _path(name: str, suffix: str) -> Path:
    path = FOLDER / f"{name}{suffix}"
    if not path.is_file():
        raise ValueError(f"name must be one of {names()}, got {name!r}")
    return path


def info(name: str) -> dict:
    """The training record of a checkpoint: model class and config, recipe, losses, figures reached, seconds, bytes."""
    return json.loads(_path(name, ".json").read_text())


def _checkpoint(name: str) -> dict:
    return torch.load(_path(name, ".pt"), map_location="cpu", weights_only=True)


def build(model: str, config: dict, gpt: type[nn.Module] = GPT) -> nn.Module:
    """A freshly initialised model: MODEL_CLASSES[model](**config) (a GPT takes GPTConfig(**config), a Llama LlamaConfig(**config)).
    gpt: the class a GPT is built with, the course's by default (the learner's GPT, say)."""
    if model not in MODEL_CLASSES:
        raise ValueError(f"model must be one of {sorted(MODEL_CLASSES)}, got {model!r}")
    if model == "GPT":
        return gpt(GPTConfig(**config))
    if gpt is not GPT:
        raise ValueError(f"gpt holds GPT checkpoints only, this one holds a {model}")
    if model == "Llama":
        return Llama(LlamaConfig(**config))
    return MODEL_CLASSES[model](**config)


def load(name: str, gpt: type[nn.Module] = GPT) -> nn.Module:
    """The pretrained model called name (a GPT, Llama, GRUSeq2Seq, Transformer or AttentionOnly, as its record says), in eval mode.
    gpt: the class a GPT checkpoint is loaded into, the course's by default (the learner's GPT, say), built from the
    same config; its state_dict must have the checkpoint's names and shapes (loaded strictly)."""
    checkpoint = _checkpoint(name)
    model = build(info(name)["model"], checkpoint["config"], gpt)
    model.load_state_dict(checkpoint["state_dict"])
    return model.eval()


def tokenizer(name: str) -> CharTokenizer | BPETokenizer:
    """The tokenizer a language model was trained with: a character model's (char-*) CharTokenizer, a BPE model's
    (bpe-*) BPETokenizer."""
    checkpoint = _checkpoint(name)
    if "merges" in checkpoint:
        return BPETokenizer({(a, b): 256 + i for i, (a, b) in enumerate(checkpoint["merges"])})
    if "vocab" not in checkpoint:
        raise ValueError(f"{name} is not a character model: it has no tokenizer")
    return CharTokenizer(checkpoint["vocab"])
