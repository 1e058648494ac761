"""Chapter 16's grading round trip through nbgrader, with real submission notebooks, graded in the clean room (whose
exercises fork their ranks: a loopback process group under the sandbox's process cap and network namespace).

One `grading.grade` run grades three students: the reference (full marks), the untouched release (zero) and one
student with four planted bugs, one per exercise:

* ColumnParallelLinear: an all-reduce after the column-parallel layer -> the visible test and `shapes`;
* RowParallelLinear: the bias added on every rank before the all-reduce -> the visible test and `ranks`;
* shard_block: heads split unevenly (no check that world_size divides n_head) -> the visible test and `char_gpt`;
* shard_cache: the KV cache not split (every head on every rank) -> the visible test and `memory`.

tests/chapters/ch16/test_hidden_16.py runs the same cells against more bugs, one at a time and without nbgrader.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("16-tensor-parallel", "tensor_parallel")
CPL, RPL, SB, SC = ("column_parallel_linear-solution", "row_parallel_linear-solution", "shard_block-solution",
                    "shard_cache-solution")


def planted() -> dict:
    return CH.solved({
        CPL: CH.mutate(CPL, "return F.linear(x, self.weight, self.bias)",
                       "y = F.linear(x, self.weight, self.bias)\n        dist.all_reduce(y)\n        return y"),
        RPL: CH.mutate(RPL, "y = F.linear(x, self.weight)  # this rank's partial sum", "y = F.linear(x, self.weight, self.bias)")
             .replace("return y if self.bias is None else y + self.bias", "return y"),
        SB: CH.mutate(SB, '    check_divides("n_head", block.attn.n_head, world_size)\n', ""),
        SC: CH.mutate(SC, "config.n_head // world_size,", "config.n_head,"),
    })


STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted": (planted, failing("column_parallel_linear", "visible", "shapes")
                | failing("row_parallel_linear", "visible", "ranks")
                | failing("shard_block", "visible", "char_gpt")
                | failing("shard_cache", "visible", "memory")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=10)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted")
    assert "without communicating" in messages["column_parallel_linear-visible"]
    assert "the bias was added on every rank before the all-reduce" in messages["row_parallel_linear-visible"]
    assert "heads split unevenly" in messages["shard_block-visible"]
    assert "it is not split" in messages["shard_cache-visible"]
