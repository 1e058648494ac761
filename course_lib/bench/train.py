"""``course bench train``: one training step of our GPT against Hugging Face's GPT2LMHeadModel.

Both models have the same config and the same weights (``course_lib.hf.to_hf``), see the same batches and compute the
same loss (the mean cross-entropy of every position's logits against the next token); each step is forward, loss,
backward, gradient clipping and an AdamW update. The two are timed alternately in one process (so background load hits
both alike), after a warm-up, and the median of the repeats is reported. A benchmark, not a test: it prints, it
asserts nothing.
"""
from __future__ import annotations

import itertools
import statistics

import torch
import torch.nn.functional as F

from ..data import CharTokenizer, default_corpus, get_batch
from ..gpt import GPT, GPTConfig
from . import timing
from .hf_adapters import attn_implementation

#: Characters of the default corpus the batches are drawn from
CORPUS_CHARS = 200_000
#: Batches drawn (seeded) and cycled through by every step of both models
BATCHES = 8
#: AdamW's learning rate and the gradient norm clipped to, in both models
LEARNING_RATE = 1e-3
GRAD_CLIP = 1.0
#: Timed repeats by default (each of steps_per_repeat steps)
REPEATS = 7


def _update(model, optimizer, loss):
    """Backward, gradient clipping and an AdamW step: the part of a training step both models share."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return loss


def _step_ours(model, optimizer, x, y):
    _, loss = model(x, y)
    return _update(model, optimizer, loss)


def _step_hf(model, optimizer, x, y):
    logits = model(input_ids=x).logits  # (B, T, V); the same loss as ours, on every position
    return _update(model, optimizer, F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)))


def bench_train(batch_size: int = 12, block_size: int = 64, n_layer: int = 4, n_embd: int = 128, n_head: int = 4,
                threads: int = 2, warmup: int = 5, repeats: int = REPEATS, steps_per_repeat: int = 10, seed: int = 0) -> dict:
    """Median seconds per training step of ours and of Hugging Face's GPT-2, and their ratio (ours / HF)."""
    from ..hf import to_hf

    if repeats < 1 or steps_per_repeat < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, steps_per_repeat >= 1, warmup >= 0; got {repeats}, {steps_per_repeat}, {warmup}")
    with timing.threads(threads):
        tokenizer = CharTokenizer(default_corpus())
        data = torch.tensor(tokenizer.encode(default_corpus()[:CORPUS_CHARS]))
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        ours = GPT(config).train()
        theirs = to_hf(ours).train()
        batches = [get_batch(data, block_size, batch_size, torch.Generator().manual_seed(seed + i)) for i in range(BATCHES)]
        steps = {}  # name: one step on the next batch of the cycle (the warm-up's), steps_per_repeat steps (a round's)
        warm = {}
        for name, model, step in (("ours", ours, _step_ours), ("hf", theirs, _step_hf)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
            cycle = itertools.cycle(batches)
            warm[name] = lambda m=model, o=optimizer, s=step, c=cycle: s(m, o, *next(c))
            steps[name] = lambda m=model, o=optimizer, s=step: [s(m, o, *batches[i % len(batches)])
                                                                for i in range(steps_per_repeat)]
        runs = timing.alternate(steps, repeats, warmup, warm=warm)
    times = {name: [s / steps_per_repeat for s in run.seconds] for name, run in runs.items()}
    ours_s, hf_s = statistics.median(times["ours"]), statistics.median(times["hf"])
    return {"ours_s": ours_s, "hf_s": hf_s, "ratio": ours_s / hf_s, "times": times,
            "attn_implementation": attn_implementation(theirs), "config": config,
            "batch_size": batch_size, "threads": threads}


def format_train(result: dict, repeats: int, steps_per_repeat: int) -> str:
    """The lines `course bench train` prints."""
    c = result["config"]
    return "\n".join([
        f"training step, batch {result['batch_size']} x block {c.block_size}, {c.n_layer} layers, {c.n_embd} dims, "
        f"{c.n_head} heads, vocab {c.vocab_size}, {result['threads']} threads, median of {repeats} x {steps_per_repeat} steps",
        f"  ours (course_lib.gpt.GPT):          {result['ours_s'] * 1e3:8.2f} ms/step",
        f"  Hugging Face GPT2LMHeadModel ({result['attn_implementation']}): {result['hf_s'] * 1e3:8.2f} ms/step",
        f"  ratio ours / HF: {result['ratio']:.2f}x  (target <= 1.0x)"])
