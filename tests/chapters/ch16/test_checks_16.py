"""Chapter 16's learner-facing checks: the reference passes; each classic bug gets a specific message; correct
alternatives pass."""
from __future__ import annotations

import pytest

from course_lib import checks, tensor_parallel as tp
from tests.helpers import mutant


def variant(obj, *replacements):
    """The reference class or function `obj` of course_lib.tensor_parallel with each (old, new) replacement applied."""
    return mutant(obj, *replacements)


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_column_parallel_linear(tp.ColumnParallelLinear)
    checks.check_row_parallel_linear(tp.RowParallelLinear)
    checks.check_shard_block(tp.shard_block)
    checks.check_shard_cache(tp.shard_cache)
    assert capsys.readouterr().out.count("all visible checks passed") == 4


CPL_FORWARD = "return F.linear(x, self.weight, self.bias)"
RPL_FORWARD = "y = F.linear(x, self.weight)  # this rank's partial sum"
RPL_REDUCE = "dist.all_reduce(y)  # sum over the ranks, in place: every rank now holds x_full @ W^T"
CPL_ROWS = "rows = torch.cat([torch.arange(c * block + rank * part, c * block + (rank + 1) * part) for c in range(chunks)])"


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_column_parallel_linear,
     variant(tp.ColumnParallelLinear, (CPL_FORWARD, "y = F.linear(x, self.weight, self.bias)\n        dist.all_reduce(y)\n        return y")),
     "a column-parallel layer computes its own outputs without communicating"),
    (checks.check_column_parallel_linear,
     variant(tp.ColumnParallelLinear, (CPL_ROWS, "rows = torch.arange(rank * part * chunks, (rank + 1) * part * chunks)")),
     "contiguous slice of all 24 outputs"),
    (checks.check_column_parallel_linear,
     variant(tp.ColumnParallelLinear, ('        check_divides("out_features per chunk", block, world_size)\n', "")),
     "did not raise ValueError"),
    (checks.check_row_parallel_linear,
     variant(tp.RowParallelLinear, (RPL_FORWARD, "y = F.linear(x, self.weight, self.bias)"),
             ("return y if self.bias is None else y + self.bias", "return y")),
     "the bias was added on every rank before the all-reduce"),
    (checks.check_row_parallel_linear, variant(tp.RowParallelLinear, (RPL_FORWARD, "y = F.linear(x, self.weight, self.bias)")),
     "summed it p times. and once more after it"),
    (checks.check_row_parallel_linear, variant(tp.RowParallelLinear, ("return y if self.bias is None else y + self.bias", "return y")),
     "the full layer's without its bias"),
    (checks.check_row_parallel_linear, variant(tp.RowParallelLinear, (RPL_REDUCE, "y = dist.all_reduce(y)")),
     "collectives work in place and return None"),
    (checks.check_row_parallel_linear, variant(tp.RowParallelLinear, (RPL_REDUCE, "pass")), "made no all-reduce"),
    (checks.check_row_parallel_linear, variant(tp.RowParallelLinear, (RPL_REDUCE, RPL_REDUCE + "\n        dist.all_reduce(y)")),
     "2 all-reduces in one forward"),
    (checks.check_row_parallel_linear,
     variant(tp.RowParallelLinear, ("self.weight = nn.Parameter(linear.weight.detach()[:, rank * part:(rank + 1) * part].clone())",
                                    "self.weight = nn.Parameter(linear.weight.detach()[rank * part:(rank + 1) * part].clone())")),
     "rank 0's weight has shape"),
    (checks.check_shard_block, variant(tp.shard_block, ('    check_divides("n_head", block.attn.n_head, world_size)\n', "")),
     "heads split unevenly"),
    (checks.check_shard_block, variant(tp.shard_block, ("attn.n_head = block.attn.n_head // world_size", "attn.n_head = block.attn.n_head")),
     "attn.n_head is 4, expected H / world_size = 2"),
    (checks.check_shard_block, variant(tp.shard_block, ("block.attn.c_attn, rank, world_size, chunks=3", "block.attn.c_attn, rank, world_size")),
     "keeps rows 0 to 47 of the full c_attn, one contiguous slice of the fused q, k and v outputs"),
    (checks.check_shard_block, variant(tp.shard_block, ("    mlp.c_proj = row_parallel_linear(block.mlp.c_proj, rank, world_size)\n", "")),
     "Are all four linear layers"),
    (checks.check_shard_cache, variant(tp.shard_cache, ("config.n_head // world_size,", "config.n_head,")), "it is not split"),
    (checks.check_shard_cache, variant(tp.shard_cache, ("config.n_embd // config.n_head,", "config.n_embd // (config.n_head // world_size),")),
     "a head keeps its size C / H = 8 on every rank"),
    (checks.check_shard_cache, variant(tp.shard_cache, ('    check_divides("n_head", config.n_head, world_size)\n', "")),
     "did not raise ValueError"),
], ids=["column: all-reduce in forward", "column: [q|k|v] cut as one block", "column: no ValueError",
        "row: bias before the all-reduce", "row: bias before and after the all-reduce", "row: no bias",
        "row: all-reduce's None used", "row: no all-reduce", "row: two all-reduces", "row: weight rows kept",
        "block: heads split unevenly", "block: n_head not divided", "block: c_attn without chunks",
        "block: MLP's c_proj whole", "cache: not split", "cache: head size grown", "cache: no ValueError"])
def test_each_classic_bug_gets_its_message(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message.replace("[", r"\[").replace("(", r"\(")):
        check(buggy)


def test_correct_alternatives_pass(capsys):
    """A column layer that keeps a view of its slice through index_select, a row layer that all-reduces the output of
    F.linear with a zero bias then adds the real one, a cache sized from the number of heads computed another way."""
    column = variant(tp.ColumnParallelLinear, ("linear.weight.detach()[rows].clone()", "linear.weight.detach().index_select(0, rows)"))
    row = variant(tp.RowParallelLinear, (RPL_FORWARD, "y = F.linear(x, self.weight, torch.zeros_like(self.bias) if self.bias is not None else None)"))
    cache = variant(tp.shard_cache, ("config.n_head // world_size,", "(config.n_embd // (config.n_embd // config.n_head)) // world_size,"))
    checks.check_column_parallel_linear(column)
    checks.check_row_parallel_linear(row)
    checks.check_shard_cache(cache)
    assert capsys.readouterr().out.count("all visible checks passed") == 3


def test_an_unfinished_forward_run_on_the_ranks_is_named_not_written():
    """The learner wrote __init__ but not forward: the ranks raise NotImplementedError, the check says so."""
    unfinished = variant(tp.RowParallelLinear, (RPL_FORWARD, "raise NotImplementedError()"))
    with pytest.raises(checks.NotWrittenYet, match="RowParallelLinear is not written yet"):
        checks.check_row_parallel_linear(unfinished)
