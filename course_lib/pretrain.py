"""``course pretrain``: train the course's shipped checkpoints, deterministically, from one registry of recipes.

A ``Recipe`` says everything that decides the weights: the model class and its constructor arguments,
the seed of its initial weights, the training function and its arguments, and the thread count.
``pretrain(name)`` follows ``RECIPES[name]`` and writes ``course_lib/assets/<name>.pt`` (the float32
state dict and the constructor arguments) and ``course_lib/assets/<name>.json`` (the recipe again,
the per-step losses and the figures the model reached, which ``tests/lib/test_assets.py`` recomputes).

    char-gpt, char-gpt-draft   character GPTs of the default corpus (chapters 04-07), 2 threads
    bpe-gpt                    char-gpt's model and training on byte-level BPE tokens of the same text (chapter 09)
    char-llama                 a Llama-style model of char-gpt's width, depth and context, char-gpt's training (chapter 11)
    gru-reversal-baseline      chapter 01's GRU encoder-decoder without attention, 1 thread
    gru-reversal-attention     the same with additive attention, 1 thread
    transformer-reversal       chapter 03's 2 + 2-layer post-LN encoder-decoder transformer, 1 thread
    induction-2l, induction-1l two-layer and one-layer attention-only models of repeated random tokens (chapter 13), 1 thread
    json-gpt                   a small character GPT of synthetic JSON records (data.json_records, chapter 15), 2 threads

The notebooks load these checkpoints instead of training: the same recipe on another CPU takes a
slightly different path (its kernels round differently), so a notebook that trained would print other
figures there. Same recipe, same CPU kind and same torch version give byte-identical files.

    course pretrain                                  # all of them: about 6 minutes on 2 otherwise idle cores (plus about
                                                     # 1 min for the induction pair), plus bpe-gpt (char-gpt's training
                                                     # again; 39 min measured on 2 busy shared cores), plus json-gpt
                                                     # (4.5 min measured on 2 busy shared cores)
    course pretrain --only gru-reversal-attention    # one of them (repeatable)
    course pretrain --only char-gpt-draft --steps 50 --out /tmp/check   # a quick reproducibility check
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import assets
from .bpe import BPETokenizer, train_bpe
from .data import (DIGIT_VOCAB_SIZE, CharTokenizer, Seq2SeqBatch, default_corpus, digits_to_text, json_records,
                   reversal_batch, train_val_split)
from .encoder_decoder import exact_match, train_transformer
from .gpt import count_parameters, estimate_loss, text_nats
from .heads import train_induction
from .kernels import threads
from .seq2seq import evaluate_reversal, train_reversal
from .train import TRAIN_EVAL_SEED, VAL_EVAL_SEED, TrainConfig, fixed_batches, train_gpt

ASSETS = assets.FOLDER
VAL_FRACTION = 0.1
#: the fixed batches every recorded loss of a character model is measured on
EVAL_BATCHES, EVAL_BATCH_SIZE = 16, 32


@dataclass(frozen=True)
class Recipe:
    """How one shipped checkpoint is made; its record (``<name>.json``) repeats every field.

    With ``threads`` threads: ``torch.manual_seed(seed)``, ``model = assets.build(model, config)``,
    then ``train(model, progress=..., **train_args, **evaluate)`` trains it, evaluates it and returns
    what it measured (a dict of record fields: losses, evaluation figures). A character model
    (``corpus=True``) reads the default corpus: its ``vocab_size`` comes from the corpus's
    ``CharTokenizer`` and its vocabulary is saved with the weights; one of the JSON records (``records=True``) alike,
    with ``data.json_records()`` for the corpus.
    """

    model: str  # a class name of assets.MODEL_CLASSES
    config: dict  # its constructor arguments (a GPT's: the GPTConfig fields; a character model gets vocab_size added)
    seed: int  # torch.manual_seed just before the model is built: its initial weights
    train: Callable[..., dict]  # train(model, progress=bool, **train_args, **evaluate) -> record fields
    train_args: dict  # what decides the training (recorded as "train")
    threads: int
    evaluate: dict = field(default_factory=dict)  # what decides the evaluation after training (recorded with its figures)
    corpus: bool = False
    records: bool = False  # a character model of data.json_records() (its vocabulary saved with the weights)
    bpe: bool = False  # a BPE model of the default corpus: config["vocab_size"] tokens, merges learned on the training text


# ----------------------------------------------------------------------------- character GPTs (chapters 04-07)


def corpus_splits(text: str | None = None):
    """(tokenizer, train ids, val ids) of the default corpus (or of text)."""
    text = default_corpus() if text is None else text
    tokenizer = CharTokenizer(text)
    train, val = train_val_split(torch.tensor(tokenizer.encode(text)), VAL_FRACTION)
    return tokenizer, train, val


def evaluation_losses(model: nn.Module, train: torch.Tensor, val: torch.Tensor) -> dict[str, float]:
    """Mean loss on the recorded fixed batches: EVAL_BATCHES x EVAL_BATCH_SIZE blocks of each split."""
    block = model.config.block_size
    return {"train_loss": estimate_loss(model, fixed_batches(train, block, EVAL_BATCH_SIZE, EVAL_BATCHES, TRAIN_EVAL_SEED)),
            "val_loss": estimate_loss(model, fixed_batches(val, block, EVAL_BATCH_SIZE, EVAL_BATCHES, VAL_EVAL_SEED))}


def _train_on_text(model: nn.Module, text: str | None, corpus: str, progress: bool, train_config: dict) -> dict:
    """``train_gpt`` on `text` (None: the default corpus; 90 / 10 split) with TrainConfig(**train_config).

    Returns the corpus (`corpus` names it), the losses reached on the fixed evaluation batches and the periodic
    evaluations."""
    _, train, val = corpus_splits(text)
    history = train_gpt(model, train, val, TrainConfig(**train_config), progress=progress)
    losses = evaluation_losses(model, train, val)
    return {"corpus": corpus, "corpus_chars": len(train) + len(val), "val_fraction": VAL_FRACTION,
            "eval": {"batches": EVAL_BATCHES, "batch_size": EVAL_BATCH_SIZE, "train_seed": TRAIN_EVAL_SEED, "val_seed": VAL_EVAL_SEED},
            **{k: round(v, 4) for k, v in losses.items()},
            "history": [{k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()} for e in history.evals]}


def train_char_gpt(model: nn.Module, progress: bool = True, **train_config) -> dict:
    """``train_gpt`` on the default corpus (90 / 10 split) with TrainConfig(**train_config)."""
    return _train_on_text(model, None, "default_corpus()", progress, train_config)


def train_json_gpt(model: nn.Module, progress: bool = True, **train_config) -> dict:
    """``train_gpt`` on the synthetic JSON records ``data.json_records()`` (90 / 10 split) with TrainConfig(**train_config)."""
    return _train_on_text(model, json_records(), "json_records()", progress, train_config)


def bpe_corpus_splits(vocab_size: int, text: str | None = None):
    """(BPETokenizer, train ids, val ids) of the default corpus (or of text): the text is cut at the same character as
    ``corpus_splits`` cuts it (the last VAL_FRACTION of the characters are the validation text) and the BPE merges
    (``train_bpe``, vocab_size tokens) are learned on the training text alone."""
    text = default_corpus() if text is None else text
    cut = int(len(text) * (1.0 - VAL_FRACTION))  # train_val_split's cut, in characters
    tokenizer = BPETokenizer(train_bpe(text[:cut], vocab_size))
    return tokenizer, torch.tensor(tokenizer.encode(text[:cut])), torch.tensor(tokenizer.encode(text[cut:]))


def bits_per_character(bpe_model: nn.Module, bpe_tokenizer: BPETokenizer, char_model: nn.Module, char_tokenizer: CharTokenizer,
                       text: str) -> dict:
    """Bits per character of a BPE model and a character model on the SAME characters of text: all of them but those
    of the first BPE token (which has no context); bits = total nats / (ln 2 x characters), ``text_nats`` windows."""
    bpe_ids = torch.tensor(bpe_tokenizer.encode(text))
    skip = len(bpe_tokenizer.decode(bpe_ids[:1].tolist()))  # characters of the first BPE token
    chars = len(text) - skip
    bpe_nats = text_nats(bpe_model, bpe_ids, first=1)
    char_nats = text_nats(char_model, torch.tensor(char_tokenizer.encode(text)), first=skip)
    return {"chars": chars, "skipped_chars": skip, "bpe_tokens": len(bpe_ids) - 1,
            "bpe_bits_per_char": bpe_nats / (math.log(2) * chars), "char_bits_per_char": char_nats / (math.log(2) * chars)}


def train_bpe_gpt(model: nn.Module, progress: bool = True, **train_config) -> dict:
    """``train_gpt`` on BPE tokens of the default corpus (``bpe_corpus_splits`` with the model's vocab_size) with
    TrainConfig(**train_config): the same blocks of block_size tokens, now ~2 characters per token."""
    tokenizer, train, val = bpe_corpus_splits(model.config.vocab_size)
    history = train_gpt(model, train, val, TrainConfig(**train_config), progress=progress)
    losses = evaluation_losses(model, train, val)
    text = default_corpus()
    model.eval()
    bits = bits_per_character(model, tokenizer, assets.load("char-gpt"), assets.tokenizer("char-gpt"),
                              text[int(len(text) * (1.0 - VAL_FRACTION)):])
    return {"corpus": "default_corpus()", "corpus_chars": len(default_corpus()), "val_fraction": VAL_FRACTION,
            "tokenizer": {"merges": len(tokenizer.merges), "trained_on": "the training text", "train_tokens": len(train),
                          "val_tokens": len(val)},
            "eval": {"batches": EVAL_BATCHES, "batch_size": EVAL_BATCH_SIZE, "train_seed": TRAIN_EVAL_SEED, "val_seed": VAL_EVAL_SEED},
            **{k: round(v, 4) for k, v in losses.items()},
            "val_text": {**bits, "bpe_bits_per_char": round(bits["bpe_bits_per_char"], 4),
                         "char_bits_per_char": round(bits["char_bits_per_char"], 4), "char_model": "char-gpt"},
            "history": [{k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()} for e in history.evals]}


# ----------------------------------------------------------------------------- reversal models (chapters 01 and 03)


def unseen_reversal_strings(steps: int, batch_size: int, seed: int, candidates: int, candidate_seed: int) -> Seq2SeqBatch:
    """The held-out set of the reversal notebooks: reversal_batch(candidates) drawn with candidate_seed,
    less every string that training saw (its steps batches of batch_size, replayed from its seed)."""
    replay = torch.Generator().manual_seed(seed)
    seen = {digits_to_text(row) for _ in range(steps) for row in reversal_batch(batch_size, generator=replay).src}
    batch = reversal_batch(candidates, generator=torch.Generator().manual_seed(candidate_seed))
    unseen = torch.tensor([digits_to_text(row) not in seen for row in batch.src])
    return Seq2SeqBatch(batch.src[unseen], batch.src_lengths[unseen], batch.tgt[unseen])


def held_out_record(held_out: Seq2SeqBatch, exact: torch.Tensor, candidates: int, candidate_seed: int) -> dict:
    """Counts on the held-out set, overall and per source length: strings, and strings reversed exactly (greedy)."""
    lengths = held_out.src_lengths
    by_length = {n: lengths == n for n in sorted(set(lengths.tolist()))}
    return {"candidates": candidates, "candidate_seed": candidate_seed, "strings": len(lengths), "exact": int(exact.sum()),
            "strings_by_length": {str(n): int(rows.sum()) for n, rows in by_length.items()},
            "exact_by_length": {str(n): int(exact[rows].sum()) for n, rows in by_length.items()}}


def rounded(losses: list[float]) -> list[float]:
    """Per-step losses, rounded to 4 decimals for the record."""
    return [round(loss, 4) for loss in losses]


def train_gru_reversal(model: nn.Module, steps: int, batch_size: int, seed: int, lr: float, candidates: int,
                       candidate_seed: int, progress: bool = True) -> dict:
    """Chapter 01: ``train_reversal(model, steps, batch_size, lr, seed)``, then greedy exact match (and, with
    attention, alignment: the attention argmax on the digit being copied) on the held-out strings."""
    run = train_reversal(model, steps=steps, batch_size=batch_size, lr=lr, seed=seed, progress=progress)
    held_out = unseen_reversal_strings(steps, batch_size, seed, candidates, candidate_seed)
    result = evaluate_reversal(model, held_out)
    record = {"losses": rounded(run.losses), "held_out": held_out_record(held_out, result["exact"], candidates, candidate_seed)}
    if result["alignment"] is not None:
        record["held_out"]["alignment"] = round(result["alignment"], 4)
    return record


def train_transformer_reversal(model: nn.Module, steps: int, batch_size: int, seed: int, lr: float, warmup: int,
                               candidates: int, candidate_seed: int, progress: bool = True) -> dict:
    """Chapter 03: ``train_transformer(model, lambda g: reversal_batch(batch_size, generator=g), steps, lr, warmup,
    seed)``, then greedy exact match on the held-out strings."""
    run = train_transformer(model, lambda generator: reversal_batch(batch_size, generator=generator), steps=steps, lr=lr,
                            warmup=warmup, seed=seed, progress=progress)
    held_out = unseen_reversal_strings(steps, batch_size, seed, candidates, candidate_seed)
    exact, _ = exact_match(model, held_out)
    return {"losses": rounded(run.losses), "held_out": held_out_record(held_out, exact, candidates, candidate_seed)}


# ----------------------------------------------------------------------------- the registry

_CHAR_GPT_TRAINING = asdict(TrainConfig(steps=2000, batch_size=24, lr=3e-3, min_lr=3e-4, warmup_steps=100, eval_every=250, seed=0))

_INDUCTION_TRAINING = {"steps": 3000, "batch_size": 32, "lr": 3e-3, "init_std": 0.1, "seed": 1,
                       "periods": [2, 3, 4, 5, 6, 8, 9, 10, 12, 13, 15, 16]}
_INDUCTION_EVALUATION = {"held_out_periods": [7, 11, 14], "eval_batch": 64, "eval_seed": 7}

RECIPES: dict[str, Recipe] = {
    # the target model of chapters 05-07
    "char-gpt": Recipe("GPT", dict(block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=True), seed=0,
                       train=train_char_gpt, train_args=_CHAR_GPT_TRAINING, threads=2, corpus=True),
    # a much smaller draft model for speculative decoding (chapter 07): same tokenizer, same context
    "char-gpt-draft": Recipe("GPT", dict(block_size=128, n_layer=1, n_head=4, n_embd=64, dropout=0.0, bias=True), seed=0,
                             train=train_char_gpt, train_args=_CHAR_GPT_TRAINING, threads=2, corpus=True),
    # chapter 09: char-gpt's model and training, on 512 byte-level BPE tokens (256 bytes + 256 merges) instead of characters
    "bpe-gpt": Recipe("GPT", dict(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=True), seed=0,
                      train=train_bpe_gpt, train_args=_CHAR_GPT_TRAINING, threads=2, bpe=True),
    # chapter 11: char-gpt's width, depth, context and training, with Llama's block: RMSNorm, SwiGLU (8C/3 wide, rounded
    # up to a multiple of 32), RoPE, grouped-query attention with 2 key/value heads, no biases, an untied head
    "char-llama": Recipe("Llama", dict(block_size=128, n_layer=4, n_head=4, n_embd=128, n_kv_head=2, intermediate_size=352,
                                       rope_base=10000.0, eps=1e-5, window=None, rope_layout="half"), seed=0,
                         train=train_char_gpt, train_args=_CHAR_GPT_TRAINING, threads=2, corpus=True),
    # chapter 01: the seq2seq bottleneck, and the same model with additive attention; the same training for both
    "gru-reversal-baseline": Recipe("GRUSeq2Seq", dict(use_attention=False), seed=0, train=train_gru_reversal,
                                    train_args=dict(steps=400, batch_size=64, seed=1, lr=3e-3), threads=1,
                                    evaluate=dict(candidates=4000, candidate_seed=1234)),
    "gru-reversal-attention": Recipe("GRUSeq2Seq", dict(use_attention=True), seed=0, train=train_gru_reversal,
                                     train_args=dict(steps=400, batch_size=64, seed=1, lr=3e-3), threads=1,
                                     evaluate=dict(candidates=4000, candidate_seed=1234)),
    # chapter 03: a 2 + 2-layer post-LN encoder-decoder transformer
    "transformer-reversal": Recipe("Transformer", dict(src_vocab_size=DIGIT_VOCAB_SIZE, tgt_vocab_size=DIGIT_VOCAB_SIZE, d_model=64,
                                                       n_heads=4, d_ff=128, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0),
                                   seed=0, train=train_transformer_reversal,
                                   train_args=dict(steps=300, batch_size=64, seed=1, lr=2e-3, warmup=50), threads=1,
                                   evaluate=dict(candidates=2000, candidate_seed=1234)),
    # chapter 13: attention-only models (2 heads of 16 dims, no MLP, no LayerNorm) on random tokens with one repeated
    # stretch at a random period and offset; scored on periods 7, 11 and 14, which training never draws. Two layers
    # can compose a previous-token head with an induction head; the one-layer control, trained alike, cannot.
    "induction-2l": Recipe("AttentionOnly", {"vocab_size": 16, "max_len": 32, "d_model": 32, "n_layer": 2, "n_head": 2}, seed=0,
                           train=train_induction, train_args=_INDUCTION_TRAINING, threads=1, evaluate=_INDUCTION_EVALUATION),
    "induction-1l": Recipe("AttentionOnly", {"vocab_size": 16, "max_len": 32, "d_model": 32, "n_layer": 1, "n_head": 2}, seed=0,
                           train=train_induction, train_args=_INDUCTION_TRAINING, threads=1, evaluate=_INDUCTION_EVALUATION),
    # chapter 15: a model that knows the format, to compare free and constrained sampling of JSON records
    "json-gpt": Recipe("GPT", dict(block_size=128, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True), seed=0,
                       train=train_json_gpt, train_args=asdict(TrainConfig(steps=600, batch_size=32, lr=3e-3, min_lr=3e-4,
                                                                           warmup_steps=50, eval_every=150, seed=0)),
                       threads=2, records=True),
}


def recipe(name: str, steps: int | None = None) -> Recipe:
    """RECIPES[name], or the same recipe shortened to steps (for quick checks; never shipped): a GPT's warm-up
    and evaluation interval shrink with it."""
    if name not in RECIPES:
        raise ValueError(f"name must be one of {sorted(RECIPES)}, got {name!r}")
    if steps is None:
        return RECIPES[name]
    args = {**RECIPES[name].train_args, "steps": steps}
    if "warmup_steps" in args:
        args.update(warmup_steps=min(args["warmup_steps"], steps // 10), eval_every=max(1, steps // 4))
    return replace(RECIPES[name], train_args=args)


def save_checkpoint(path: Path, model: nn.Module, config: dict, vocab: str | None = None, merges: list | None = None) -> None:
    """torch.save {"config", ("vocab",) ("merges",) "state_dict"}: the constructor arguments, a character model's
    vocabulary or a BPE model's merges ([[a, b], ...] in the order learned), and the float32 weights (a tied LM
    head is stored once)."""
    weights = model.state_dict()
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in weights.items()}
    tied = "lm_head.weight" in weights and "transformer.wte.weight" in weights and (
        weights["lm_head.weight"].data_ptr() == weights["transformer.wte.weight"].data_ptr())
    if tied:  # a GPT's head is its token embedding: stored once (an AttentionOnly model's head is its own)
        state["lm_head.weight"] = state["transformer.wte.weight"]
    payload = {"config": config, **({"vocab": vocab} if vocab is not None else {}),
               **({"merges": merges} if merges is not None else {}), "state_dict": state}
    torch.save(payload, path)


def train(name: str, steps: int | None = None, progress: bool = True) -> tuple[nn.Module, dict]:
    """Train RECIPES[name] from scratch (steps: a shortened run), in memory.

    Returns the trained model (in eval mode) and its record: what ``<name>.json`` holds, less the file's size.
    Notebooks call this to train a shipped model themselves, by the recipe it was shipped with.
    """
    r = recipe(name, steps)
    tokenizer = CharTokenizer(default_corpus()) if r.corpus else CharTokenizer(json_records()) if r.records else None
    config = {"vocab_size": tokenizer.vocab_size, **r.config} if tokenizer else dict(r.config)
    with threads(r.threads):
        torch.manual_seed(r.seed)
        model = assets.build(r.model, config)
        start, cpu_start = time.perf_counter(), time.process_time()
        results = r.train(model, progress=progress, **r.train_args, **r.evaluate)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    record = {"name": name, "model": r.model, "config": config, "seed": r.seed, "trainer": r.train.__name__,
              "parameters": count_parameters(model), "train": r.train_args, "threads": r.threads, **results,
              "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1)}
    return model.eval(), record


def pretrain(name: str, out: Path = ASSETS, steps: int | None = None, progress: bool = True) -> dict:
    """Train RECIPES[name] from scratch (steps: a shortened run) and write out/<name>.pt and out/<name>.json.

    Returns the record written to the json file.
    """
    model, record = train(name, steps, progress)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.pt"
    r = RECIPES[name]
    vocab = "".join(CharTokenizer(default_corpus() if r.corpus else json_records()).chars) if r.corpus or r.records else None
    merges = [list(pair) for pair in bpe_corpus_splits(record["config"]["vocab_size"])[0].merges] if RECIPES[name].bpe else None
    save_checkpoint(path, model, record["config"], vocab, merges)
    record = {**record, "bytes": path.stat().st_size, "torch": torch.__version__}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def summary(record: dict) -> str:
    """One line about a trained checkpoint: parameters, what it reached, time, size."""
    if "val_loss" in record:
        reached = f"train loss {record['train_loss']:.4f}, val loss {record['val_loss']:.4f}"
    elif "by_period" in record["held_out"]:  # an induction model: its best head at the longest held-out period
        period = str(max(record["held_out"]["periods"]))
        figures = record["held_out"]["by_period"][period]
        reached = (f"loss {record['losses'][0]:.3f} -> {record['losses'][-1]:.4f}; at the held-out period {period}: "
                   f"induction score {max(max(layer) for layer in figures['induction']):.2f}, copy losses "
                   f"{figures['first_copy_loss']:.2f} -> {figures['second_copy_loss']:.2f}")
    else:
        held_out = record["held_out"]
        reached = (f"loss {record['losses'][0]:.3f} -> {record['losses'][-1]:.4f}, exact match "
                   f"{held_out['exact']:,} / {held_out['strings']:,} held-out strings")
    return (f"{record['name']}: {record['parameters']:,} parameters, {reached}, {record['seconds']:.0f} s "
            f"({record['cpu_seconds']:.0f} s CPU) on {record['threads']} thread(s), {record['bytes'] / 1e6:.2f} MB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course pretrain", description="train the shipped checkpoints (deterministic)")
    parser.add_argument("--only", action="append", choices=sorted(RECIPES), help="train only this checkpoint (repeatable)")
    parser.add_argument("--steps", type=int, help="override the number of steps (for a quick check; do not ship)")
    parser.add_argument("--out", type=Path, default=ASSETS, help="output folder (default: course_lib/assets)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in args.only or list(RECIPES):
        record = pretrain(name, args.out, args.steps, progress=not args.no_progress)
        print(f"{summary(record)} -> {args.out / (name + '.pt')}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
