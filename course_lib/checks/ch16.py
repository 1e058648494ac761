"""Visible checks of chapter 16 (tensor-parallel decoding), and the oracles they compare against.

Oracles: the full layer or model run in one process (``nn.Linear``, ``GPTBlock.forward``, ``GPT.forward``,
``kv_cache.generate_cached``), never course_lib.tensor_parallel's reference solutions of the exercise checked; the
other exercises run the course's versions, so that one mistake fails one check. All-reduces are counted on each rank
(``count_all_reduces``), elements held measured by ``numel``. The ranks are processes of a ``launch``ed group; a
rank's logits equal one process's within float32 rounding only (the all-reduce adds the ranks' partial sums in
another order), so they are compared at the course's tolerance.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .. import tensor_parallel as tp
from ..gpt import GPT, GPTConfig
from ..kv_cache import StaticKVCache, cached_forward, generate_cached
from .core import NotWrittenYet, assert_close, assert_shape, assert_tensor, call_learner, fail, passed

__all__ = ["check_column_parallel_linear", "check_row_parallel_linear", "check_shard_block", "check_shard_cache",
           "tiny_parallel_gpt"]


def tiny_parallel_gpt(seed: int = 16, n_layer: int = 2, n_head: int = 4, n_embd: int = 32) -> GPT:
    """A small random GPT in eval mode whose biases and LayerNorms are far from 0 and 1 (a bias added twice shows)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=48, block_size=32, n_layer=n_layer, n_head=n_head, n_embd=n_embd)).eval()
    with torch.no_grad():
        for name, parameter in model.transformer.h.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.3)
            elif "ln_" in name:
                parameter.normal_(1.0, 0.3)
    return model


def _launch(job, world_size: int, what: str, *args):
    """launch(job, world_size, *args); a rank's failure becomes a message naming it (an unfinished exercise stays
    unfinished)."""
    try:
        return tp.launch(job, world_size, *args, timeout=60)
    except tp.RankError as error:
        if error.error_type == "NotImplementedError":
            raise NotWrittenYet(f"{what} is not written yet: its code still raises NotImplementedError (on rank "
                                f"{error.rank}). Write it and run its cell.") from None
        first = str(error).splitlines()[0]
        if "NoneType" in first:
            first += (" (torch.distributed's collectives work in place and return None: call dist.all_reduce(y), "
                      "then use y)")
        fail(f"{what} failed on rank {error.rank} of {world_size}: {first}")


def _unchanged(linear: nn.Linear, before: dict, what: str):
    for name, value in before.items():
        if not torch.equal(getattr(linear, name).detach(), value):
            fail(f"{what} changed the full layer's {name}: keep a copy of the rank's slice, leave the layer as it was")


# ---------------------------------------------------------------- exercise 1: ColumnParallelLinear

def _column_job(rank, world_size, ColumnParallelLinear, full, x):
    layer = ColumnParallelLinear(full, rank, world_size, chunks=3)
    with tp.count_all_reduces() as count:
        y = layer(x)
    return y.detach(), count.calls


def check_column_parallel_linear(ColumnParallelLinear) -> None:
    """Visible checks for chapter 16, exercise 1: output features split across ranks, no communication."""
    torch.manual_seed(161)
    full = nn.Linear(12, 3 * 8)
    x = torch.randn(2, 3, 12)
    before = {"weight": full.weight.detach().clone(), "bias": full.bias.detach().clone()}
    expected = full(x).detach()
    q, k, v = expected.split(8, dim=-1)
    for p in (1, 2, 4):
        for rank in range(p):
            what = f"ColumnParallelLinear(linear 12 -> 24, rank={rank}, world_size={p}"
            plain = call_learner(lambda: ColumnParallelLinear(full, rank, p), what + ")", errors=(RuntimeError, TypeError))
            if not isinstance(getattr(plain, "weight", None), torch.Tensor):
                fail(f"{what}) has no tensor .weight: keep the rank's rows of the full weight as .weight")
            assert_shape(plain.weight, (24 // p, 12), f"{what}).weight (out / world_size, in)")
            y = call_learner(lambda: plain(x), f"{what})(x), outside any process group",
                             "a column-parallel layer computes its own outputs without communicating: no torch.distributed "
                             "call in its forward", (RuntimeError, ValueError))
            assert_tensor(y, f"{what})(x)")
            assert_close(y, expected[..., rank * 24 // p:(rank + 1) * 24 // p],
                         f"{what})(x): the full layer's outputs {rank * 24 // p} .. {(rank + 1) * 24 // p - 1}")
            fused = call_learner(lambda: ColumnParallelLinear(full, rank, p, chunks=3)(x), f"{what}, chunks=3)(x)",
                                 errors=(RuntimeError, TypeError))
            s = slice(rank * 8 // p, (rank + 1) * 8 // p)
            if p > 1 and fused.shape == y.shape and torch.allclose(fused, y, rtol=1e-5, atol=1e-5):
                fail(f"{what}, chunks=3) returned the rank's contiguous slice of all 24 outputs: with chunks=3 the "
                     "outputs are three blocks [q | k | v]; keep the rank's slice of each block, side by side, so that "
                     "each rank gets the q, k and v of the same heads")
            assert_close(fused, torch.cat([q[..., s], k[..., s], v[..., s]], dim=-1),
                         f"{what}, chunks=3)(x): [q | k | v] of the rank's slice of each block")
    _unchanged(full, before, "ColumnParallelLinear")
    for world_size, chunks in ((4, 1), (1, 4)):
        try:
            ColumnParallelLinear(nn.Linear(4, 6), 0, world_size, chunks=chunks)
        except ValueError:
            continue
        fail(f"ColumnParallelLinear(Linear(4, 6), rank=0, world_size={world_size}, chunks={chunks}) did not raise "
             "ValueError: chunks must divide the output features, and world_size each chunk's (say which, and the sizes)")
    for y, calls in _launch(_column_job, 2, "ColumnParallelLinear", ColumnParallelLinear, full, x):
        if calls:
            fail(f"ColumnParallelLinear's forward called torch.distributed.all_reduce {calls} time(s) on 2 ranks: a "
                 "column-parallel layer needs no communication (each rank computes its own output features from the "
                 "whole input); the all-reduce belongs after the row-parallel layer that follows it")
    passed("ColumnParallelLinear")


# ---------------------------------------------------------------- exercise 2: RowParallelLinear

def _row_job(rank, world_size, RowParallelLinear, full, x):
    layer = RowParallelLinear(full, rank, world_size)
    part = full.in_features // world_size
    with tp.count_all_reduces() as count:
        y = layer(x[..., rank * part:(rank + 1) * part])
    return y.detach(), count.calls, tuple(layer.weight.shape)


def check_row_parallel_linear(RowParallelLinear) -> None:
    """Visible checks for chapter 16, exercise 2: input features split across ranks, one all-reduce, the bias once."""
    torch.manual_seed(162)
    full = nn.Linear(16, 6)
    nn.init.uniform_(full.bias, 1.0, 2.0)
    x = torch.randn(2, 3, 16)
    before = {"weight": full.weight.detach().clone(), "bias": full.bias.detach().clone()}
    expected = full(x).detach()
    for bad in ((nn.Linear(6, 4), 0, 4), (nn.Linear(8, 4), 2, 2)):
        try:
            RowParallelLinear(*bad)
        except ValueError:
            continue
        fail(f"RowParallelLinear(Linear({bad[0].in_features}, 4), rank={bad[1]}, world_size={bad[2]}) did not raise "
             "ValueError: world_size must divide in_features, and rank must be in [0, world_size)")
    p = 2
    for rank in range(p):
        layer = call_learner(lambda: RowParallelLinear(full, rank, p), f"RowParallelLinear(linear 16 -> 6, rank={rank}, "
                             f"world_size={p})", errors=(RuntimeError, TypeError))
        shape = tuple(getattr(layer, "weight", torch.empty(0)).shape)
        if shape != (6, 16 // p):
            fail(f"rank {rank}'s weight has shape {shape}, expected (out, in / world_size) = (6, {16 // p}): keep the "
                 "rank's columns of the full weight (its slice of the input features)")
    for rank, (y, calls, shape) in enumerate(_launch(_row_job, p, "RowParallelLinear", RowParallelLinear, full, x)):
        if calls == 0:
            fail(f"rank {rank} made no all-reduce: each rank holds only its partial sum x_rank @ W_rank^T; "
                 "torch.distributed.all_reduce sums them over the ranks (in place)")
        if calls > 1:
            fail(f"rank {rank} made {calls} all-reduces in one forward: one is enough (the partial products, summed)")
        bias = full.bias.detach()
        if torch.allclose(y, expected + (p - 1) * bias, rtol=1e-5, atol=1e-5):
            fail(f"rank {rank}'s output is the full layer's plus {p - 1} more bias: the bias was added on every rank "
                 "before the all-reduce, which then summed it p times. Add it once, after the all-reduce")
        if torch.allclose(y, expected + p * bias, rtol=1e-5, atol=1e-5):
            fail(f"rank {rank}'s output is the full layer's plus {p} more bias: the bias was added on every rank "
                 "before the all-reduce (which summed it p times) and once more after it. Compute the partial "
                 "product without the bias; add the bias once, after the all-reduce")
        if torch.allclose(y, expected - bias, rtol=1e-5, atol=1e-5):
            fail(f"rank {rank}'s output is the full layer's without its bias: add the bias once, after the all-reduce")
        assert_close(y, expected, f"rank {rank}'s output (the full layer's, on every rank)")
    _unchanged(full, before, "RowParallelLinear")
    passed("RowParallelLinear")


# ---------------------------------------------------------------- exercise 3: shard_block

def _block_job(rank, world_size, shard_block, model, idx):
    block = partial(shard_block, column_parallel_linear=tp.ColumnParallelLinear, row_parallel_linear=tp.RowParallelLinear)
    shard = tp.shard_gpt(model, rank, world_size, shard_block=block)
    cache = tp.shard_cache(model.config, world_size, idx.shape[0], idx.shape[1])
    with torch.inference_mode(), tp.count_all_reduces() as count:
        logits = cached_forward(shard, idx, cache)
    return logits, count.calls


def check_shard_block(shard_block) -> None:
    """Visible checks for chapter 16, exercise 3: a GPT block split by heads, two all-reduces per block."""
    six = tiny_parallel_gpt(n_layer=1, n_head=6, n_embd=48).transformer.h[0]
    try:
        shard_block(six, 0, 4, column_parallel_linear=tp.ColumnParallelLinear, row_parallel_linear=tp.RowParallelLinear)
    except ValueError:
        pass
    except NotImplementedError:
        raise
    else:
        fail("shard_block(block, 0, world_size=4) of a block of 6 heads of 8 channels did not raise ValueError: its 48 "
             "channels split in 4 slices of 12 cut heads in half (heads split unevenly); world_size must divide n_head")
    model = tiny_parallel_gpt()
    block = model.transformer.h[0]
    H, C, L = block.attn.n_head, model.config.n_embd, model.config.n_layer
    idx = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35], [8, 9, 7, 9, 3, 2, 38, 4]])
    expected = model(idx)[0].detach()
    replicated = sum(p.numel() for p in (*block.ln_1.parameters(), *block.ln_2.parameters())) + 2 * C
    whole = sum(p.numel() for p in block.parameters())
    for p in (2, 4):
        for rank in range(p):  # what each rank holds, built here: no communication needed
            where = f"shard_block(block, rank={rank}, world_size={p})"
            shard = call_learner(lambda: shard_block(block, rank, p, column_parallel_linear=tp.ColumnParallelLinear,
                                                     row_parallel_linear=tp.RowParallelLinear), where,
                                 errors=(RuntimeError, TypeError, ValueError))
            if shard is block or not isinstance(shard, nn.Module):
                fail(f"{where} returned {'the block itself' if shard is block else type(shard).__name__}: return a new "
                     "block (a copy), the full one left as it was")
            if getattr(shard.attn, "n_head", None) != H // p:
                fail(f"{where}: attn.n_head is {getattr(shard.attn, 'n_head', None)}, expected H / world_size = {H // p}: "
                     "a rank runs its own heads only (of the same head size C / H as the full block)")
            kept, rows = getattr(getattr(shard.attn, "c_attn", None), "weight", None), 3 * C // p
            if isinstance(kept, torch.Tensor) and torch.equal(kept.detach(), block.attn.c_attn.weight.detach()[rank * rows:(rank + 1) * rows]):
                fail(f"{where}: attn.c_attn keeps rows {rank * rows} to {(rank + 1) * rows - 1} of the full c_attn, one "
                     f"contiguous slice of the fused q, k and v outputs: those are not the q, k and v of the same heads. "
                     f"Split it with chunks=3")
            numel = sum(t.numel() for t in shard.parameters())
            if numel != (whole - replicated) // p + replicated:
                fail(f"{where} holds {numel} parameter elements, expected {(whole - replicated) // p + replicated}: "
                     "1 / world_size of the four weight matrices and of the column-parallel biases, the LayerNorms and "
                     "the row-parallel biases whole. Are all four linear layers (attn.c_attn, attn.c_proj, mlp.c_fc, "
                     "mlp.c_proj) replaced by their parallel versions?")
        for rank, (logits, calls) in enumerate(_launch(_block_job, p, "shard_block", shard_block, model, idx)):
            where = f"rank {rank} of {p}"
            if calls != 2 * L:
                fail(f"{where}: {calls} all-reduces in a forward pass through {L} blocks, expected 2 per block "
                     "(after the attention's output projection and after the MLP's second layer, both row-parallel)")
            if not torch.allclose(logits, expected, rtol=1e-4, atol=1e-4):
                fail(f"{where}: the sharded model's logits differ from one process's by "
                     f"{(logits - expected).abs().max().item():.3g}. Is c_attn split with chunks=3 (each rank the q, k and "
                     "v of the same heads), c_proj row-parallel, and the MLP's c_fc column- and c_proj row-parallel?")
            assert_close(logits, expected, f"{where}: the sharded model's logits")
    passed("shard_block")


# ---------------------------------------------------------------- exercise 4: shard_cache

def _cache_job(rank, world_size, shard_cache, model, idx, new_tokens):
    cache = shard_cache(model.config, world_size, idx.shape[0], idx.shape[1] + new_tokens)
    tokens = tp.tp_generate(model, idx, new_tokens, rank, world_size, shard_cache=shard_cache)
    return tokens, cache.storage.numel()


def check_shard_cache(shard_cache) -> None:
    """Visible checks for chapter 16, exercise 4: each rank caches its own heads' keys and values only."""
    model = tiny_parallel_gpt()
    config = model.config
    idx = torch.tensor([[3, 14, 15, 9, 2, 6], [8, 9, 7, 9, 3, 2]])
    new = 10
    full = StaticKVCache.for_model(model, idx.shape[0], idx.shape[1] + new)
    for p in (2, 4):
        cache = call_learner(lambda: shard_cache(config, p, idx.shape[0], idx.shape[1] + new),
                             f"shard_cache(config, world_size={p}, batch_size=2, max_len=16)", errors=(RuntimeError, TypeError))
        if not isinstance(cache, StaticKVCache):
            fail(f"shard_cache returned a {type(cache).__name__}, expected a StaticKVCache (chapter 05's)")
        storage = cache.storage
        if storage.dim() == 6 and storage.shape[3] == config.n_head // p and storage.shape[5] != config.n_embd // config.n_head:
            fail(f"with world_size={p} the cache holds {storage.shape[3]} heads of size {storage.shape[5]}: a head keeps "
                 f"its size C / H = {config.n_embd // config.n_head} on every rank (only the heads are split), so each "
                 f"rank's cache is 1 / world_size of one process's")
        if storage.numel() == full.storage.numel():
            fail(f"with world_size={p} the cache holds as many elements as one process's ({full.storage.numel()}): it "
                 f"is not split. A rank computes the keys and values of its own {config.n_head // p} heads only; cache "
                 "those, in 1 / world_size of the memory")
        assert_shape(cache.storage, (config.n_layer, 2, idx.shape[0], config.n_head // p, idx.shape[1] + new,
                                     config.n_embd // config.n_head), f"the storage of a rank's cache (world_size={p})")
    try:
        shard_cache(config, 3, 1, 8)
    except ValueError:
        pass
    else:
        fail(f"shard_cache(config, world_size=3, ...) for {config.n_head} heads did not raise ValueError: world_size "
             "must divide n_head")
    with torch.inference_mode():
        expected = generate_cached(model, idx, new)
    for rank, (tokens, numel) in enumerate(_launch(_cache_job, 2, "shard_cache", shard_cache, model, idx, new)):
        if not torch.equal(tokens, expected):
            fail(f"rank {rank}: greedy decoding with your caches chose {tokens.tolist()}, one process "
                 f"{expected.tolist()}")
    passed("shard_cache")
