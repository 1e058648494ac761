"""course_lib.kernels: the faster kernel per weight, measured; the same products as F.linear, the same models.

Oracles: PyTorch's F.linear (float64 where rounding matters), the model's own outputs before the swap,
Hugging Face's generate on the same weights. Which kernel wins is the machine's business: the tests check
that the choice is one of the two, that it is measured once per combination and kept, and that it can be
forced; never which one wins.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import kernels
from course_lib.gpt import GPT, GPTConfig
from course_lib.kernels import FastLinear, choose, linear, use_fastest_kernels
from course_lib.kv_cache import generate_cached
from course_lib.llama import Llama, LlamaConfig, generate_llama

pytestmark = pytest.mark.skipif(not kernels.ONEDNN_AVAILABLE, reason="this PyTorch build has no oneDNN")
#: Tests of PackedLinear at work: where oneDNN cannot pack bfloat16 here (a CPU without AVX-512 BW/VL/DQ, e.g. an
#: AVX2 laptop, or ONEDNN_MAX_CPU_ISA below them) the F.linear fallback is what runs, and is tested below.
needs_bf16_packing = pytest.mark.skipif(not kernels.bf16_packing_runs(), reason="oneDNN cannot pack bfloat16 on this CPU")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch, one_thread):
    """No choice kept from another test; one thread (on a busy 2-core machine each 2-thread oneDNN call can wait for
    a descheduled thread); measurements cycle through 4 MiB, not 128 (which kernel wins is not what these tests check,
    and a tiny weight cycled through 128 MiB takes thousands of calls)."""
    monkeypatch.delenv("COURSE_LINEAR_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "COLD_BYTES", 4 * 2**20)
    kernels.forget_choices()
    yield
    kernels.forget_choices()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_both_kernels_compute_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(384, 1152, bias=bias)
    x = torch.randn(rows, 1, 384)
    expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    with torch.no_grad():
        for name, kernel in kernels.KERNELS.items():
            got = kernel(x, layer.weight, layer.bias)
            assert got.shape == (rows, 1, 1152) and got.dtype == torch.float32, name
            assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), name
        assert torch.allclose(linear(layer, x).double(), expected, rtol=1e-5, atol=1e-5)


def test_the_choice_is_measured_once_per_shape_rows_bucket_and_threads_then_kept(monkeypatch):
    calls = []
    real_measure = kernels.measure

    def counting_measure(weight, bias, x, cycle_bytes):
        calls.append((tuple(weight.shape), x.numel() // x.shape[-1]))
        return real_measure(weight, bias, x, cycle_bytes)

    monkeypatch.setattr(kernels, "measure", counting_measure)
    layer = nn.Linear(64, 96)
    with torch.no_grad():
        for rows in (1, 1, 5, 8, 6):  # 5, 6 and 8 share the bucket of 8
            assert choose(layer.weight, layer.bias, torch.randn(rows, 64)) in kernels.KERNEL_NAMES
    assert calls == [((96, 64), 1), ((96, 64), 5)]
    threads, cycle = torch.get_num_threads(), kernels.COLD_BYTES
    assert set(kernels.chosen_kernels()) == {(96, 64, True, 1, threads, cycle), (96, 64, True, 8, threads, cycle)}
    assert [kernels.rows_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_the_choice_is_the_faster_of_the_measured_times(monkeypatch):
    layer = nn.Linear(32, 32)
    for times, winner in (({"F.linear": 2.0, "oneDNN": 1.0}, "oneDNN"), ({"F.linear": 1.0, "oneDNN": 2.0}, "F.linear")):
        kernels.forget_choices()
        monkeypatch.setattr(kernels, "measure", lambda weight, bias, x, cycle_bytes, times=times: times)
        with torch.no_grad():
            assert choose(layer.weight, layer.bias, torch.randn(1, 32)) == winner


def test_a_measurement_reads_the_weight_from_copies_as_large_as_the_model(monkeypatch):
    seen = {name: set() for name in kernels.KERNELS}

    def recorder(name):
        def kernel(x, weight, bias=None):
            seen[name].add(weight.data_ptr())
            return F.linear(x, weight, bias)
        return kernel

    monkeypatch.setattr(kernels, "KERNELS", {name: recorder(name) for name in kernels.KERNELS})
    weight = torch.randn(64, 32)  # 8 KiB
    times = kernels.measure(weight, None, torch.randn(1, 32), cycle_bytes=10 * 8192)
    assert set(times) == set(kernels.KERNEL_NAMES) and all(t > 0 for t in times.values())
    assert all(len(pointers) == 10 for pointers in seen.values())  # 10 copies, the first the weight itself
    assert all(weight.data_ptr() in pointers for pointers in seen.values())


def test_a_measurement_of_calls_past_the_budget_reads_the_copies_rounds_times_after_one_warm_up_call(monkeypatch):
    """Each kernel: one warm-up call on one copy (first-call overheads), then ROUNDS timed passes over every copy, the
    first of them the pass that found one call fills the budget: a pass of a large model's copies is not repeated."""
    calls = {name: 0 for name in kernels.KERNELS}

    def counter(name):
        def kernel(x, weight, bias=None):
            calls[name] += 1
            return F.linear(x, weight, bias)
        return kernel

    monkeypatch.setattr(kernels, "KERNELS", {name: counter(name) for name in kernels.KERNELS})
    monkeypatch.setattr(kernels, "BUDGET_S", 0.0)  # one call fills it, as a pass over 128 MiB does
    kernels.measure(torch.randn(64, 32), None, torch.randn(1, 32), cycle_bytes=10 * 8192)
    assert calls == {name: 1 + 10 * kernels.ROUNDS for name in kernels.KERNELS}


def test_use_fastest_kernels_measures_with_the_models_weight_bytes(monkeypatch):
    cycles = []
    monkeypatch.setattr(kernels, "measure", lambda weight, bias, x, cycle_bytes: cycles.append(cycle_bytes) or
                        {"F.linear": 1.0, "oneDNN": 2.0})
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    model[1].weight = nn.Parameter(model[0].weight.t().contiguous())
    use_fastest_kernels(model)
    assert cycles == [2 * 16 * 32 * 4] * 2
    assert all(m.cycle_bytes == 2 * 16 * 32 * 4 for m in model)


def test_what_is_not_a_float32_cpu_product_of_few_rows_without_gradients_runs_f_linear(monkeypatch):
    monkeypatch.setattr(kernels, "measure", lambda *args: pytest.fail("nothing here should be measured"))
    layer = nn.Linear(32, 48)
    assert choose(layer.weight, layer.bias, torch.randn(2, 32)) == "F.linear"  # gradients are tracked: training
    with torch.no_grad():
        assert choose(layer.weight, layer.bias, torch.randn(kernels.MEASURED_ROWS + 1, 32)) == "F.linear"  # a long prefill
        bf16 = nn.Linear(32, 48).to(torch.bfloat16)
        assert choose(bf16.weight, bf16.bias, torch.randn(2, 32, dtype=torch.bfloat16)) == "F.linear"
        assert choose(layer.weight, layer.bias, torch.randn(32)) == "F.linear"  # a single vector


def test_a_training_step_through_fast_linear_has_f_linears_gradients():
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    fast = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    plain(x).square().sum().backward()
    fast(x).square().sum().backward()
    assert torch.allclose(fast.weight.grad, plain.weight.grad) and torch.allclose(fast.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("forced", kernels.KERNEL_NAMES)
def test_the_kernel_can_be_forced(monkeypatch, forced):
    monkeypatch.setenv("COURSE_LINEAR_KERNEL", forced)
    monkeypatch.setattr(kernels, "measure", lambda *args: pytest.fail("a forced kernel is not measured"))
    layer = nn.Linear(32, 48)
    with torch.no_grad():
        assert choose(layer.weight, layer.bias, torch.randn(1, 32)) == forced


def test_a_bad_forced_kernel_is_named(monkeypatch):
    monkeypatch.setenv("COURSE_LINEAR_KERNEL", "mkl")
    layer = nn.Linear(32, 48)
    with torch.no_grad(), pytest.raises(ValueError, match="COURSE_LINEAR_KERNEL must be 'auto', 'F.linear' or 'oneDNN', got 'mkl'"):
        choose(layer.weight, layer.bias, torch.randn(1, 32))


def test_use_fastest_kernels_keeps_parameters_ties_state_dict_and_outputs():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before_logits, _ = model(idx)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    parameters = [id(p) for p in model.parameters()]
    before_tokens = generate_cached(model, idx[:, :4], 8)
    assert use_fastest_kernels(model, rows=(1, 2)) is model
    assert all(isinstance(m, FastLinear) for m in model.modules() if isinstance(m, nn.Linear))
    assert model.lm_head.weight is model.transformer.wte.weight and [id(p) for p in model.parameters()] == parameters
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {choice.rows for choice in kernels.chosen_kernels()} == {1, 2}  # measured up front, as asked
    with torch.no_grad():
        logits, _ = model(idx)
    assert torch.allclose(logits, before_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(generate_cached(model, idx[:, :4], 8), before_tokens)


def test_fast_llama_decodes_hugging_faces_tokens():
    from course_lib.bench import hf_generate
    from course_lib.hf import llama_to_hf

    torch.manual_seed(0)
    ours = Llama(LlamaConfig(vocab_size=97, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                             intermediate_size=176)).eval()
    theirs = llama_to_hf(ours)
    use_fastest_kernels(ours, rows=(1, 3))
    prompt = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(ours(prompt)[0], theirs(prompt).logits, rtol=1e-4, atol=1e-5)
    # the tokens of a random model: the leading logit leads by far more than float32 rounding for this seed
    assert torch.equal(generate_llama(ours, prompt, 10), hf_generate(theirs, prompt, 10))


def test_a_weight_shared_by_two_layers_is_cycled_once(monkeypatch):
    cycled = []
    monkeypatch.setattr(kernels, "measure", lambda weight, bias, x, cycle_bytes: cycled.append(cycle_bytes)
                        or {"F.linear": 1.0, "oneDNN": 2.0})
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    second.weight = first.weight
    model = nn.Sequential(first, second, nn.Linear(16, 8, bias=False))
    use_fastest_kernels(model)
    weight_bytes = (16 * 16 + 8 * 16) * 4  # the weights, the shared one counted once
    assert first.cycle_bytes == second.cycle_bytes == weight_bytes and set(cycled) == {weight_bytes}


@pytest.mark.parametrize("case", ["no rows", "trainable bias", "autocast", "float64", "too many rows"])
def test_products_oneDNN_cannot_take_run_f_linear_unmeasured(monkeypatch, case):
    monkeypatch.setattr(kernels, "measure", lambda *args: pytest.fail("measured a product F.linear must run"))
    layer = nn.Linear(16, 8)
    weight, bias, x = layer.weight.detach(), layer.bias.detach(), torch.randn(2, 16)
    if case == "no rows":
        x = torch.randn(0, 16)
    elif case == "trainable bias":
        bias = layer.bias  # requires_grad, and gradients are on
    elif case == "float64":
        weight, bias, x = weight.double(), bias.double(), x.double()
    elif case == "too many rows":
        x = torch.randn(kernels.MEASURED_ROWS + 1, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        assert choose(weight, bias, x) == "F.linear"
    assert kernels.chosen_kernels() == {}


def test_choose_faster_keeps_the_fastest_per_key_and_thread_count_and_can_be_forced(monkeypatch):
    calls = {"slow": 0, "fast": 0}

    def run(name, seconds):
        def call():
            calls[name] += 1
            clock[0] += seconds
        return call

    clock = [0.0]
    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    runs = {"slow": run("slow", 2e-3), "fast": run("fast", 1e-3)}
    assert kernels.choose_faster(("int4", 8, 32, 32), runs) == "fast"
    measured = dict(calls)
    assert measured["slow"] >= 1 + kernels.ROUNDS and measured["fast"] >= 1 + kernels.ROUNDS
    assert kernels.choose_faster(("int4", 8, 32, 32), runs) == "fast" and calls == measured  # kept: not measured again
    assert kernels.chosen_among() == {("int4", 8, 32, 32, torch.get_num_threads()): "fast"}
    assert kernels.choose_faster(("int4", 8, 32, 32), runs, forced="slow") == "slow"
    with pytest.raises(ValueError, match=r"forced must be 'auto' or one of \['fast', 'slow'\], got 'other'"):
        kernels.choose_faster(("int4", 8, 32, 32), runs, forced="other")
    kernels.forget_choices()
    assert kernels.chosen_among() == {}


@needs_bf16_packing
@pytest.mark.parametrize("forced", kernels.BF16_KERNELS)
def test_bf16_models_keep_their_outputs_on_either_kernel(monkeypatch, forced):
    """Forced either way: a bfloat16 GPT's logits within bfloat16 rounding of float64 F.linear's on the same weights,
    every bfloat16 nn.Linear packed (or none), the packed bytes those of the weights, and greedy tokens decoded."""
    monkeypatch.setenv("COURSE_BF16_KERNEL", forced)
    torch.manual_seed(6)
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
    model = GPT(config).eval().to(torch.bfloat16)
    reference = GPT(config).eval().double()
    reference.load_state_dict(model.state_dict())
    kernels.use_fastest_bf16_kernels(model)
    packed = [m for m in model.modules() if isinstance(m, kernels.PackedLinear)]
    assert len(packed) == (4 * config.n_layer + 1 if forced == "oneDNN packed" else 0)
    assert all(m.packed.numel() * m.packed.element_size() == m.in_features * m.out_features * 2 for m in packed)
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits, expected = model(idx)[0].double(), reference(idx)[0]
    assert (logits - expected).abs().max() <= 0.05 * expected.abs().max()
    assert generate_cached(model, idx, 4).shape == (2, 9)


@needs_bf16_packing
def test_bf16_kernels_are_chosen_once_per_shape_on_every_layer_of_that_shape(monkeypatch):
    """One measurement per weight shape, whose runs take one row through every layer of that shape (read as a step
    reads them, not one weight from a cache); the layers of a shape measured packed-faster all become PackedLinear, the
    others stay as they were; FastLinear layers count (chapter 08's bfloat16 copy of its model once packed none)."""
    asked = {}

    def fake_choose_faster(key, runs, forced="auto"):
        asked[key] = {name: len(run()) for name, run in runs.items()}  # the layers each run went through
        return kernels.BF16_KERNELS[1] if key[1:3] == (32, 16) else kernels.BF16_KERNELS[0]

    monkeypatch.setattr(kernels, "choose_faster", fake_choose_faster)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 32), nn.Linear(16, 32))
    use_fastest_kernels(model)  # FastLinear layers (a bfloat16 copy of a float32 model that ran them keeps them)
    model.to(torch.bfloat16)
    kernels.use_fastest_bf16_kernels(model)
    assert asked == {("bfloat16", 32, 16, True): {name: 3 for name in kernels.BF16_KERNELS},
                     ("bfloat16", 16, 32, True): {name: 1 for name in kernels.BF16_KERNELS}}
    assert [type(m).__name__ for m in model] == ["PackedLinear", "FastLinear", "PackedLinear", "PackedLinear"]


def test_bf16_models_stay_on_f_linear_where_onednn_cannot_pack_bfloat16():
    """With oneDNN held to SSE4.1 (as on a CPU without AVX-512 BW/VL/DQ), its bfloat16 reorder refuses: the probe says
    so and every layer stays F.linear, and the model still decodes (chapter 08's other-CPU run once stopped here). On
    an x86 CPU only: elsewhere ONEDNN_MAX_CPU_ISA=SSE41 means nothing."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("ONEDNN_MAX_CPU_ISA=SSE41 holds back x86 CPUs only")

    code = ("import torch; from course_lib import kernels; from course_lib.gpt import GPT, GPTConfig\n"
            "from course_lib.kv_cache import generate_cached\n"
            "m = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval().to(torch.bfloat16)\n"
            "kernels.use_fastest_bf16_kernels(m)\n"
            "print(kernels.bf16_packing_runs(), sum(isinstance(x, kernels.PackedLinear) for x in m.modules()),\n"
            "      tuple(generate_cached(m, torch.zeros(1, 2, dtype=torch.long), 3).shape))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": "SSE41"}).stdout.strip().split(maxsplit=2)
    assert out == ["False", "0", "(1, 5)"]


def test_a_bad_course_bf16_kernel_is_refused_on_every_cpu(monkeypatch):
    """COURSE_BF16_KERNEL is checked before anything is measured, on a CPU where oneDNN cannot pack bfloat16 too (the
    probe is made to say so): the ValueError names the variable and its values."""
    monkeypatch.setenv("COURSE_BF16_KERNEL", "fastest")
    monkeypatch.setattr(kernels, "bf16_packing_runs", lambda: False)
    model = nn.Sequential(nn.Linear(16, 16).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"COURSE_BF16_KERNEL must be 'auto' or one of \['F.linear', 'oneDNN packed'\], "
                                         r"got 'fastest'"):
        kernels.use_fastest_bf16_kernels(model)


@pytest.fixture
def onednn_wins_and_kernels_recorded(monkeypatch):
    """``measure`` says oneDNN is faster (counting its calls), and each kernel records that it ran: returns (the
    kernel names run, the measurements made)."""
    ran, measured = [], []
    monkeypatch.setattr(kernels, "measure", lambda weight, bias, x, cycle_bytes: measured.append(tuple(weight.shape))
                        or {"F.linear": 2.0, "oneDNN": 1.0})
    monkeypatch.setattr(kernels, "KERNELS", {name: (lambda x, weight, bias=None, name=name, kernel=kernel:
                                                    ran.append(name) or kernel(x, weight, bias))
                                             for name, kernel in kernels.KERNELS.items()})
    return ran, measured


def test_a_module_asks_for_its_kernel_once_while_its_products_repeat(monkeypatch, onednn_wins_and_kernels_recorded):
    """A decode step's products repeat their shapes: ``choose`` (several microseconds a call) is asked once per module
    and then not again, while the kernel it chose runs every call."""
    ran, _ = onednn_wins_and_kernels_recorded
    asked = []
    real_choose = kernels.choose
    monkeypatch.setattr(kernels, "choose", lambda *args: asked.append(1) or real_choose(*args))
    layer = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]
    asked.clear()
    with torch.no_grad():
        for _ in range(5):
            layer(torch.randn(1, 1, 16))
    assert asked == [1] and ran == ["oneDNN"] * 5


def _replace_weight(layer, monkeypatch):
    layer.weight, layer.bias = nn.Parameter(torch.randn(24, 16)), nn.Parameter(torch.randn(24))  # other objects, shapes


def _reshape_weight_in_place(layer, monkeypatch):
    layer.weight.data, layer.bias.data = torch.randn(24, 16), torch.randn(24)  # the same objects, other shapes


def _forced_f_linear_then_forgotten(layer, monkeypatch):
    monkeypatch.setenv("COURSE_LINEAR_KERNEL", "F.linear")
    kernels.forget_choices()


#: {change: (what it does to a layer of 8 x 16 that ran one row on oneDNN (layer, monkeypatch), the input next, the kernel it must run,
#:           whether a new measurement is due)}
STALE_CASES = {
    "rows past MEASURED_ROWS": (lambda layer, _: None, lambda: torch.randn(kernels.MEASURED_ROWS + 1, 16), "F.linear", False),
    "another rows bucket": (lambda layer, _: None, lambda: torch.randn(3, 16), "oneDNN", True),
    "bfloat16 in place": (lambda layer, _: layer.to(torch.bfloat16), lambda: torch.randn(1, 16, dtype=torch.bfloat16),
                          "F.linear", False),
    "float64 input": (lambda layer, _: layer.double(), lambda: torch.randn(1, 16, dtype=torch.float64), "F.linear", False),
    "weight replaced": (_replace_weight, lambda: torch.randn(1, 16), "oneDNN", True),
    "weight reshaped in place": (_reshape_weight_in_place, lambda: torch.randn(1, 16), "oneDNN", True),
    "forced, then forget_choices": (_forced_f_linear_then_forgotten, lambda: torch.randn(1, 16), "F.linear", False),
    "forget_choices": (lambda layer, _: kernels.forget_choices(), lambda: torch.randn(1, 16), "oneDNN", True),
    "another cycle": (lambda layer, _: setattr(layer, "cycle_bytes", 12345), lambda: torch.randn(1, 16), "oneDNN", True),
}


@pytest.mark.parametrize("case", STALE_CASES)
def test_a_kept_kernel_is_not_reused_once_what_decides_it_changed(monkeypatch, onednn_wins_and_kernels_recorded, case):
    """The kernel a module keeps holds for products like its last one only: after each change, the kernel ``choose``'s
    rule gives now runs (measured anew where its key is new), and the output is F.linear's on the weights as they are."""
    ran, measured = onednn_wins_and_kernels_recorded
    change, make_x, expected, remeasured = STALE_CASES[case]
    torch.manual_seed(0)
    layer = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]
    with torch.no_grad():
        layer(torch.randn(1, 16))
        assert ran == ["oneDNN"] and len(measured) == 1
        change(layer, monkeypatch)
        x = make_x()
        got = layer(x)
    assert ran[1:] == [expected] and len(measured) == 1 + remeasured
    assert torch.allclose(got.double(), F.linear(x.double(), layer.weight.double(), layer.bias.double()), atol=1e-2)


def test_a_kept_kernel_reads_the_weight_as_it_is_now_and_follows_gradients_threads_and_devices(
        onednn_wins_and_kernels_recorded):
    """A weight changed in place keeps its kernel (the rule looks at shapes, not values) and its new values are what
    is read; with gradients on, F.linear runs (and the gradient is F.linear's); another thread count measures anew; on
    another device (meta here, the CPU's only other) F.linear runs."""
    ran, measured = onednn_wins_and_kernels_recorded
    torch.manual_seed(0)
    layer = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]
    x = torch.randn(1, 16)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-6)  # two kernels' float32 rounding
    assert ran == ["oneDNN"] * 2 and len(measured) == 1
    layer(x).sum().backward()  # gradients on: training runs F.linear
    assert ran[-1] == "F.linear" and torch.allclose(layer.weight.grad, x.expand(8, 16))
    with torch.no_grad(), kernels.threads(2):
        layer(x)
    assert ran[-1] == "oneDNN" and len(measured) == 2
    layer.to("meta")
    with torch.no_grad():
        assert layer(x.to("meta")).shape == (1, 8)
    assert ran[-1] == "F.linear"


#: (tangent of y = layer(x), under no_grad) of each way to ask for forward-mode gradients: a ``forward_ad`` dual level,
#: ``torch.func.jvp``, and per-example tangents under ``torch.func.vmap``
FORWARD_GRADIENTS = {
    "forward_ad": lambda layer, x, t: _dual_tangent(layer, x, t),
    "torch.func.jvp": lambda layer, x, t: torch.func.jvp(layer, (x,), (t,))[1],
    "vmap of jvp": lambda layer, x, t: torch.func.vmap(lambda xi, ti: torch.func.jvp(layer, (xi,), (ti,))[1])(
        x[:, None], t[:, None])[:, 0],
}


def _dual_tangent(layer, x, t):
    import torch.autograd.forward_ad as forward_ad

    with forward_ad.dual_level():
        return forward_ad.unpack_dual(layer(forward_ad.make_dual(x, t))).tangent


@pytest.mark.parametrize("way", FORWARD_GRADIENTS)
def test_forward_gradients_through_a_module_that_kept_onednn_are_f_linears(onednn_wins_and_kernels_recorded, way):
    """Forward-mode gradients need no ``requires_grad`` and flow under no_grad: a module that kept oneDNN (measured
    faster) runs F.linear for them, and the tangent is W t (oneDNN's op has no forward derivative: its tangent was
    dropped, None or zeros, while the module's kept kernel or ``choose`` ran it)."""
    ran, _ = onednn_wins_and_kernels_recorded
    torch.manual_seed(0)
    layer = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]
    x, t = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        layer(x)
        assert ran == ["oneDNN"]
        tangent = FORWARD_GRADIENTS[way](layer, x, t)
    assert tangent is not None and "oneDNN" not in ran[1:]
    assert torch.allclose(tangent.double(), t.double() @ layer.weight.double().t(), atol=1e-5)
    with torch.no_grad():
        layer(x)
    assert ran[-1] == "oneDNN"  # outside the transform, the kept kernel again


def test_torch_compile_of_a_fast_linear_compiles_and_gives_f_linears_outputs(monkeypatch):
    """``torch.compile`` traces F.linear: Inductor could not lower oneDNN's op as ``onednn_linear`` calls it (it
    raised a LoweringException where the kernel chosen, or forced, was oneDNN)."""
    monkeypatch.setenv("COURSE_LINEAR_KERNEL", "oneDNN")
    torch.manual_seed(0)
    layer = use_fastest_kernels(nn.Sequential(nn.Linear(32, 8)))[0]
    x = torch.randn(2, 32)
    with torch.no_grad():
        got = torch.compile(layer)(x)
    assert torch.allclose(got, F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_a_module_saved_by_another_process_asks_choose_in_this_one(tmp_path):
    """A module that kept oneDNN (forced there), saved whole by one process and loaded by another where F.linear is
    forced, runs F.linear: what a module kept holds in the process that chose it (the unpickled module ran the other
    process's kernel, as one saved on another machine would). Both processes fresh, as a notebook and a script."""
    import os
    import subprocess
    import sys

    path = tmp_path / "layer.pt"
    save = ("import torch; from torch import nn; from course_lib.kernels import use_fastest_kernels\n"
            "layer = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]\n"
            "with torch.no_grad(): layer(torch.randn(1, 16))\n"
            f"torch.save(layer, {str(path)!r})")
    load = ("import torch; from course_lib import kernels\n"
            "ran = []; onednn = kernels.onednn_linear\n"
            "kernels.onednn_linear = kernels.KERNELS['oneDNN'] = lambda *args: ran.append(1) or onednn(*args)\n"
            f"layer = torch.load({str(path)!r}, weights_only=False)\n"
            "x = torch.randn(1, 16, generator=torch.Generator().manual_seed(0))\n"
            "with torch.no_grad(): y = layer(x)\n"
            "y_64 = x.double() @ layer.weight.double().t() + layer.bias.double()\n"  # atol: float32's rounding (allclose's
            # default, 1e-8, failed 29 of 2,000 random layers and inputs, where an output came out near 0; 1e-6, none)
            "print(kernels.choose(layer.weight, layer.bias, x), len(ran), bool(torch.allclose(y.double(), y_64, atol=1e-6)))")
    for code, kernel in ((save, "oneDNN"), (load, "F.linear")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "COURSE_LINEAR_KERNEL": kernel}).stdout.split()
    assert out == ["F.linear", "0", "True"]


def test_sparse_inputs_through_a_module_that_kept_onednn_run_f_linear(onednn_wins_and_kernels_recorded):
    """nn.Linear takes a sparse x (COO or CSR); so does a FastLinear that kept oneDNN for dense rows of the same shape:
    F.linear runs, and its output is F.linear's on the dense x (oneDNN's op raised NotImplementedError for the
    SparseCPU and SparseCsrCPU backends, whether kept or chosen)."""
    ran, _ = onednn_wins_and_kernels_recorded
    torch.manual_seed(0)
    layer = use_fastest_kernels(nn.Sequential(nn.Linear(16, 8)))[0]
    x = torch.randn(2, 16)
    x[0, ::2] = 0
    with torch.no_grad():
        layer(x)
        assert ran == ["oneDNN"]
        for sparse in (x.to_sparse(), x.to_sparse_csr()):
            got = layer(sparse)
            assert ran[-1] == "F.linear"
            assert torch.allclose(got.to_dense().double(), F.linear(x.double(), layer.weight.double(),
                                                                    layer.bias.double()), atol=1e-5)
        layer(x)
    assert ran[-1] == "oneDNN"
