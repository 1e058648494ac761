"""Tensor parallelism, chapter 16: one GPT split across p processes, Megatron-LM's way (Shoeybi et al., 2019).

The processes talk through ``torch.distributed`` (the gloo backend, on the loopback address), never a home-made
transport. ``launch(fn, world_size)`` runs ``fn(rank, world_size, *args)`` on world_size processes joined in one
process group and returns what each rank returned.

The split (what vLLM runs as ``tensor_parallel_size``):

* ``ColumnParallelLinear``: rank r keeps the r-th slice of a Linear's output features; each rank computes its own
  outputs from the whole input, without communicating.
* ``RowParallelLinear``: rank r keeps the r-th slice of the input features; each rank computes a partial product from
  its slice of the input, one all-reduce sums the p partial products, then the bias is added once.
* ``shard_block``: a GPT block with its heads split across ranks (``c_attn`` column-parallel, each rank the q, k and v
  of its H/p heads; the output projection row-parallel), the MLP's first layer column-parallel and its second
  row-parallel: two all-reduces per block forward, one per residual branch. LayerNorms are replicated.
* ``shard_cache``: each rank caches the keys and values of its own H/p heads only.
* ``tp_generate``: cached greedy decoding on the sharded model, through the library's one loop (``gpt.extend``), one
  forward pass (``gpt.gpt_logits``, ``gpt_block``) and chapter 05's attention step (``kv_cache.cached_attention``),
  which runs unchanged on a rank's heads. Embeddings, the final LayerNorm and the LM head are replicated (Megatron
  also splits the vocabulary: not done here).

The contrast, pipeline parallelism: ``pipeline_stage`` keeps L/p whole layers per rank, the activations sent from
one stage to the next, no all-reduce; ``pp_generate`` decodes on it (for one sequence the stages take turns).
The engine on p processes (chapter 12's ``Engine(..., tensor_parallel_size=p)``) is ``serving.executor``.

Why the processes are forked. The learner's classes live in a Jupyter kernel's ``__main__``: with the ``spawn`` start
method a child process imports the function it runs by name, and a function or class defined in a notebook has no
module to be imported from, so it cannot reach the child. ``fork`` copies the whole kernel, the learner's classes
included, and nothing is pickled on the way in (only the results come back pickled). The price of fork with PyTorch:
the child must not use the parent's intra-op thread pool (OpenMP is not fork-safe), so each child sets its own thread
count (``threads``, one by default: a parallel region with one thread runs inline) before it computes anything; and
it must not write to the parent's ``sys.stdout``, which in a Jupyter kernel is a ZeroMQ socket shared with the
parent's threads: what a rank prints is dropped (its return value and its error come back). For the same reason
the ranks meet through a file (``FileStore``) rather than a TCP store served by the parent: a store's server thread
in the parent, caught holding a lock at the moment of a fork, left the child's own store client waiting forever
(a few launches in a hundred, measured). The ranks then talk to each other over TCP on the loopback address.
Fork is Linux's (and macOS's) start method; the course runs on Linux.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import multiprocessing
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .gpt import GPT, GPTBlock, GPTConfig, extend, greedy_choice
from .kv_cache import StaticKVCache, cached_forward
from .validation import check_positive

#: The seconds a group may run (``launch``) and each collective may wait for the other ranks (gloo's timeout).
TIMEOUT_S = 60.0
#: After a rank fails, the seconds ``launch`` waits for the others to report (a collective they were in fails too).
GRACE_S = 1.0


class RankError(RuntimeError):
    """A rank of a ``launch`` failed (an exception, a crash or the time limit); ``rank`` names it."""

    def __init__(self, rank: int, message: str, error_type: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type  # the name of the exception the rank raised ("NotImplementedError"), if it raised


def _worker(fn, rank, world_size, store_path, timeout, threads, args, results):
    """One rank: join the group, run fn, send back (rank, "ok", pickled result) or
    (rank, "error", (when, traceback, the exception's type name))."""
    failed_at = None
    sys.stdout = sys.stderr = open(os.devnull, "w")  # never the parent's streams: a Jupyter kernel's talk over ZeroMQ
    for fd in (1, 2):  # nor its file descriptors (which a kernel copies into the notebook): C++ logs included
        os.dup2(sys.stdout.fileno(), fd)
    try:
        torch.set_num_threads(threads)  # before any computation: the parent's thread pool did not survive the fork
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no name lookup, works without a network
        limit = datetime.timedelta(seconds=timeout)
        store = dist.FileStore(store_path, world_size)  # the rendezvous: a file, no server thread to fork from
        store.set_timeout(limit)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=limit)
        try:
            out = fn(rank, world_size, *args)
            # reported before the wait below, so that a group out of time names the ranks still running fn
            results.put((rank, "ok", pickle.dumps(out)))
        except BaseException:
            failed_at = time.monotonic()  # one clock for every process: the first failure is the cause of the others
            raise
        else:
            # no rank leaves before every rank is done: init_process_group can return on one rank while another is
            # still connecting to it, and a rank whose fn made no collective then closed its sockets under that
            # connection ("Gloo connectFullMesh failed ... Connection closed by peer", a few launches in a hundred)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 -- every failure, SystemExit included, is reported with its rank
        results.put((rank, "error", (failed_at or time.monotonic(), traceback.format_exc(), type(error).__name__)))


def first_failure_error(failed: dict, world_size: int) -> RankError:
    """The RankError of the rank that failed first (a collective the others were in then failed because of it).
    failed: rank -> (when it failed, on ``time.monotonic``'s clock; its traceback or what happened; the exception's
    type name or None), as the ranks report it (``_worker``)."""
    rank = min(failed, key=lambda r: failed[r][0])
    _, text, error_type = failed[rank]
    others = sorted(set(failed) - {rank})
    then = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too)" if others else ""
    return RankError(rank, f"rank {rank} of {world_size} failed{then}: {text.strip().splitlines()[-1]}\n\n{text}",
                     error_type)


def launch(fn: Callable, world_size: int, *args, timeout: float = TIMEOUT_S, threads: int = 1) -> list:
    """Run fn(rank, world_size, *args) on world_size forked processes joined in a gloo process group on the loopback
    interface (they meet through a file in a temporary folder, removed afterwards).

    Returns [what rank 0 returned, ..., what rank world_size - 1 returned] (each pickled on its way back). Every
    collective waits at most `timeout` seconds for the other ranks, and the whole group may run `timeout` seconds.
    A rank that raises, crashes or runs out of time ends the group: the other ranks are stopped and ``RankError``
    names the first rank that failed (with its traceback), never a hang; a rank interrupted (KeyboardInterrupt: the
    learner stopped the run) raises KeyboardInterrupt here. Every process is gone when this returns.
    world_size >= 1, timeout > 0, threads >= 1 (each rank's torch threads), else ValueError naming it.
    """
    check_positive("world_size", world_size)
    check_positive("threads", threads)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    context = multiprocessing.get_context("fork")
    folder = tempfile.mkdtemp(prefix="course-tp-")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(fn, rank, world_size, os.path.join(folder, "store"), timeout,
                                                       threads, args, results),
                                 daemon=True) for rank in range(world_size)]
    done: dict[int, object] = {}
    failed: dict[int, tuple] = {}  # rank -> (when it failed, traceback, exception type name or None)
    first_failure = 0.0  # when the parent heard of the first failure
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.start()
        while len(done) + len(failed) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.05)
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if rank not in done and rank not in failed and process.exitcode not in (None, 0):
                        first_failure = first_failure if failed else time.monotonic()
                        # a crash has no report: taken as the cause, since a rank that a collective failed reports
                        failed[rank] = (float("-inf"), f"rank {rank} of {world_size} died (exit code {process.exitcode})", None)
                if failed and time.monotonic() > first_failure + GRACE_S:
                    break  # the other ranks had their time to report why they stopped
                if time.monotonic() > deadline:
                    late = [rank for rank in range(world_size) if rank not in done and rank not in failed]
                    raise RankError(late[0], f"rank {late[0]} of {world_size} did not finish within {timeout} s "
                                              f"(ranks still running: {late})")
                continue
            if rank in done:
                continue  # a rank that finished, then failed waiting for the others: one of them is the cause
            if status == "ok":
                done[rank] = pickle.loads(payload)
            else:
                first_failure = first_failure if failed else time.monotonic()
                failed[rank] = payload
        if failed:
            if any(error_type == "KeyboardInterrupt" for *_, error_type in failed.values()):
                raise KeyboardInterrupt  # the learner stopped the run (Jupyter's interrupt reaches the ranks too)
            raise first_failure_error(failed, world_size)
        return [done[rank] for rank in range(world_size)]
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class AllReduceCount:
    """What ``count_all_reduces`` counted: all-reduces run, and the seconds the backend spent on them (each from its
    start to its end on gloo's side: the communication, waiting for the slowest rank included)."""

    calls: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def count_all_reduces():
    """Count the all-reduces this process runs inside the block; yields an AllReduceCount, filled in when the block ends.

    The count is the process group's own record: gloo reports each collective it runs to PyTorch's profiler (an
    event "gloo:all_reduce"), whoever called it and however (``dist.all_reduce`` or a name bound to it), so the count
    is of the all-reduces made, not of the calls a design should make; nothing is replaced. The profiler slows
    every operation in the block a little: time computation outside it."""
    count = AllReduceCount()
    with torch.autograd.profiler.profile() as profile:
        yield count
    # the raw events: building the profiler's event tree (function_events) would take seconds for a decoding
    events = [event for event in profile.kineto_results.events() if event.name() == "gloo:all_reduce"]
    count.calls = len(events)
    count.seconds = sum(event.duration_ns() for event in events) / 1e9


def ring_all_reduce(tensor: torch.Tensor) -> int:
    """Sum a contiguous `tensor` over the ranks of the process group, in place, by the ring algorithm (NCCL's and
    Baidu's ring all-reduce), with ``torch.distributed``'s point-to-point send and receive; call it on every rank.

    The tensor is cut into p chunks; in p - 1 steps of reduce-scatter each rank sends one chunk to its right
    neighbour and adds the chunk its left neighbour sends, until each holds one chunk summed over every rank; in
    p - 1 steps of all-gather the summed chunks go round the ring once. Returns the elements this rank sent:
    2 (p - 1) n / p of the n elements when p divides n, whatever p, against the (p - 1) n of sending the whole
    tensor to every other rank.
    """
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (the chunks are views of it)")
    p, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(p)
    right, left = (rank + 1) % p, (rank - 1) % p
    sent = 0
    for step in range(p - 1):  # reduce-scatter: afterwards this rank holds chunk (rank + 1) % p summed
        out, into = chunks[(rank - step) % p], chunks[(rank - step - 1) % p]
        received = torch.empty_like(into)
        request = dist.isend(out, right)
        dist.recv(received, left)
        request.wait()
        into += received
        sent += out.numel()
    for step in range(p - 1):  # all-gather: each summed chunk travels once round the ring
        out, into = chunks[(rank - step + 1) % p], chunks[(rank - step) % p]
        request = dist.isend(out, right)
        dist.recv(into, left)
        request.wait()
        sent += out.numel()
    return sent


def check_divides(name: str, size: int, world_size: int, by: str = "world_size"):
    """ValueError naming `name` unless world_size (an integer >= 1, called `by`) divides size."""
    check_positive(by, world_size)
    if size % world_size:
        raise ValueError(f"{name} ({size}) must be divisible by {by} ({world_size})")


def check_rank(rank: int, world_size: int):
    """ValueError naming rank unless it is an integer in [0, world_size)."""
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size - 1}], got {rank!r}")


class ColumnParallelLinear(nn.Module):
    """Rank `rank`'s share of nn.Linear `linear`, its output features split across world_size ranks.

    The output features are `chunks` equal blocks side by side (1 for a plain layer; 3 for ``c_attn``'s
    [q | k | v]); the rank keeps the rank-th of world_size equal slices of each block, so its outputs are
    [q_rank | k_rank | v_rank]. forward: x (..., in) -> (..., out / world_size), those outputs of the full layer
    (bias included), with no communication. weight (out / world_size, in), bias (out / world_size,) or None:
    copies, the full layer is left as it was. ValueError unless world_size divides each block, or for a rank
    outside [0, world_size).
    """

    def __init__(self, linear: nn.Linear, rank: int, world_size: int, chunks: int = 1):
        super().__init__()
        check_divides("out_features", linear.out_features, chunks, by="chunks")
        block = linear.out_features // chunks
        check_divides("out_features per chunk", block, world_size)
        check_rank(rank, world_size)
        part = block // world_size
        rows = torch.cat([torch.arange(c * block + rank * part, c * block + (rank + 1) * part) for c in range(chunks)])
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x):
        """x (..., in) -> (..., out / world_size)."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank `rank`'s share of nn.Linear `linear`, its input features split across world_size ranks.

    The rank keeps the rank-th of world_size equal slices of the input features (weight (out, in / world_size))
    and the whole bias. forward: x (..., in / world_size), the rank's slice of the full layer's input -> (..., out),
    the full layer's output, on every rank: the partial products of the ranks are summed by one
    ``torch.distributed.all_reduce``, and the bias is added once, after it. ValueError unless world_size divides
    in_features, or for a rank outside [0, world_size).
    """

    def __init__(self, linear: nn.Linear, rank: int, world_size: int):
        super().__init__()
        check_divides("in_features", linear.in_features, world_size)
        check_rank(rank, world_size)
        part = linear.in_features // world_size
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * part:(rank + 1) * part].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        """x (..., in / world_size) -> (..., out), summed over the ranks."""
        y = F.linear(x, self.weight)  # this rank's partial sum
        dist.all_reduce(y)  # sum over the ranks, in place: every rank now holds x_full @ W^T
        return y if self.bias is None else y + self.bias


def shard_block(block: GPTBlock, rank: int, world_size: int, column_parallel_linear=ColumnParallelLinear,
                row_parallel_linear=RowParallelLinear) -> GPTBlock:
    """Rank `rank`'s share of a GPT block (chapter 04's GPTBlock), its heads split across world_size ranks: a new block.

    attn.c_attn column-parallel with chunks=3 (the q, k and v of heads rank * H/p .. (rank + 1) * H/p - 1),
    attn.c_proj row-parallel, attn.n_head = H / p; mlp.c_fc column-parallel, mlp.c_proj row-parallel; the
    LayerNorms copied whole. The block runs through ``gpt_block`` with an attention step (``cached_attention``
    on the rank's heads), two all-reduces per forward, after which every rank's output is the full block's.
    ValueError unless world_size divides n_head. The block given is left as it was.
    """
    check_divides("n_head", block.attn.n_head, world_size)
    shard = copy.deepcopy(block)
    attn, mlp = shard.attn, shard.mlp
    attn.c_attn = column_parallel_linear(block.attn.c_attn, rank, world_size, chunks=3)
    attn.c_proj = row_parallel_linear(block.attn.c_proj, rank, world_size)
    attn.n_head = block.attn.n_head // world_size
    mlp.c_fc = column_parallel_linear(block.mlp.c_fc, rank, world_size)
    mlp.c_proj = row_parallel_linear(block.mlp.c_proj, rank, world_size)
    return shard


def shard_gpt(model: GPT, rank: int, world_size: int, shard_block=shard_block) -> GPT:
    """Rank `rank`'s share of a GPT: every block sharded by ``shard_block``, embeddings, final LayerNorm and the
    (tied) LM head replicated. A new model in eval mode, its config the full model's; `model` is left as it was.
    It runs only through ``cached_forward`` (its blocks' attention is a step against a ``shard_cache``)."""
    blocks = model.transformer.h
    model.transformer.h = nn.ModuleList()  # the blocks are sharded one by one, never copied whole
    try:
        shard = copy.deepcopy(model)
    finally:
        model.transformer.h = blocks
    shard.transformer.h = nn.ModuleList([shard_block(block, rank, world_size) for block in blocks])
    return shard.eval()


def shard_cache(config: GPTConfig, world_size: int, batch_size: int, max_len: int, *, dtype=torch.float32) -> StaticKVCache:
    """A rank's KV cache: the keys and values of its n_head / world_size heads, in every layer, for batch_size rows
    and max_len tokens: (1 / world_size) of the full model's cache. ValueError unless world_size divides n_head."""
    check_divides("n_head", config.n_head, world_size)
    return StaticKVCache(config.n_layer, batch_size, config.n_head // world_size, config.n_embd // config.n_head,
                         max_len, dtype=dtype)


@torch.inference_mode()
def tp_generate(model: GPT, idx, max_new_tokens: int, rank: int, world_size: int, *, shard_block=shard_block,
                shard_cache=shard_cache):
    """Greedy decoding of a GPT sharded across the world_size ranks of the current process group, on rank `rank`:
    idx (B, T) int64 -> (B, T + max_new_tokens), the same on every rank, and the tokens a single process chooses
    (``kv_cache.generate_cached``) where no two logits tie within float32 rounding. Call it on every rank."""
    B, T = idx.shape
    shard = shard_gpt(model, rank, world_size, shard_block=shard_block)
    cache = shard_cache(model.config, world_size, B, T + max_new_tokens)
    return extend(idx, max_new_tokens, lambda tokens, new: cached_forward(shard, new, cache)[:, -1], greedy_choice)



# ---------------------------------------------------------------------------------------------------- the contrast

class _ReceiveActivations(nn.Module):
    """A pipeline stage's embedding: the activations (B, T, width) that stage `source` sends, received for tokens
    idx (B, T) (their values unused: the stage before embedded them)."""

    def __init__(self, source: int, width: int, dtype):
        super().__init__()
        self.source, self.width, self.dtype = source, width, dtype

    def forward(self, idx):
        x = torch.empty(*idx.shape, self.width, dtype=self.dtype)
        dist.recv(x, self.source)
        return x


class _SendActivations(nn.Module):
    """A pipeline stage's head: its last block's output x (B, T, C) sent to stage `destination`, and returned."""

    def __init__(self, destination: int):
        super().__init__()
        self.destination = destination

    def forward(self, x):
        dist.send(x.contiguous(), self.destination)
        return x


class _NoPositions(nn.Module):
    """A later pipeline stage's position embedding: the positions were added by the first stage."""

    def forward(self, positions):
        return 0.0


def pipeline_stage(model: GPT, rank: int, world_size: int) -> GPT:
    """Stage `rank` of a GPT split into world_size pipeline stages (GPipe's, Megatron-LM's pipeline parallelism): a
    new model in eval mode holding blocks rank * L/p .. (rank + 1) * L/p - 1 only, run by ``cached_forward`` like a
    GPT. The first stage embeds the tokens; a later one receives the activations of the stage before in place of its
    embeddings (``dist.recv``); a stage before the last sends its blocks' output to the next (``dist.send``) in place
    of the final LayerNorm and the LM head, which only the last stage applies. One send per stage boundary per forward
    pass, no all-reduce; `model` is left as it was. ValueError unless world_size divides n_layer."""
    check_divides("n_layer", model.config.n_layer, world_size)
    check_rank(rank, world_size)
    blocks, per = model.transformer.h, model.config.n_layer // world_size
    model.transformer.h = nn.ModuleList()  # only this stage's blocks are copied
    try:
        stage = copy.deepcopy(model)
    finally:
        model.transformer.h = blocks
    stage.transformer.h = nn.ModuleList([copy.deepcopy(block) for block in blocks[rank * per:(rank + 1) * per]])
    if rank > 0:
        stage.transformer.wte = _ReceiveActivations(rank - 1, model.config.n_embd, model.transformer.wte.weight.dtype)
        stage.transformer.wpe = _NoPositions()
    if rank < world_size - 1:
        stage.transformer.ln_f, stage.lm_head = nn.Identity(), _SendActivations(rank + 1)
    return stage.eval()


@torch.inference_mode()
def pp_generate(model: GPT, idx, max_new_tokens: int, rank: int, world_size: int):
    """Greedy decoding of a GPT split into world_size pipeline stages (``pipeline_stage``), on rank `rank`; call it on
    every rank: idx (B, T) int64 -> (B, T + max_new_tokens), the same on every rank, ``kv_cache.generate_cached``'s
    tokens (each stage runs its blocks as one process runs them). Each rank caches the keys and values of its own
    layers; the last stage chooses each token and broadcasts it to the others, the first stage's next input."""
    B, T = idx.shape
    stage, last = pipeline_stage(model, rank, world_size), world_size - 1
    c = model.config
    cache = StaticKVCache(len(stage.transformer.h), B, c.n_head, c.n_embd // c.n_head, T + max_new_tokens,
                          dtype=model.transformer.wte.weight.dtype)

    def next_token(tokens, new):
        out = cached_forward(stage, new, cache)[:, -1]  # the last stage: logits (B, V); the others: what they sent
        token = greedy_choice(out) if rank == last else torch.empty(B, 1, dtype=torch.int64)
        dist.broadcast(token, src=last)
        return token

    return extend(idx, max_new_tokens, next_token, lambda token: token)


def main(argv: list[str] | None = None) -> None:
    """Greedy decoding of the shipped ``char-gpt`` tensor-parallel across the processes ``torchrun`` starts, on one
    machine or several: ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port PORT
    -m course_lib.tensor_parallel --prompt "ROMEO:" --new-tokens 40`` on each machine (R = 0 and 1, HOST the address of
    node 0). torchrun sets RANK and WORLD_SIZE and the rendezvous address; every rank decodes, rank 0 prints
    {"world_size", "tokens", "text"} as one JSON line. The same ``tp_generate`` as the notebook's, under ``torchrun``
    instead of ``launch``."""
    import argparse
    import json

    from . import assets

    parser = argparse.ArgumentParser(prog="python -m course_lib.tensor_parallel", description=main.__doc__.split("\n")[0])
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    check_positive("new_tokens", args.new_tokens)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))  # env://: torchrun's rendezvous
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model, tokenizer = assets.load("char-gpt"), assets.tokenizer("char-gpt")
        tokens = tp_generate(model, torch.tensor([tokenizer.encode(args.prompt)]), args.new_tokens, rank, world_size)
        if rank == 0:
            print(json.dumps({"world_size": world_size, "tokens": tokens[0].tolist(),
                              "text": tokenizer.decode(tokens[0].tolist())}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
