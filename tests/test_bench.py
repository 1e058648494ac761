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
