"""`course bench` runs (smoke tests: the benchmarks themselves are timed by hand, never asserted), and the one
property the benchmarks rest on: the measured bandwidth bound is an upper bound on this machine."""
from __future__ import annotations

import os
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
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
        "ours, cached", "ours int8, cached", "ours bf16, cached", "ours int4, cached", "ours, uncached", "HF generate, use_cache=True",
        "HF generate, use_cache=False")]
    for row in rows:
        assert row["seconds"] > 0 and row["tokens_per_s"] == row["batch_size"] * row["new_tokens"] / row["seconds"]
        assert row["new_tokens"] == (6 if row["impl"].endswith(("cached", "True")) and "uncached" not in row["impl"] else 3)
        hf_row = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["impl"] == "HF generate, use_cache=" +
                      str("uncached" not in row["impl"] and not row["impl"].endswith("False")))
        assert row["ratio_to_hf"] == row["tokens_per_s"] / hf_row["tokens_per_s"]
        assert row["ratio_to_hf"] > 0
        assert row["same_tokens_as_hf"] is True  # greedy, same float32 weights: ours cached writes HF's tokens
    assert result["bound"] is None  # measured for the GPT-2-small shape only
    table = format_decode(result)
    assert "ours, cached" in table and "ours int8, cached" in table and "HF generate, use_cache=False" in table and "vs HF" in table
    assert "ours int4, cached" in table and "ours int4 == a float64 model with int4's dequantized weights" in table
    assert "ours int8 == a float64 model with the same int8 rounding of weights and activations" in table
    assert all(set(row["partings"]) == {"int8", "int4"} for row in rows)
    # the int4 and bfloat16 kernels chosen, each key (format, out, in, group size or bias, threads)
    assert {key[0] for key in result["kernel_choices"]} <= {"int4", "bfloat16"} and "int4_kernels" not in result
    assert f"int8 sums (course_lib.quantize.int8_product, exact either way): {result['int8_product']}" in table


def test_bench_main_decode_quick_prints_the_table(capsys, monkeypatch):
    import course_lib.bench as bench

    original = bench.bench_decode
    monkeypatch.setattr(bench, "bench_decode", lambda **kw: original(**{**kw, "batch_sizes": (1,), "new_tokens": 4}))
    assert main(["decode", "--quick", "--shapes", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "ours, uncached" in out and "HF generate, use_cache=True" in out and "tokens/s" in out
    assert "HF LlamaForCausalLM generate" in out and "llama-small" not in out  # --shapes tiny: the tiny Llama shape only



def test_bench_decode_threads_times_every_row_at_every_count_side_by_side(monkeypatch):
    """Each cached row (ours float32, int8, bfloat16, int4; HF) runs at each thread count it reports, the counts taking
    turns within every round (one loop: background load hits both); the first count's gain is 1; the caller's thread
    count is restored; bad counts are a ValueError naming thread_counts."""
    import pytest

    from course_lib.bench import decode, format_decode_threads

    seen = []  # (model, threads) of every generation, in order

    def spy(run):
        def wrapped(model, *args):
            seen.append((id(model), torch.get_num_threads()))
            return run(model, *args)
        return wrapped

    monkeypatch.setattr(decode, "generate_cached", spy(decode.generate_cached))
    monkeypatch.setattr(decode, "hf_generate", spy(decode.hf_generate))
    threads = torch.get_num_threads()
    result = decode.bench_decode_threads(shapes=("tiny",), batch_sizes=(1,), thread_counts=(1, 2), new_tokens=3,
                                         warmup=0, repeats=2)
    assert torch.get_num_threads() == threads
    impls = ["ours, cached", "ours int8, cached", "ours bf16, cached", "ours int4, cached", "HF generate, use_cache=True"]
    assert sorted((r["impl"], r["threads"]) for r in result["rows"]) == sorted((i, n) for i in impls for n in (1, 2))
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert all(r["gain"] == 1.0 for r in result["rows"] if r["threads"] == 1)
    assert len(seen) == 2 * len(impls) * 2  # 2 rounds of 5 rows at 2 counts
    first_round = seen[:len(seen) // 2]
    assert [n for _, n in first_round] == [1] * len(impls) + [2] * len(impls)  # both counts in every round
    assert len({model for model, _ in first_round}) == len(impls)
    table = format_decode_threads(result)
    assert "2 / 1" in table and all(impl in table for impl in impls)
    for bad in ((), (0, 2), (2, 2)):
        with pytest.raises(ValueError, match="thread_counts must be distinct integers >= 1"):
            decode.bench_decode_threads(shapes=("tiny",), thread_counts=bad)


def test_bench_main_decode_prints_what_more_threads_buy_only_when_asked(capsys, monkeypatch):
    """--thread-counts adds the table of the cached rows at each count; without it, that table is not measured (the
    default run takes no longer)."""
    import course_lib.bench as bench

    monkeypatch.setattr(bench, "bench_decode", lambda **kw: {})
    monkeypatch.setattr(bench, "format_decode", lambda result: "the GPT table")
    asked = []
    monkeypatch.setattr(bench, "bench_decode_threads", lambda **kw: asked.append(kw) or {"kw": kw})
    monkeypatch.setattr(bench, "format_decode_threads", lambda result: f"threads table {result['kw']['thread_counts']}")
    assert main(["decode", "--quick", "--shapes", "tiny", "--family", "gpt"]) == 0
    assert asked == [] and "threads table" not in capsys.readouterr().out
    assert main(["decode", "--quick", "--shapes", "tiny", "--family", "gpt", "--thread-counts", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "the GPT table" in out and "threads table (1, 2)" in out and asked[0]["shapes"] == ["tiny"]


@pytest.mark.parametrize("counts", [["0", "2"], ["-1"], ["2", "2"]])
def test_bench_main_decode_refuses_bad_thread_counts_before_running_anything(capsys, monkeypatch, counts):
    """Bad --thread-counts are refused at once, naming the option, before any table is measured (they were refused
    only by bench_decode_threads, after the GPT and Llama tables had run: minutes of a full run)."""
    import course_lib.bench as bench

    ran = []
    for name in ("bench_decode", "bench_llama_decode", "bench_decode_threads"):
        monkeypatch.setattr(bench, name, lambda name=name, **kw: ran.append(name) or {})
    for name in ("format_decode", "format_llama_decode", "format_decode_threads"):
        monkeypatch.setattr(bench, name, lambda result: "a table")
    with pytest.raises(SystemExit) as exit_:
        main(["decode", "--quick", "--shapes", "tiny", "--thread-counts", *counts])
    assert exit_.value.code == 2 and ran == []
    assert "--thread-counts must be distinct integers >= 1" in capsys.readouterr().err


def test_bench_main_decode_quick_keeps_the_batch_sizes_asked_for(monkeypatch):
    """--quick shortens the runs; the batch sizes typed (--batch-sizes) are still the ones run, for both families
    (the GPT table once ran 1 and 8 whatever was typed)."""
    import course_lib.bench as bench

    asked = {}
    monkeypatch.setattr(bench, "bench_decode", lambda **kw: asked.setdefault("gpt", kw["batch_sizes"]))
    monkeypatch.setattr(bench, "format_decode", lambda result: "")
    monkeypatch.setattr(bench, "bench_llama_decode", lambda **kw: asked.setdefault("llama", kw["batch_sizes"]))
    monkeypatch.setattr(bench, "format_llama_decode", lambda result: "")
    assert main(["decode", "--quick", "--shapes", "tiny", "--batch-sizes", "2", "3"]) == 0
    assert asked == {"gpt": (2, 3), "llama": (2, 3)}

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


def test_bench_grade_prints_every_row(capsys, monkeypatch):
    """`course bench grade` on one chapter, one learner, at --jobs 1 and 2 (a smoke run: it times, it asserts nothing).
    One learner's one chapter at --jobs 1 is one grading run, timed once for its three rows; --jobs 2 is the other."""
    from course_lib.grading import bench

    runs = []
    grade_students = bench.grade_students
    monkeypatch.setattr(bench, "grade_students", lambda *args, **kwargs: runs.append(args) or grade_students(*args, **kwargs))
    assert main(["grade", "--students", "1", "--jobs", "1", "2", "--chapter", "01"]) == 0  # as typed: 01
    assert runs == [(["learner000"], 1), (["learner000"], 2)]
    out = capsys.readouterr().out
    for row in ("nbgrader templates", "01-attention", "chapters at once", "--jobs 1:", "--jobs 2:", "peak memory",
                "a class of 200"):
        assert row in out, out


def test_bench_serve_tiny_run_has_every_system_and_sane_figures():
    """`course bench serve` on 4 requests of the course model, one run: structure and sanity, never speed."""
    from course_lib.bench import SERVE_SYSTEMS, bench_serve, format_serve, serve_ratios

    threads = torch.get_num_threads()
    result = bench_serve(models=("char-gpt",), n_requests=4, warmup=0, repeats=1)
    assert torch.get_num_threads() == threads
    rows = result["rows"]
    ours_order = [SERVE_SYSTEMS[0], SERVE_SYSTEMS[3], SERVE_SYSTEMS[1], SERVE_SYSTEMS[4]]
    assert [(r["arrivals"], r["system"]) for r in rows] == [("all at 0", s) for s in ours_order + [SERVE_SYSTEMS[2]]] + [
        ("trace", s) for s in ours_order]  # Hugging Face has no arrival times: all at 0 only
    for arrivals in ("all at 0", "trace"):
        these = [r for r in rows if r["arrivals"] == arrivals]
        assert len({r["tokens"] for r in these}) == 1 and these[0]["tokens"] > 0  # every system generated the same count
    for row in rows:
        assert row["requests"] == 4 and row["errors"] == 0
        assert row["same_tokens"] is True, row["system"]  # greedy, one model's weights: every system writes the same tokens
        assert row["tokens_per_s"] > 0 and 0 < row["ttft_median"] <= row["ttft_p95"] and 0 < row["tpot_median"] <= row["tpot_p95"]
        assert row["kv_ratio"] >= 1  # never fewer bytes allocated than holding a cached token
    assert next(r for r in rows if r["system"] == SERVE_SYSTEMS[0])["same_tokens"]  # the reference itself
    ratios = serve_ratios(rows)
    assert [(q["arrivals"], q["versus"]) for q in ratios] == [("all at 0", s) for s in ours_order[1:] + [SERVE_SYSTEMS[2]]] + [
        ("trace", s) for s in ours_order[1:]]
    for arrivals in ("all at 0", "trace"):  # reserving the context never allocates less than the oracle, same tokens
        kv = {r["system"]: r["kv_ratio"] for r in rows if r["arrivals"] == arrivals}
        assert kv[SERVE_SYSTEMS[4]] >= kv[SERVE_SYSTEMS[1]]
    assert all(q["tokens_per_s"] > 0 for q in ratios)
    table = format_serve(result)
    for text in (*SERVE_SYSTEMS, "tokens/s", "TTFT", "TPOT", "KV alloc/used", "no notion of arrival", "ours continuous / the other"):
        assert text in table, text


def test_bench_main_serve_quick_prints_the_table(capsys, monkeypatch):
    import course_lib.bench as bench

    original = bench.bench_serve
    monkeypatch.setattr(bench, "bench_serve", lambda **kw: original(**{**kw, "n_requests": 3}))
    wall = bench.bench_serve_wall
    monkeypatch.setattr(bench, "bench_serve_wall", lambda **kw: wall(**{**kw, "n_requests": 3}))
    speed = bench.bench_serve_speed
    monkeypatch.setattr(bench, "bench_serve_speed",
                        lambda **kw: speed(**{**kw, "n_requests": 3, "batch_size": 2, "prompt_len": 4, "new_tokens": 4,
                                              "ratio_seconds": 0}))
    assert main(["serve", "--quick", "--shapes", "char-gpt"]) == 0
    out = capsys.readouterr().out
    assert "char-gpt" in out and "HF continuous + paged" in out and "ours static batching" in out and "gpt2-small" not in out
    assert "wall-clock sweep" in out and "differ from alone" in out
    for row in ("decode-only step, engine / static batching", "ours continuous / HF generate_batch", "2 threads / 1"):
        assert row in out and "(target " in out, row  # the engine's speed against its targets: printed, never asserted
    assert "rounds 1, their middle half" in out  # --quick's one round (ratio_seconds 0 here: no more rounds)


def test_bench_main_serve_refuses_a_decode_shape(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["serve", "--shapes", "tiny"])
    assert "--shapes for serve must be among ['char-gpt', 'gpt2-small']" in capsys.readouterr().err


def test_read_bandwidths_times_every_way_at_every_thread_count_and_restores_the_thread_count():
    from course_lib.bench import read_bandwidth, read_bandwidths

    threads = torch.get_num_threads()
    rates = read_bandwidths(4_000_000, repeats=1, threads=(1, 2), widths=(64,))
    assert {way for way, _ in rates} >= {"sum", "F.linear, width 64"} and {n for _, n in rates} == {1, 2}
    assert all(rate > 0 for rate in rates.values()) and torch.get_num_threads() == threads
    assert read_bandwidth(4_000_000, repeats=1, threads=(1,)) > 0


def test_bench_serve_load_tiny_run_has_every_row():
    """The load sweep of `course bench serve` on 4 requests, one round: its rows and their step counts, never speed."""
    from course_lib.bench import bench_serve_load, format_serve_load

    result = bench_serve_load(rates=(0.5, 2.0), budgets=(8, 64), n_requests=4, repeats=1)
    systems = ["static, oracle", "static, context", "engine, capped 8", "engine"]
    assert [(r["trace"], r["system"]) for r in result["rates"]] == [(rate, s) for rate in (0.5, 2.0) for s in systems]
    assert [(r["trace"], r["system"]) for r in result["budgets"]] == [(2.0, "engine, budget 8"), (2.0, "engine, budget 64")]
    for rate in (0.5, 2.0):
        rows = {r["system"]: r for r in result["rates"] if r["trace"] == rate}
        assert len({r["tokens"] for r in rows.values()}) == 1 and all(r["requests"] == 4 for r in rows.values())
        assert rows["static, oracle"]["steps"] == rows["static, context"]["steps"]  # the same schedule, other memory
    budget_64 = result["budgets"][1]
    engine_top = next(r for r in result["rates"] if r["trace"] == 2.0 and r["system"] == "engine")
    assert budget_64["steps"] == engine_top["steps"] and budget_64["ttft_steps_p95"] == engine_top["ttft_steps_p95"]
    table = format_serve_load(result)
    for text in (*systems, "engine, budget 8", "TTFT steps", "TPOT ms", "not swept"):
        assert text in table, text


def test_bench_serve_wall_tiny_run_has_every_row_and_every_request_generates_its_tokens_alone():
    """The wall-clock sweep of `course bench serve` on 4 requests, two rates, one round: its rows, and each system's
    greedy tokens against each request generated alone (generate_cached, computed here), never speed."""
    import pytest

    from course_lib.bench import WALL_SYSTEMS, bench_serve_wall, format_serve_wall, poisson_arrivals, serve_model
    from course_lib.kv_cache import generate_cached
    from course_lib.serving import make_trace

    threads = torch.get_num_threads()
    result = bench_serve_wall(rates=(200.0, 1000.0), n_requests=4, warmup=0, repeats=1)
    assert torch.get_num_threads() == threads
    model = serve_model("char-gpt")
    requests = make_trace(4, seed=3, context=model.config.block_size, vocab=list(range(model.config.vocab_size)),
                          mean_gap=0)
    with torch.inference_mode():
        alone = [generate_cached(model, torch.tensor([r.prompt]), r.max_new_tokens)[0, len(r.prompt):] for r in requests]
    rows = result["rows"]
    assert [(r["rate"], r["system"]) for r in rows] == [(rate, s) for rate in (200.0, 1000.0) for s in WALL_SYSTEMS]
    for row in rows:
        assert row["requests"] == 4 and row["tokens"] == sum(len(t) for t in alone)
        assert row["differ"] == 0 and row["checked"] == 4, row  # greedy, same weights: each request's tokens alone
        assert row["tokens_per_s"] > 0 and 0 < row["ttft_p50"] <= row["ttft_p95"] and 0 < row["tpot_p50"] <= row["tpot_p95"]
    assert result["hf_threads"] == [1]  # one torch thread in Hugging Face's generation thread too
    arrivals = poisson_arrivals(4, 200.0, 3)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals == poisson_arrivals(4, 200.0, 3)
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(4, 0.0, 3)
    table = format_serve_wall(result)
    for text in (*WALL_SYSTEMS, "wall-clock sweep", "TTFT ms", "TPOT ms", "differ from alone"):
        assert text in table, text


def test_threads_sets_the_count_for_the_block_and_restores_it_even_on_an_error():
    import pytest

    from course_lib.bench import threads

    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with pytest.raises(KeyError):
        with threads(other):
            assert torch.get_num_threads() == other
            raise KeyError("inside")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        with threads(0):
            pass
    assert torch.get_num_threads() == before


def test_alternate_warms_up_then_runs_every_contender_once_per_round_in_the_order_given():
    from course_lib.bench import alternate

    calls = []
    contenders = {name: (lambda name=name: calls.append(name) or len(calls)) for name in ("a", "b", "c")}
    runs = alternate(contenders, repeats=2, warmup=2, warm={"w": lambda: calls.append("w")},
                     order=lambda k: ["c", "a", "b"] if k else ["a", "b", "c"], after_round=lambda: calls.append("|"))
    assert calls == ["w", "w", "a", "b", "c", "|", "c", "a", "b", "|"]
    assert {name: r.results for name, r in runs.items()} == {"a": [3, 8], "b": [4, 9], "c": [5, 7]}
    assert all(len(r.seconds) == 2 and min(r.seconds) >= 0 and r.median == sum(r.seconds) / 2 for r in runs.values())
    calls.clear()
    alternate(contenders, repeats=1, warmup=1)  # no warm dict: the contenders warm themselves up
    assert calls == ["a", "b", "c", "a", "b", "c"]


def test_alternate_runs_more_rounds_than_repeats_until_its_rounds_have_taken_the_seconds_asked():
    import time

    from course_lib.bench import alternate

    runs = alternate({"a": lambda: time.sleep(0.01), "b": lambda: time.sleep(0.01)}, repeats=1, seconds=0.3)
    rounds = len(runs["a"].seconds)
    assert rounds == len(runs["b"].seconds) and 2 <= rounds <= 16, rounds  # a round takes at least 20 ms: at most 15 + 1
    assert len(alternate({"a": lambda: None}, repeats=3, seconds=0.0)["a"].seconds) == 3


def test_course_timing_rounds_caps_alternates_rounds_whatever_repeats_and_seconds_ask(monkeypatch):
    """The knob the run as on another CPU sets (conftest.py): at most COURSE_TIMING_ROUNDS rounds, the warm-up kept."""
    from course_lib.bench import alternate

    monkeypatch.setenv("COURSE_TIMING_ROUNDS", "2")
    calls = []
    runs = alternate({"a": lambda: calls.append("a")}, repeats=5, warmup=1)
    assert calls == ["a"] * 3 and len(runs["a"].seconds) == 2  # one warm-up call, then 2 of the 5 rounds asked
    assert len(alternate({"a": lambda: time.sleep(0.01)}, repeats=1, seconds=0.3)["a"].seconds) == 2  # not ~30
    assert len(alternate({"a": lambda: None}, repeats=1)["a"].seconds) == 1  # fewer asked: as asked
    for bad in ("0", "-1", "two", "1.5", "", "²"):
        monkeypatch.setenv("COURSE_TIMING_ROUNDS", bad)
        with pytest.raises(ValueError, match=f"COURSE_TIMING_ROUNDS must be a whole number >= 1, got '{bad}'"):
            alternate({"a": lambda: None}, repeats=1)


def test_the_hugging_face_adapters_name_the_transformers_version_the_project_pins():
    """hf_adapters reaches into transformers' internals: it must be read again when the pin moves."""
    import re
    from pathlib import Path

    from course_lib.bench import TRANSFORMERS_VERSION

    root = Path(__file__).resolve().parents[2]
    for pins in ("pyproject.toml", "environment.yml"):
        assert re.findall(r"transformers==([\w.]+)", (root / pins).read_text()) == [TRANSFORMERS_VERSION], pins


def test_bench_structured_counts_the_index_entries_the_ground_truth_allows_and_prints_every_row(capsys, monkeypatch):
    """The index table's entries are the (state, token) pairs the partial-match ground truth allows (each state named by
    its shortest prefix); every contender is timed; `course bench structured --quick` prints both tables."""
    import course_lib.bench as bench
    from course_lib.bench.structured import PATTERNS, bench_index
    from course_lib.bpe import BPETokenizer
    from course_lib.checks.ch15 import regex_allows, state_prefixes
    from course_lib.data import default_corpus
    from course_lib.structured import regex_dfa

    (row,) = bench_index(vocab_sizes=(300,), patterns={"number": PATTERNS["number"]}, corpus_chars=5000)
    tokenizer = BPETokenizer.train(default_corpus()[:5000], 300)
    vocab = [tokenizer.vocab[i] for i in range(300)]
    dfa = regex_dfa(PATTERNS["number"])
    allowed = sum(regex_allows(PATTERNS["number"], prefix, token) for prefix in state_prefixes(dfa).values() for token in vocab)
    assert row["vocab_size"] == 300 and row["states"] == dfa.num_states and row["entries"] == allowed
    assert all(seconds > 0 for seconds in row["seconds"].values()) and len(row["seconds"]) == 3

    original = bench.bench_index
    monkeypatch.setattr(bench, "bench_index", lambda **kw: original(vocab_sizes=(300,), corpus_chars=5000))
    assert main(["structured", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n   300 ") == len(PATTERNS) and "ours (index lookup" in out and "xgrammar (bitmask" in out
    assert "2 constrained to JSON records + 2 free:" in out and "all 4 free:" in out and "mixed / free: " in out


def test_bench_structured_engine_row_serves_every_token_constrained_and_free():
    """The engine row: both batches generate every request's max_new_tokens (RECORDS never completes, and no
    constrained request fails), timed over at least the rounds asked."""
    from course_lib.bench.structured import bench_engine

    row = bench_engine(requests=3, constrained=2, max_new_tokens=6, repeats=2, warmup=0, seconds=0.0)
    assert row["tokens"] == {"mixed": 18, "free": 18} and row["rounds"] == 2
    assert all(rate > 0 for rate in row["tokens_per_s"].values())


def test_bench_tensor_parallel_tiny_run_has_every_row_and_one_process_s_tokens(capsys):
    from course_lib.bench import bench_tensor_parallel

    result = bench_tensor_parallel("tiny", (1, 2), new_tokens=4, prompt_len=4, repeats=1, warmup=0)
    assert [(r["name"], r["processes"], r["threads"]) for r in result["rows"]] == [
        ("one process", 1, 1), ("one process", 1, 2), ("tensor-parallel", 1, 1), ("tensor-parallel", 2, 1)]
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in result["rows"])
    assert main(["tensor-parallel", "--tokens", "2", "--repeats", "1", "--world-sizes", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel            2" in out and "same tokens as one process" in out


def test_importing_one_bench_module_imports_no_other_benchmark_and_every_public_name_resolves():
    """`course_lib.bench`'s names are imported on first use: a notebook's `from course_lib.bench.timing import
    alternate` does not pull in every benchmark (bench.structured imports xgrammar and transformers: about a second
    of every timed notebook's first cell). Every name of `__all__` is still there, from the module that defines it."""
    import subprocess
    import sys

    import course_lib.bench as bench

    code = ("import sys, course_lib.bench, course_lib.bench.timing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('xgrammar', 'transformers') "
            "or m.startswith('course_lib.bench.') and m != 'course_lib.bench.timing'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import importlib

    assert set(bench.__all__) <= set(bench._MODULE_OF) | {"main"}
    for name in bench.__all__:
        if name != "main":
            assert getattr(bench, name) is getattr(importlib.import_module(f"course_lib.bench.{bench._MODULE_OF[name]}"), name)
    with pytest.raises(AttributeError, match="no attribute 'bench_nothing'"):
        bench.bench_nothing
