"""Chapter 16's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE planted
bug. Every bug must fail exactly the tests documented to target it, and correct alternatives must pass everything.
Oracles: the full layer or model in one process (nn.Linear, GPT.forward, generate_cached); all-reduces counted on each
rank; elements held measured.
"""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import assets, checks, tensor_parallel as tp
from course_lib.gpt import GPT, GPTBlock, GPTConfig
from course_lib.kv_cache import StaticKVCache, cached_forward, generate_cached
from course_lib.tensor_parallel import check_divides, check_rank, count_all_reduces, launch
from tests.cell_harness import TestCells
from tests.helpers import ROOT, failing

SOURCE = ROOT / "solutions" / "16-tensor-parallel" / "tensor_parallel.ipynb"
NAMESPACE = {"torch": torch, "dist": dist, "F": F, "nn": nn, "copy": copy, "partial": partial, "assets": assets,
             "checks": checks, "tp": tp, "GPT": GPT, "GPTBlock": GPTBlock, "GPTConfig": GPTConfig,
             "StaticKVCache": StaticKVCache, "cached_forward": cached_forward, "generate_cached": generate_cached,
             "check_divides": check_divides, "check_rank": check_rank, "count_all_reduces": count_all_reduces,
             "launch": launch}
HARNESS = TestCells(SOURCE, NAMESPACE)
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

CPL, RPL, SB, SC = "column_parallel_linear", "row_parallel_linear", "shard_block", "shard_cache"
CPL_FORWARD = "return F.linear(x, self.weight, self.bias)"
CPL_ROWS = "rows = torch.cat([torch.arange(c * block + rank * part, c * block + (rank + 1) * part) for c in range(chunks)])"
RPL_FORWARD = "y = F.linear(x, self.weight)  # this rank's partial sum"
RPL_REDUCE = "dist.all_reduce(y)  # sum over the ranks, in place: every rank now holds x_full @ W^T"
RPL_BIAS = "return y if self.bias is None else y + self.bias"

CASES = [
    (CPL, "the all-reduce after the column-parallel layer",
     mutate(CPL, (CPL_FORWARD, "y = F.linear(x, self.weight, self.bias)\n        dist.all_reduce(y)\n        return y")),
     failing(CPL, "visible", "shapes")),
    (CPL, "[q | k | v] cut as one block", mutate(CPL, (CPL_ROWS, "rows = torch.arange(rank * part * chunks, (rank + 1) * part * chunks)")),
     failing(CPL, "visible", "shapes")),
    (CPL, "the bias dropped", mutate(CPL, ("self.bias = None if linear.bias is None else", "self.bias = None if True else")),
     failing(CPL, "visible")),
    (CPL, "correct: index_select and a bias sliced the same way", '''
class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, rank, world_size, chunks=1):
        super().__init__()
        if linear.out_features % chunks or (linear.out_features // chunks) % world_size or not 0 <= rank < world_size:
            raise ValueError("split")
        block = linear.out_features // chunks
        part = block // world_size
        rows = torch.arange(linear.out_features).view(chunks, world_size, part)[:, rank].reshape(-1)
        self.weight = nn.Parameter(linear.weight.detach().index_select(0, rows))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().index_select(0, rows))

    def forward(self, x):
        return x @ self.weight.T + (0 if self.bias is None else self.bias)
''', set()),
    (RPL, "the bias added on every rank before the all-reduce",
     mutate(RPL, (RPL_FORWARD, "y = F.linear(x, self.weight, self.bias)"), (RPL_BIAS, "return y")), failing(RPL, "visible", "ranks")),
    (RPL, "no all-reduce", mutate(RPL, (RPL_REDUCE, "pass")), failing(RPL, "visible", "ranks")),
    (RPL, "the bias forgotten", mutate(RPL, (RPL_BIAS, "return y")), failing(RPL, "visible", "ranks")),
    (RPL, "correct: the bias divided by p before the all-reduce", '''
class RowParallelLinear(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        if linear.in_features % world_size or not 0 <= rank < world_size:
            raise ValueError("split")
        part = linear.in_features // world_size
        self.world_size = world_size
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * part:(rank + 1) * part].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias / self.world_size
        dist.all_reduce(y)
        return y
''', set()),
    (SB, "heads split unevenly (no check that p divides n_head)",
     mutate(SB, ('    check_divides("n_head", block.attn.n_head, world_size)\n', "")), failing(SB, "visible", "char_gpt")),
    (SB, "n_head not divided by p", mutate(SB, ("attn.n_head = block.attn.n_head // world_size", "attn.n_head = block.attn.n_head")),
     failing(SB, "visible", "char_gpt")),
    (SB, "c_attn split without chunks", mutate(SB, ("block.attn.c_attn, rank, world_size, chunks=3", "block.attn.c_attn, rank, world_size")),
     failing(SB, "visible", "char_gpt")),
    (SB, "the MLP left whole", mutate(SB, ("    mlp.c_fc = column_parallel_linear(block.mlp.c_fc, rank, world_size)\n", ""),
                                      ("    mlp.c_proj = row_parallel_linear(block.mlp.c_proj, rank, world_size)\n", "")),
     failing(SB, "visible", "char_gpt")),
    (SC, "the KV cache not split", mutate(SC, ("config.n_head // world_size,", "config.n_head,")), failing(SC, "visible", "memory")),
    (SC, "the dtype ignored", mutate(SC, ("max_len, dtype=dtype)", "max_len)")), failing(SC, "memory")),
    (SC, "correct: StaticKVCache.for_model's sizes divided", '''
def shard_cache(config, world_size, batch_size, max_len, *, dtype=torch.float32):
    if config.n_head % world_size:
        raise ValueError("n_head must be divisible by world_size")
    return StaticKVCache(n_layer=config.n_layer, batch_size=batch_size, n_kv_head=config.n_head // world_size,
                         head_dim=config.n_embd // config.n_head, max_len=max_len, dtype=dtype)
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {CPL, RPL, SB, SC}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 2


@pytest.mark.parametrize("exercise", [CPL, RPL, SB, SC])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


@pytest.mark.parametrize("cell,bug,says", [
    (f"{SB}-char_gpt", mutate(SB, ("attn.n_head = block.attn.n_head // world_size", "attn.n_head = block.attn.n_head")),
     "rank 0 of 2: attn.n_head is 4, expected n_head / world_size = 2"),
    (f"{CPL}-shapes", mutate(CPL, (CPL_FORWARD, "y = F.linear(x, self.weight, self.bias)\n        dist.all_reduce(y)\n"
                                                "        return y")),
     "the column-parallel forward pass called torch.distributed (an all-reduce?)"),
])
def test_the_hidden_tests_name_the_mistake_in_a_line(cell, bug, says):
    """A failed hidden test says what is wrong in one line (browser walk): never a rank's traceback, nor torch's bare
    "Default process group has not been initialized"."""
    message = HARNESS.failure_message(cell, bug)
    assert says in message
    assert "Traceback" not in message and len(message.splitlines()) == 1
