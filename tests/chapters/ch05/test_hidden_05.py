"""Chapter 05's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells are executed in a namespace holding the reference
solutions with ONE planted bug. Every bug must fail exactly the tests documented to target it (the
comment at the top of each cell), and correct alternative implementations must pass everything.
The slower nbgrader round trip (tests/chapters/ch05/test_grading_05.py) checks the same on whole notebooks.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.attention import masked_softmax
from course_lib.kv_cache import KVCache, cached_forward, position_ids
from tests.cell_harness import TestCells
from tests.helpers import ROOT
from tests.planted import DOUBLE_FEED

SOURCE = ROOT / "solutions" / "05-kv-cache" / "kv_cache.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "checks": checks, "masked_softmax": masked_softmax,
                             "KVCache": KVCache, "cached_forward": cached_forward, "position_ids": position_ids})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

STEP, GEN, SIZE = "cached_attention_step", "generate_cached", "kv_cache_bytes"
MASK = "torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(diagonal=P)"
PREFILL = "logits = cached_forward(model, idx, cache, None if mask is None else mask[:, :T], positions)  # prefill"
DECODE = "logits = cached_forward(model, out[:, t:t + 1], cache, None if mask is None else mask[:, :t + 1], position)"
FORMULA = "return 2 * n_layer * batch_size * seq_len * H_kv * head_dim * element"

CASES = [
    # the cached attention step
    (STEP, "causal mask dropped (fine for one token, wrong for chunks)", mutate(STEP, (MASK, "torch.ones(T, P + T, dtype=torch.bool)")),
     {f"{STEP}-visible", f"{STEP}-chunk", f"{STEP}-prefill"}),
    (STEP, "causal mask not offset by the cached length", mutate(STEP, (".tril(diagonal=P)", ".tril()")),
     {f"{STEP}-visible", f"{STEP}-decode", f"{STEP}-chunk", f"{STEP}-gqa"}),  # exact when P = 0 (prefill)
    (STEP, "new keys before the cached ones", mutate(STEP, ("torch.cat([past_k, k], dim=2)", "torch.cat([k, past_k], dim=2)"),
                                                     ("torch.cat([past_v, v], dim=2)", "torch.cat([v, past_v], dim=2)")),
     {f"{STEP}-visible", f"{STEP}-chunk", f"{STEP}-cache"}),  # one query (decode) attends to all keys in any order; P = 0 is unaffected
    (STEP, "key/value heads repeated instead of interleaved", mutate(STEP, ("keys.repeat_interleave(group, dim=1)", "keys.repeat(1, group, 1, 1)"),
                                                                     ("values.repeat_interleave(group, dim=1)", "values.repeat(1, group, 1, 1)")),
     {f"{STEP}-visible", f"{STEP}-gqa"}),  # the tests with H_kv < H ... and 1 < H_kv
    (STEP, "scaled by sqrt(H * Dh)", mutate(STEP, ("math.sqrt(Dh)", "math.sqrt(q.shape[1] * Dh)")),
     {f"{STEP}-visible", f"{STEP}-decode", f"{STEP}-chunk", f"{STEP}-prefill", f"{STEP}-gqa"}),
    (STEP, "returns the repeated keys as the cache", mutate(STEP, ("return weights @ v_all, keys, values", "return weights @ v_all, k_all, v_all")),
     {f"{STEP}-visible", f"{STEP}-cache"}),  # visible: its GQA case checks the returned cache has H_kv heads (issue 24)
    (STEP, "correct: F.scaled_dot_product_attention with an explicit mask", mutate(STEP, (
        "weights = masked_softmax(q @ k_all.transpose(-2, -1) / math.sqrt(Dh), allowed)  # (B, H, T, P + T)\n    return weights @ v_all, keys, values",
        "return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed), keys, values")), set()),
    # the prefill + decode loop
    (GEN, "last prompt token fed twice after the prefill", DOUBLE_FEED,
     {f"{GEN}-visible", f"{GEN}-first", f"{GEN}-positions", f"{GEN}-padding", f"{GEN}-hf"}),
    (GEN, "positions not advanced", mutate(GEN, ("            position = position + 1\n", "")),
     {f"{GEN}-visible", f"{GEN}-positions", f"{GEN}-padding", f"{GEN}-hf"}),
    (GEN, "every decode step at position 0", mutate(GEN, (DECODE, DECODE.replace(", position)", ", torch.zeros_like(position))"))),
     {f"{GEN}-visible", f"{GEN}-positions", f"{GEN}-padding", f"{GEN}-hf"}),
    (GEN, "attention mask ignored (padding attended)", mutate(GEN, (PREFILL, PREFILL.replace("None if mask is None else mask[:, :T]", "None")),
                                                           (DECODE, DECODE.replace("None if mask is None else mask[:, :t + 1]", "None"))),
     {f"{GEN}-visible", f"{GEN}-padding", f"{GEN}-hf"}),  # the visible check runs a left-padded batch too
    (GEN, "positions ignore the padding", mutate(GEN, ("positions = position_ids(attention_mask, 0, T, B, idx.device)",
                                                       "positions = position_ids(None, 0, T, B, idx.device)")),
     {f"{GEN}-visible", f"{GEN}-padding", f"{GEN}-hf"}),  # named by the visible check: positions not shifted per row
    (GEN, "cache not sliced to its length: update returns all max_len slots", mutate(GEN, (
        "return keys[:, :, :self.length + T], values[:, :, :self.length + T]", "return keys, values")),
     {f"{GEN}-visible", f"{GEN}-first", f"{GEN}-positions", f"{GEN}-padding", f"{GEN}-hf"}),  # every generation attends to empty slots
    (GEN, "off by one in the cache-full check (full at max_len - 1)", mutate(GEN, (
        "if self.length + T > self.max_len:", "if self.length + T >= self.max_len:")),
     {f"{GEN}-visible", f"{GEN}-full"}),  # generate_cached never fills its cache: only the cache's own tests see it
    (GEN, "no cache-full check at all", mutate(GEN, ("        self.check_room(T)\n", "")), {f"{GEN}-visible", f"{GEN}-full"}),
    # issue 41: every generate_cached test used a float32 model, so a cache that is always float32 got full marks
    (GEN, "cache always float32", mutate(GEN, ("dtype=weight.dtype, device=weight.device, **options", "device=weight.device, **options")),
     {f"{GEN}-visible", f"{GEN}-dtype"}),
    (GEN, "cache always on the CPU", mutate(GEN, ("dtype=weight.dtype, device=weight.device, **options", "dtype=weight.dtype, **options")),
     {f"{GEN}-dtype"}),
    # issue 41: check_room is in the contract now; one that never refuses (update checking by itself) fails its test
    (GEN, "check_room never refuses", mutate(GEN, (
        '"""ValueError ("the cache is full") unless T more tokens fit: length + T <= max_len."""\n',
        '"""ValueError ("the cache is full") unless T more tokens fit: length + T <= max_len."""\n        return\n'), (
        "        self.check_room(T)\n", "        if self.length + T > self.max_len:\n            raise ValueError('the cache is full')\n")),
     {f"{GEN}-visible", f"{GEN}-full"}),  # visible: it calls check_room since the follow-up of issue 41
    (GEN, "no cache use: every step re-runs the whole prefix through a fresh cache", '''
@torch.inference_mode()
def generate_cached(model, idx, max_new_tokens, attention_mask=None):
    B, T = idx.shape
    mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask.new_ones(B, max_new_tokens)], dim=1)
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)
    for t in range(T, T + max_new_tokens):
        logits = cached_forward(model, out[:, :t], KVCache.for_model(model, B, t), None if mask is None else mask[:, :t])
        out[:, t] = logits[:, -1].argmax(dim=-1)
    return out
''', {f"{GEN}-visible"}),  # right tokens: only the visible check counts what the model is fed (issue 24)
    (GEN, "correct: a cache of one tensor per layer and kind, grown by writing into slices", mutate(GEN, (
        "self.storage = torch.zeros(n_layer, 2, batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device)",
        "self.storage = [[torch.zeros(batch_size, n_kv_head, max_len, head_dim, dtype=dtype, device=device) for _ in range(2)] "
        "for _ in range(n_layer)]"), ("return self.storage.shape[2]", "return self.storage[0][0].shape[0]"),
        ("keys, values = self.storage[layer, 0], self.storage[layer, 1]", "keys, values = self.storage[layer]")), set()),
    (GEN, "correct: positions left to cached_forward", mutate(GEN, (", positions)  # prefill", ")  # prefill"), (", position)", ")")), set()),
    (GEN, "correct: prefill all but the last prompt token, then feed it", '''
@torch.inference_mode()
def generate_cached(model, idx, max_new_tokens, attention_mask=None):
    B, T = idx.shape
    cache = KVCache.for_model(model, B, T + max_new_tokens)
    mask = torch.ones(B, T + max_new_tokens, dtype=torch.long)
    if attention_mask is not None:
        mask[:, :T] = attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if T > 1:
        cached_forward(model, idx[:, :-1], cache, mask[:, :T - 1], positions[:, :T - 1])
    out, token = idx, idx[:, -1:]
    for t in range(T - 1, T - 1 + max_new_tokens):
        logits = cached_forward(model, token, cache, mask[:, :t + 1], positions[:, t:t + 1])
        token = logits[:, -1:].argmax(-1)
        out = torch.cat([out, token], dim=1)
    return out
''', set()),
    # the cache-size formula
    (SIZE, "K and V: the factor 2 forgotten", mutate(SIZE, (FORMULA, FORMULA.replace("2 * ", ""))), {f"{SIZE}-visible", f"{SIZE}-gpt2large"}),
    (SIZE, "H instead of H_kv", mutate(SIZE, ("H_kv = n_head if n_kv_head is None else n_kv_head", "H_kv = n_head")),
     {f"{SIZE}-visible", f"{SIZE}-gqa"}),
    (SIZE, "head size C / H_kv", mutate(SIZE, ("head_dim = n_embd // n_head", "head_dim = n_embd // H_kv")), {f"{SIZE}-visible", f"{SIZE}-gqa"}),
    (SIZE, "float16 bytes whatever the dtype", mutate(SIZE, ("element = torch.empty((), dtype=dtype).element_size()", "element = 2")),
     {f"{SIZE}-visible", f"{SIZE}-dtype"}),  # the visible check includes float32
    (SIZE, "batch size forgotten", mutate(SIZE, ("2 * n_layer * batch_size *", "2 * n_layer *")), {f"{SIZE}-visible", f"{SIZE}-batch"}),
    (SIZE, "correct: bits / 8 and n_embd", '''
def kv_cache_bytes(n_layer, n_embd, n_head, seq_len, *, n_kv_head=None, batch_size=1, dtype=torch.float16):
    kv_channels = n_embd * (n_kv_head or n_head) // n_head
    return 2 * n_layer * batch_size * seq_len * kv_channels * torch.finfo(dtype).bits // 8
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {STEP, GEN, SIZE}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 4


@pytest.mark.parametrize("exercise", [STEP, GEN, SIZE])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail
