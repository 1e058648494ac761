"""`course bench train` runs (a smoke test: the benchmark itself is timed by hand, never asserted)."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from course_lib.bench import bench_train, main


def test_bench_train_times_both_models_and_restores_the_thread_count(capsys):
    threads = torch.get_num_threads()
    result = bench_train(batch_size=2, block_size=8, n_layer=1, n_embd=16, n_head=2, warmup=1, repeats=1, steps_per_repeat=1)
    assert result["ours_s"] > 0 and result["hf_s"] > 0 and result["ratio"] == result["ours_s"] / result["hf_s"]
    assert torch.get_num_threads() == threads


def test_bench_main_prints_both_times_and_the_ratio(capsys, monkeypatch):
    import course_lib.bench as bench

    original = bench.bench_train
    monkeypatch.setattr(bench, "bench_train", lambda **kw: original(batch_size=2, block_size=8, n_layer=1, n_embd=16, n_head=2, warmup=0, **kw))
    assert main(["train", "--repeats", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours (course_lib.gpt.GPT)" in out and "Hugging Face GPT2LMHeadModel" in out and "ratio ours / HF" in out


def test_bench_decode_quick_on_the_tiny_shape_returns_and_prints_sane_rows(capsys):
    from course_lib.bench import bench_decode, format_decode

    threads = torch.get_num_threads()
    result = bench_decode(shapes=("tiny",), batch_sizes=(1, 2), new_tokens=6, uncached_tokens={"tiny": 3}, warmup=0, repeats=1)
    assert torch.get_num_threads() == threads
    rows = result["rows"]
    assert [(r["batch_size"], r["impl"]) for r in rows] == [(b, impl) for b in (1, 2) for impl in (
        "ours, cached", "ours int8, cached", "ours bf16, cached", "ours, uncached", "HF generate, use_cache=True",
        "HF generate, use_cache=False")]
    for row in rows:
        assert row["seconds"] > 0 and row["tokens_per_s"] == row["batch_size"] * row["new_tokens"] / row["seconds"]
        assert row["new_tokens"] == (6 if row["impl"].endswith(("cached", "True")) and "uncached" not in row["impl"] else 3)
        hf_row = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["impl"] == "HF generate, use_cache=" +
                      str("uncached" not in row["impl"] and not row["impl"].endswith("False")))
        assert row["ratio_to_hf"] == row["tokens_per_s"] / hf_row["tokens_per_s"]
        assert row["ratio_to_hf"] > 0 and row["same_tokens_as_hf"] in (True, False)
    assert result["bound"] is None  # measured for the GPT-2-small shape only
    table = format_decode(result)
    assert "ours, cached" in table and "ours int8, cached" in table and "HF generate, use_cache=False" in table and "vs HF" in table


def test_bench_main_decode_quick_prints_the_table(capsys, monkeypatch):
    import course_lib.bench as bench

    original = bench.bench_decode
    monkeypatch.setattr(bench, "bench_decode", lambda **kw: original(**{**kw, "batch_sizes": (1,), "new_tokens": 4}))
    assert main(["decode", "--quick", "--shapes", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "ours, uncached" in out and "HF generate, use_cache=True" in out and "tokens/s" in out
    assert "HF LlamaForCausalLM generate" in out and "llama-small" not in out  # --shapes tiny: the tiny Llama shape only


def test_bench_llama_decode_quick_on_the_tiny_shape_returns_sane_rows_and_the_same_tokens_as_hf():
    from course_lib.bench import bench_llama_decode, format_llama_decode

    result = bench_llama_decode(shapes=("tiny",), batch_sizes=(1, 2), new_tokens=6, warmup=0, repeats=1)
    rows = result["rows"]
    assert [(r["batch_size"], r["impl"]) for r in rows] == [(b, impl) for b in (1, 2) for impl in (
        "ours (generate_llama)", "HF LlamaForCausalLM generate")]
    for row in rows:
        assert row["seconds"] > 0 and row["tokens_per_s"] == row["batch_size"] * 6 / row["seconds"]
        assert row["same_tokens_as_hf"] is True  # greedy, same weights: the same tokens
    assert rows[1]["ratio_to_hf"] == 1.0 and rows[0]["ratio_to_hf"] == rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    assert "vs HF" in format_llama_decode(result) and "ours (generate_llama)" in format_llama_decode(result)


def test_bench_grade_prints_every_row(capsys):
    """`course bench grade` on one chapter, one learner, at --jobs 1 and 2 (a smoke run: it times, it asserts nothing)."""
    assert main(["grade", "--students", "1", "--jobs", "1", "2", "--chapter", "01"]) == 0  # as typed: 01
    out = capsys.readouterr().out
    for row in ("nbgrader templates", "01-attention", "chapters at once", "--jobs 1:", "--jobs 2:", "peak memory",
                "a class of 200"):
        assert row in out, out
