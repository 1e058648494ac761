"""``course bench train``: one training step of our GPT against Hugging Face's GPT2LMHeadModel.

Both models have the same config and the same weights (``course_lib.hf.to_hf``), see the same
batches and compute the same loss (the mean cross-entropy of every position's logits against the
next token); each step is forward, loss, backward, gradient clipping and an AdamW update. The two
are timed alternately in one process (so background load hits both alike), after a warm-up, and
the median of the repeats is reported. A benchmark, not a test: it prints, it asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from .data import CharTokenizer, default_corpus, get_batch
from .gpt import GPT, GPTConfig


def _step_ours(model, optimizer, x, y):
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def _step_hf(model, optimizer, x, y):
    logits = model(input_ids=x).logits  # (B, T, V); the same loss as ours, on every position
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def bench_train(batch_size: int = 12, block_size: int = 64, n_layer: int = 4, n_embd: int = 128, n_head: int = 4,
                threads: int = 2, warmup: int = 5, repeats: int = 7, steps_per_repeat: int = 10, seed: int = 0) -> dict:
    """Median seconds per training step of ours and of Hugging Face's GPT-2, and their ratio (ours / HF)."""
    from .hf import to_hf

    if repeats < 1 or steps_per_repeat < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, steps_per_repeat >= 1, warmup >= 0; got {repeats}, {steps_per_repeat}, {warmup}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokenizer = CharTokenizer(default_corpus())
        data = torch.tensor(tokenizer.encode(default_corpus()[:200_000]))
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        ours = GPT(config).train()
        theirs = to_hf(ours).train()
        batches = [get_batch(data, block_size, batch_size, torch.Generator().manual_seed(seed + i)) for i in range(8)]
        runs = {"ours": (ours, _step_ours), "hf": (theirs, _step_hf)}
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, (model, _) in runs.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for name, (model, step) in runs.items():  # warm-up: allocator, first-call overheads
            for i in range(warmup):
                step(model, optimizers[name], *batches[i % len(batches)])
        for _ in range(repeats):
            for name, (model, step) in runs.items():  # alternate, so that background load affects both
                start = time.perf_counter()
                for i in range(steps_per_repeat):
                    step(model, optimizers[name], *batches[i % len(batches)])
                times[name].append((time.perf_counter() - start) / steps_per_repeat)
    finally:
        torch.set_num_threads(previous_threads)
    ours_s, hf_s = statistics.median(times["ours"]), statistics.median(times["hf"])
    return {"ours_s": ours_s, "hf_s": hf_s, "ratio": ours_s / hf_s, "times": times,
            "attn_implementation": theirs.config._attn_implementation, "config": config,
            "batch_size": batch_size, "threads": threads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course bench", description="benchmarks (they print; they assert nothing)")
    parser.add_argument("what", choices=["train"], help="train: a training step of our GPT vs Hugging Face's GPT-2")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per repeat (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    args = parser.parse_args(argv)
    result = bench_train(threads=args.threads, repeats=args.repeats, steps_per_repeat=args.steps)
    c = result["config"]
    print(f"training step, batch {result['batch_size']} x block {c.block_size}, {c.n_layer} layers, {c.n_embd} dims, "
          f"{c.n_head} heads, vocab {c.vocab_size}, {result['threads']} threads, median of {args.repeats} x {args.steps} steps")
    print(f"  ours (course_lib.gpt.GPT):          {result['ours_s'] * 1e3:8.2f} ms/step")
    print(f"  Hugging Face GPT2LMHeadModel ({result['attn_implementation']}): {result['hf_s'] * 1e3:8.2f} ms/step")
    print(f"  ratio ours / HF: {result['ratio']:.2f}x  (target <= 1.0x)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
