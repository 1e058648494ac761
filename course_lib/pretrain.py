"""``course pretrain``: train the course's shipped character-level checkpoints, deterministically.

Both models read the default corpus (``course_lib.data.default_corpus()``, Python's help topics)
through a ``CharTokenizer``, split 90 / 10 into train and validation text, and are trained by
``course_lib.train.train_gpt`` with fixed seeds, a fixed number of steps and 2 threads. Each run
writes ``course_lib/assets/<name>.pt`` (float32 state dict, config and vocabulary) and
``course_lib/assets/<name>.json`` (what was trained and the losses it reached on the fixed
evaluation batches that ``tests/test_assets.py`` recomputes).

    course pretrain                      # both models, about 7 minutes on 2 otherwise idle cores
    course pretrain --only char-gpt-draft --steps 50 --out /tmp/check   # a quick reproducibility check
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .data import CharTokenizer, default_corpus, train_val_split
from .gpt import GPT, GPTConfig, count_parameters, estimate_loss
from .train import TRAIN_EVAL_SEED, VAL_EVAL_SEED, TrainConfig, fixed_batches, train_gpt

ASSETS = Path(__file__).resolve().parent / "assets"
THREADS = 2
VAL_FRACTION = 0.1
#: the fixed batches every recorded loss is measured on (the same for both models)
EVAL_BATCHES, EVAL_BATCH_SIZE = 16, 32

#: name -> (model sizes except the vocabulary, training hyper-parameters)
MODELS: dict[str, tuple[dict, TrainConfig]] = {
    # the target model of chapters 05-07
    "char-gpt": (dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
                 TrainConfig(steps=2000, batch_size=24, lr=3e-3, min_lr=3e-4, warmup_steps=100, eval_every=250, seed=0)),
    # a much smaller draft model for speculative decoding (chapter 07): same tokenizer, same context
    "char-gpt-draft": (dict(block_size=128, n_layer=1, n_head=4, n_embd=64),
                       TrainConfig(steps=2000, batch_size=24, lr=3e-3, min_lr=3e-4, warmup_steps=100, eval_every=250, seed=0)),
}


def corpus_splits(text: str | None = None):
    """(tokenizer, train ids, val ids) of the default corpus (or of text)."""
    text = default_corpus() if text is None else text
    tokenizer = CharTokenizer(text)
    train, val = train_val_split(torch.tensor(tokenizer.encode(text)), VAL_FRACTION)
    return tokenizer, train, val


def evaluation_losses(model: GPT, train: torch.Tensor, val: torch.Tensor) -> dict[str, float]:
    """Mean loss on the recorded fixed batches: EVAL_BATCHES x EVAL_BATCH_SIZE blocks of each split."""
    block = model.config.block_size
    return {"train_loss": estimate_loss(model, fixed_batches(train, block, EVAL_BATCH_SIZE, EVAL_BATCHES, TRAIN_EVAL_SEED)),
            "val_loss": estimate_loss(model, fixed_batches(val, block, EVAL_BATCH_SIZE, EVAL_BATCHES, VAL_EVAL_SEED))}


def pretrain(name: str, out: Path = ASSETS, steps: int | None = None, progress: bool = True) -> dict:
    """Train one of MODELS from scratch and write out/<name>.pt and out/<name>.json; returns the json record."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    sizes, train_config = MODELS[name]
    if steps is not None:  # a shorter run with the same recipe (for checks), scaled schedule
        train_config = TrainConfig(**{**asdict(train_config), "steps": steps, "warmup_steps": min(train_config.warmup_steps, steps // 10),
                                      "eval_every": max(1, steps // 4)})
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        tokenizer, train, val = corpus_splits()
        torch.manual_seed(train_config.seed)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, dropout=0.0, bias=True, **sizes)
        model = GPT(config)
        cpu_start = time.process_time()
        history = train_gpt(model, train, val, train_config, progress=progress)
        cpu_seconds = time.process_time() - cpu_start
        losses = evaluation_losses(model, train, val)
    finally:
        torch.set_num_threads(previous_threads)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.pt"
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: stored once
    torch.save({"config": asdict(config), "vocab": "".join(tokenizer.chars), "state_dict": state}, path)
    record = {
        "name": name, "config": asdict(config), "parameters": count_parameters(model), "train": asdict(train_config),
        "threads": THREADS, "corpus": "default_corpus()", "corpus_chars": len(train) + len(val), "val_fraction": VAL_FRACTION,
        "eval": {"batches": EVAL_BATCHES, "batch_size": EVAL_BATCH_SIZE, "train_seed": TRAIN_EVAL_SEED, "val_seed": VAL_EVAL_SEED},
        **{k: round(v, 4) for k, v in losses.items()},
        "history": [{k: round(v, 4) if isinstance(v, float) else v for k, v in e.items()} for e in history.evals],
        "seconds": round(history.seconds, 1), "cpu_seconds": round(cpu_seconds, 1), "bytes": path.stat().st_size,
        "torch": torch.__version__,
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course pretrain", description="train the shipped checkpoints (deterministic)")
    parser.add_argument("--only", action="append", choices=sorted(MODELS), help="train only this model (repeatable)")
    parser.add_argument("--steps", type=int, help="override the number of steps (for a quick check; do not ship)")
    parser.add_argument("--out", type=Path, default=ASSETS, help="output folder (default: course_lib/assets)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in args.only or list(MODELS):
        record = pretrain(name, args.out, args.steps, progress=not args.no_progress)
        print(f"{name}: {record['parameters']:,} parameters, train loss {record['train_loss']:.4f}, val loss "
              f"{record['val_loss']:.4f}, {record['seconds']:.0f} s ({record['cpu_seconds']:.0f} s CPU) on {THREADS} threads, "
              f"{record['bytes'] / 1e6:.2f} MB -> {args.out / (name + '.pt')}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
