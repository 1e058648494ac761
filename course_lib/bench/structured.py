"""``course bench structured``: the cost of structured decoding (chapter 15).

Two tables. The token index: for each BPE vocabulary (chapter 09's ``BPETokenizer.train`` on the course's corpus, so
the sizes go from 512 to several thousand) and each pattern, the DFA's states, the index's entries (allowed
(state, token) pairs) and the seconds to build it, ours (``structured.TokenIndex.build``) against xgrammar's
``compile_regex`` and outlines-core's ``Index``. Then one decoding step's constraint work on ``bpe-gpt``'s vocabulary:
ours (mask 512 logits from the index, advance the state) against xgrammar's (``fill_next_token_bitmask``, apply the
bitmask, ``accept_token``), over the same token sequence, timed alternately (``timing.alternate``). Last, chapter 12's
engine on ``bpe-gpt``: tokens per second of a batch where some requests are constrained, against the same batch all
free, in alternating rounds (``bench_engine``). A benchmark, not a test: it prints, it asserts nothing.
"""
from __future__ import annotations

import time

import torch

from ..bpe import BPETokenizer
from ..data import default_corpus
from ..serving import Engine, Request
from ..structured import Constraint, IndexCache, TokenIndex, vocabulary_bytes
from ..structured.libraries import Libraries
from . import timing

#: Vocabulary sizes of the index table (512: bpe-gpt's size) and the corpus characters their BPE is trained on
VOCAB_SIZES = (512, 1024, 2048, 4096)
BPE_CORPUS_CHARS = 200_000
#: Patterns of both tables: a name, a number, a JSON record
PATTERNS = {
    "name": r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
    "number": r"(\+|-)?(0|[1-9]\d*)(\.\d+)?",
    "record": r'\{"name":"[A-Za-z ]{1,12}","age":(0|[1-9][0-9]{0,2}),"city":("Paris"|"Lyon"|"Nice")\}',
}
#: The step table's token sequence: this text, encoded by bpe-gpt's tokenizer, must match PATTERNS["record"]
STEP_TEXT = '{"name":"Ada Lovelace","age":36,"city":"Paris"}'


def _vocab(tokenizer) -> list:
    return [tokenizer.vocab[i] for i in range(tokenizer.vocab_size)]


def bench_index(vocab_sizes=VOCAB_SIZES, patterns=PATTERNS, corpus_chars: int = BPE_CORPUS_CHARS) -> list:
    """One row per (vocabulary size, pattern): states, index entries, and seconds to build ours, xgrammar's and
    outlines-core's (each built once, in turn: building is seconds, not microseconds)."""
    text = default_corpus()[:corpus_chars]
    rows = []
    for size in vocab_sizes:
        vocab = _vocab(BPETokenizer.train(text, size))
        for name, pattern in patterns.items():
            libraries = Libraries(vocab)  # fresh caches: every build below is a first build
            seconds = {}
            start = time.perf_counter()
            index = TokenIndex.build(pattern, vocab)
            seconds["ours"] = time.perf_counter() - start
            start = time.perf_counter()
            libraries.xgrammar(pattern, [])
            seconds["xgrammar"] = time.perf_counter() - start
            start = time.perf_counter()
            libraries.outlines(pattern, [])
            seconds["outlines-core"] = time.perf_counter() - start
            rows.append({"vocab_size": len(vocab), "pattern": name, "states": index.dfa.num_states,
                         "entries": sum(len(row) for row in index.next), "seconds": seconds})
    return rows


def bench_step(pattern: str = PATTERNS["record"], text: str = STEP_TEXT, repeats: int = 20, warmup: int = 2,
               threads: int = 1) -> dict:
    """Median seconds per token of the constraint's work over `text`'s bpe-gpt tokens, ours and xgrammar's, timed
    alternately; the logits are fixed random numbers (the model's forward pass is not timed)."""
    import xgrammar

    from ..assets import tokenizer as asset_tokenizer

    tokenizer = asset_tokenizer("bpe-gpt")
    vocab, ids = _vocab(tokenizer), tokenizer.encode(text)
    index = TokenIndex.build(pattern, vocab)
    libraries = Libraries(vocab)
    libraries.xgrammar(pattern, [])  # compiled, cached
    grammar = libraries.grammars[pattern]
    logits = torch.randn(len(vocab) + 1, generator=torch.Generator().manual_seed(0))

    def ours():
        constraint = Constraint(index)
        for t in ids:
            constraint.mask(logits[:-1])
            constraint.advance(t)

    def theirs():
        matcher = xgrammar.GrammarMatcher(grammar)
        bitmask = xgrammar.allocate_token_bitmask(1, len(vocab) + 1)
        for t in ids:
            matcher.fill_next_token_bitmask(bitmask)
            xgrammar.apply_token_bitmask_inplace(logits.clone()[None], bitmask)
            matcher.accept_token(t)

    with timing.threads(threads):
        runs = timing.alternate({"ours": ours, "xgrammar": theirs}, repeats, warmup)
    return {"tokens": len(ids), "vocab_size": len(vocab), "states": index.dfa.num_states, "threads": threads,
            "per_token_s": {name: run.median / len(ids) for name, run in runs.items()}}


#: The engine table's constraint: JSON records, one per line, without end (a constrained request then runs to its
#: max_new_tokens as a free one does: both batches generate the same number of tokens in the same steps)
RECORDS = "(" + PATTERNS["record"] + r"\n)+"


def bench_engine(requests: int = 8, constrained: int = 4, max_new_tokens: int = 48, repeats: int = 5,
                 warmup: int = 1, threads: int = 1, seconds: float = 3.0) -> dict:
    """Chapter 12's engine on bpe-gpt, greedy, `requests` requests arriving at once (prompts of the course's corpus),
    served twice per round in alternation: with the first `constrained` of them constrained to RECORDS (compiled
    once, before timing: ``structured.IndexCache``), and all free. Every request generates max_new_tokens tokens in
    both (RECORDS never completes), so the ratio of tokens per second is what the constraint's per-step work
    (mask, argmax of the masked row, advance) costs the batch. At least `repeats` rounds, more until they have
    taken `seconds` (a round is a fraction of a second: a few rounds' ratio would be noise)."""
    from ..assets import load, tokenizer as asset_tokenizer

    model, tokenizer = load("bpe-gpt"), asset_tokenizer("bpe-gpt")
    index = IndexCache(vocabulary_bytes(tokenizer)).get(RECORDS)
    text = default_corpus()
    prompts = [tokenizer.encode(text[1000 * i:1000 * i + 60])[:16] for i in range(requests)]
    free = [Request(f"r{i}", prompt, max_new_tokens) for i, prompt in enumerate(prompts)]
    mixed = [Request(r.name, r.prompt, max_new_tokens, constraint=index if i < constrained else None)
             for i, r in enumerate(free)]
    engine = Engine(model, num_blocks=requests * (max_new_tokens + 16) // 8 + requests, block_size=8, token_budget=256)

    def run(batch):
        results, _ = engine.run(batch)
        return sum(len(r.tokens) for r in results.values())

    with timing.threads(threads):
        runs = timing.alternate({"mixed": lambda: run(mixed), "free": lambda: run(free)}, repeats, warmup,
                                seconds=seconds)
    return {"requests": requests, "constrained": constrained, "threads": threads, "rounds": len(runs["free"].seconds),
            "tokens": {name: r.results[0] for name, r in runs.items()},
            "tokens_per_s": {name: r.results[0] / r.median for name, r in runs.items()}}


def format_structured(index_rows: list, step: dict, engine: dict | None = None) -> str:
    """The lines `course bench structured` prints."""
    lines = ["token index: build once per (vocabulary, pattern); seconds of one build each",
             f"{'vocab':>6} {'pattern':8} {'states':>6} {'entries':>8} {'ours':>9} {'xgrammar':>9} {'outlines':>9}"]
    for r in index_rows:
        s = r["seconds"]
        lines.append(f"{r['vocab_size']:6d} {r['pattern']:8} {r['states']:6d} {r['entries']:8d} {s['ours']:9.4f} "
                     f"{s['xgrammar']:9.4f} {s['outlines-core']:9.4f}")
    per = step["per_token_s"]
    lines += ["", f"one step's constraint work (mask {step['vocab_size']} logits, advance), {step['tokens']} tokens of a "
                  f"JSON record, {step['states']} DFA states, {step['threads']} thread(s), median per token:",
              f"  ours (index lookup, masked_fill): {per['ours'] * 1e6:8.1f} us",
              f"  xgrammar (bitmask, apply, accept): {per['xgrammar'] * 1e6:8.1f} us"]
    if engine is not None:
        rate, tokens = engine["tokens_per_s"], engine["tokens"]
        lines += ["", f"the engine on bpe-gpt, {engine['requests']} greedy requests at once, {engine['threads']} "
                      f"thread(s), {engine['rounds']} alternating rounds, median:",
                  f"  mixed / free: {rate['mixed'] / rate['free']:.3f}"]
        n, c = engine["requests"], engine["constrained"]
        labels = {"mixed": f"{c} constrained to JSON records + {n - c} free:", "free": f"all {n} free:"}
        width = max(map(len, labels.values()))
        lines[-1:-1] = [f"  {labels[k]:{width}} {rate[k]:8.1f} tokens/s ({tokens[k]} tokens)" for k in labels]
    return "\n".join(lines)
