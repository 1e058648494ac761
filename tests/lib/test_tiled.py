"""course_lib.tiled beyond the exercises: split-K, paged attention online, the tile count, the IO counts, the
memory measure, each against an independent oracle (SDPA, chapter 12's gathered paged attention, counting by
brute force, the paper's formulas, tensor sizes known by construction)."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from course_lib import serving, tiled
from course_lib.checks import ch12


@pytest.mark.parametrize("splits", [1, 3, 8, 50])
def test_split_k_equals_sdpa(splits):
    g = torch.Generator().manual_seed(splits)
    q, k, v = torch.randn(2, 3, 1, 8, generator=g), torch.randn(2, 3, 37, 8, generator=g), torch.randn(2, 3, 37, 5, generator=g)
    mask = torch.arange(37) < torch.tensor([37, 20]).view(2, 1, 1, 1)  # batch 1: splits past key 20 see nothing
    out, lse = tiled.split_k_attention(q, k, v, splits, mask=mask)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6)
    assert not out.isnan().any()


def test_paged_attention_online_equals_the_gathered_one():
    args = ch12.paged_example(7, [1, 4, 5, 33, 16], block_size=4, n_blocks=40, garbage=30.0)
    assert torch.allclose(tiled.paged_attention_online(*args), serving.paged_attention(*args), atol=1e-5)


def test_split_k_and_paged_online_run_the_tiled_attention_and_merge_partials_they_are_given():
    calls = {"tiled_attention": 0, "merge_partials": 0}

    def counted(name, function):
        def run(*args):
            calls[name] += 1
            return function(*args)
        return run

    mine = dict(tiled_attention=counted("tiled_attention", tiled.tiled_attention),
                merge_partials=counted("merge_partials", tiled.merge_partials))
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    out, _ = tiled.split_k_attention(q, k, v, 3, **mine)
    assert calls == {"tiled_attention": 3, "merge_partials": 1}  # one call per chunk of 10 keys, one merge
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6)
    args = ch12.paged_example(7, [1, 4, 5, 33, 16], block_size=4, n_blocks=40, garbage=30.0)
    calls.update(tiled_attention=0, merge_partials=0)
    out = tiled.paged_attention_online(*args, **mine)
    assert calls == {"tiled_attention": 9, "merge_partials": 9}  # one of each per column of the widest block table
    assert torch.allclose(out, serving.paged_attention(*args), atol=1e-5)


@pytest.mark.parametrize("Tq,Tk,bq,bk", [(512, 512, 64, 64), (100, 100, 16, 7), (10, 30, 4, 4), (30, 10, 8, 3)])
def test_causal_tile_counts_by_brute_force(Tq, Tk, bq, bk):
    visible = torch.ones(Tq, Tk, dtype=torch.bool).tril()
    tiles = [(i, j) for i in range(0, Tq, bq) for j in range(0, Tk, bk)]
    assert tiled.causal_tile_counts(Tq, Tk, bq, bk) == (sum(bool(visible[i:i + bq, j:j + bk].any()) for i, j in tiles), len(tiles))


def test_hbm_accesses_follow_the_algorithms_as_written():
    N, d, M = 1024, 64, 16384
    assert tiled.hbm_accesses(N, d) == 4 * N * N + 4 * N * d
    br, bc = tiled.fa_block_sizes(d, M)
    assert (br, bc) == (64, 64)  # B_c = ceil(16384 / 256) = 64, B_r = min(64, d)
    t_c = N // bc
    assert tiled.hbm_accesses(N, d, M, "flash") == (N * d + 2 * N) + 2 * N * d + t_c * N * (3 * d + 4)
    assert tiled.hbm_accesses(N, d, M, "flash2") == 2 * N * d + (N // br) * 2 * N * d + N
    with pytest.raises(ValueError):
        tiled.hbm_accesses(N, d, d - 1, "flash")
    with pytest.raises(ValueError):
        tiled.hbm_accesses(N, d, M, "flash3")


def test_largest_tensor_created_counts_new_memory_not_views():
    x = torch.randn(10, 20)
    assert tiled.largest_tensor_created(lambda t: t.T[2:5].expand(4, 3, 10), x)[0] == 0
    assert tiled.largest_tensor_created(lambda t: (t @ t.T).sum(), x)[0] == 100
    q = torch.randn(1, 1, 64, 4)
    assert tiled.largest_tensor_created(lambda a: torch.softmax(a @ a.transpose(-2, -1), -1), q)[0] == 64 * 64


def test_online_softmax_and_tiled_reject_bad_arguments():
    with pytest.raises(ValueError):
        tiled.online_softmax(iter([]))
    q = torch.randn(1, 1, 4, 2)
    for bq, bk in ((0, 1), (1, 0)):
        with pytest.raises(ValueError):
            tiled.tiled_attention(q, q, q, block_q=bq, block_k=bk)
    with pytest.raises(ValueError):
        tiled.split_k_attention(q, q, q, 0)
