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


def test_bad_arguments_get_a_value_error_naming_them():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 5)
    cases = [
        (lambda: tiled.tiled_attention(q, k, torch.randn(1, 2, 7, 5)), "v"),  # a slice would hide it (SDPA refuses it here, not always)
        (lambda: tiled.tiled_attention(q, k[..., :4], v), "k"),
        (lambda: tiled.tiled_attention(q, k.double(), v), "dtype"),
        (lambda: tiled.tiled_attention(q, k, v, torch.ones(4, 6)), "mask must be boolean"),
        (lambda: tiled.tiled_attention(q, k, v, torch.ones(4, 6, dtype=torch.int64)), "mask must be boolean"),
        (lambda: tiled.tiled_attention(q, k, v, torch.ones(4, 5, dtype=torch.bool)), "mask must broadcast"),
        (lambda: tiled.merge_partials(torch.randn(3, 2, 5), torch.randn(3, 2, 1)), "lses"),
        (lambda: tiled.online_softmax(iter([torch.randn(3, 4), torch.randn(1, 4)])), "blocks"),
        (lambda: tiled.online_softmax(iter([torch.randn(3, 4), torch.randn(3, 0)])), "at least one entry"),
        (lambda: tiled.online_softmax(iter([torch.tensor(1.0)])), "at least one entry"),
        (lambda: tiled.causal_tile_counts(0, 8, 4, 4), "Tq"),
        (lambda: tiled.causal_tile_counts(8, 8, 4, -1), "block_k"),
        (lambda: tiled.hbm_accesses(-4, 64), "N"),
        (lambda: tiled.hbm_accesses(1024, 0, 4096, "flash"), "d"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_float32_as_sdpa_does(dtype):
    g = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(1, 4, 512, 64, generator=g).to(dtype) for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    sdpa = (F.scaled_dot_product_attention(q, k, v).double() - exact).abs().mean()
    out, lse = tiled.tiled_attention(q, k, v, block_q=64, block_k=16)
    assert out.dtype == lse.dtype == dtype
    assert (out.double() - exact).abs().mean() <= 1.2 * sdpa  # kept in the low precision: 3 to 5 times SDPA's error
