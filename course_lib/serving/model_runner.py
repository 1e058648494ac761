"""One forward pass over the scheduled chunks of many sequences (vLLM's ``worker/.../model_runner`` and its
``attention/backends``, nano-vllm's ``engine/model_runner.py``): where each token's key and value go in the pool (the
slot mapping), the pass's layout worked out once, paged attention for the decodes and masked attention for the
prefill chunks.

``slot_mapping`` and ``paged_attention`` are the reference solutions of chapter 12's first two exercises
(``tests/grading/test_solution_drift.py`` keeps them equal to the notebook's).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels
from ..gpt import fused_qkv, gpt_logits
from .block_pool import PagedKVCache


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where the tokens at `positions` live in the pool: flat slots (T,) int64.

    block_table (n,) int64: the blocks of one sequence, in order (block_table[i] holds positions
    i * block_size .. (i + 1) * block_size - 1); positions (T,) int64, each in [0, n * block_size). A slot is an
    index into the pool's token rows, viewed as (num_blocks * block_size, ...): block b's rows are
    b * block_size .. (b + 1) * block_size - 1. The tests use scattered tables, block_size 1, a block
    larger than the sequence and no positions at all.
    """
    block = block_table[positions // block_size]  # (T,): which block of the pool
    offset = positions % block_size  # (T,): where inside it
    return block * block_size + offset


def paged_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> torch.Tensor:
    """One decode step of attention for B sequences whose keys and values live in a paged pool: (B, H, Dh).

    q (B, H, Dh): the query of each sequence's newest token; key_pool, value_pool (N, S, H, Dh);
    block_tables (B, M) int64: row b lists sequence b's blocks in order (entries past its last block
    are padding: any valid block index); context_lens (B,) int64: sequence b attends to its positions
    0 .. context_lens[b] - 1 (its newest token's key included), read through its block table. Slots
    past context_lens[b] (the rest of a partly filled block, and padding blocks) are never attended to.
    Scaled by 1 / sqrt(Dh). Returns the same dtype as q.
    """
    B, H, Dh = q.shape
    M, S = block_tables.shape[1], key_pool.shape[1]
    blocks = block_tables.reshape(-1)  # (B * M,): every sequence's blocks, in order
    keys = key_pool.index_select(0, blocks).view(B, M * S, H, Dh)  # row b: its positions 0 .. M * S - 1
    values = value_pool.index_select(0, blocks).view(B, M * S, H, Dh)
    valid = torch.arange(M * S, device=q.device)[None, :] < context_lens[:, None]  # (B, M * S)
    return F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=valid[:, None, None, :])[:, :, 0]  # (B, H, Dh)

@dataclass
class _Layout:
    """Where every token of a forward pass over many chunks goes, worked out once per pass (not per layer).

    Shapes: n chunks, N tokens in all; B_d chunks of one token (decodes), M_d the longest block table among
    them; P longer chunks (prefill), T_p the longest of them, K_p the most keys one of them reads (its start +
    its length). The prefill fields are None when every chunk is one token (a decode-only step)."""

    ids: torch.Tensor  # (N,) int64: the tokens, chunk after chunk
    positions: torch.Tensor  # (N,) int64: their positions in their sequences
    slots: torch.Tensor  # (N,) int64: the pool slot each new key and value goes into
    last: torch.Tensor  # (n,) int64: the row of each chunk's last token
    decode_rows: torch.Tensor  # (B_d,) int64: the rows of the one-token chunks
    decode_tables: torch.Tensor  # (B_d, M_d) int64: their block tables, padded with valid blocks (the next tables')
    decode_lens: torch.Tensor  # (B_d,) int64: the tokens each attends to (its start + 1)
    prefill_rows: torch.Tensor | None = None  # (P, T_p) int64: the rows of each longer chunk's queries (padding: its last)
    prefill_real: torch.Tensor | None = None  # (P, T_p) bool: a query of the chunk (not padding)
    prefill_slots: torch.Tensor | None = None  # (P, K_p) int64: its keys' slots, positions 0 .. start + length - 1, padding
    prefill_allowed: torch.Tensor | None = None  # (P, 1, T_p, K_p) bool: query i of a chunk at start s sees 0 .. s + i


def _int64(values) -> torch.Tensor:
    """Integers (a NumPy array or a list) as an int64 tensor: through NumPy, several times cheaper than ``torch.tensor``
    on a list, which matters in a step whose tensors are small."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def _joined(rows) -> np.ndarray:
    """Lists of ints or 1-D int64 tensors, end to end: one int64 array (lists of ints in one pass, no array per row)."""
    if all(type(row) is list for row in rows):  # the engine's chunks
        return np.fromiter(itertools.chain.from_iterable(rows), np.int64)
    return np.concatenate([np.asarray(row, dtype=np.int64) for row in rows])


def _layout(chunks: list, S: int, slot_mapping=slot_mapping) -> _Layout:
    """The `_Layout` of a forward pass over `chunks` ((block_table, start, tokens), as ``paged_forward`` takes them).

    The block tables laid end to end are one long table, in which position p of a chunk whose table begins at
    block o is position o * S + p: so one call of slot_mapping gives the slots of every new token, and one more those
    of every prefill chunk's keys, whatever the number of chunks; the decodes' tables, padded, are one gather from
    it. The index arithmetic is vectorised in NumPy (as vLLM prepares its inputs): a fixed number of operations
    per pass, none per sequence."""
    tables, starts, tokens = zip(*chunks)
    long_table = _joined(tables)  # every block table, end to end
    table = torch.from_numpy(long_table)
    starts = np.array(starts, dtype=np.int64)
    lengths = np.fromiter(map(len, tokens), np.int64, len(chunks))
    widths = np.fromiter(map(len, tables), np.int64, len(chunks))
    offsets = widths.cumsum() - widths  # where each chunk's table begins in the long one, in blocks
    ends = lengths.cumsum()  # one past each chunk's last row
    first = ends - lengths  # each chunk's first row
    chunk = np.repeat(np.arange(len(chunks)), lengths)  # (N,): the chunk of each token
    positions = starts[chunk] + np.arange(ends[-1]) - first[chunk]
    decode = np.flatnonzero(lengths == 1)
    M_d = int(widths[decode].max(initial=0))
    gather = np.minimum(offsets[decode, None] + np.arange(M_d), len(table) - 1)  # (B_d, M_d); padding: the next tables'
    layout = _Layout(ids=torch.from_numpy(_joined(tokens)), positions=_int64(positions),
                     slots=slot_mapping(table, _int64(offsets[chunk] * S + positions), S), last=_int64(ends - 1),
                     decode_rows=_int64(first[decode]), decode_tables=_int64(long_table[gather]),
                     decode_lens=_int64(starts[decode] + 1))
    prefill = np.flatnonzero(lengths > 1) if len(decode) < len(chunks) else ()
    if len(prefill):
        t, k = np.arange(lengths[prefill].max()), np.arange((starts + lengths)[prefill].max())
        start, length = starts[prefill, None], lengths[prefill, None]
        keys = np.minimum(k[None, :], start + length - 1)  # (P, K_p): padding repeats the last key
        layout.prefill_rows = _int64(first[prefill, None] + np.minimum(t[None, :], length - 1))
        layout.prefill_real = torch.from_numpy(t[None, :] < length)
        layout.prefill_slots = slot_mapping(table, _int64(offsets[prefill, None] * S + keys).flatten(), S).view(keys.shape)
        layout.prefill_allowed = torch.from_numpy(k[None, None, :] <= (start + t[None, :])[:, :, None])[:, None]
    return layout


def _prefill_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Attention of every prefill chunk's queries against its cached keys, the chunks padded into one batch: (P, T_p, H, Dh).

    q (N, H, Dh): every token's query; key_pool, value_pool (N_blocks, S, H, Dh). Chunk p's query i (at position
    start + i) attends to its positions 0 .. start + i, gathered through its block table (``layout.prefill_slots``)."""
    H, Dh = q.shape[1:]
    keys = key_pool.view(-1, H, Dh)[layout.prefill_slots].transpose(1, 2)  # (P, H, K_p, Dh)
    values = value_pool.view(-1, H, Dh)[layout.prefill_slots].transpose(1, 2)  # (P, H, K_p, Dh)
    queries = q[layout.prefill_rows].transpose(1, 2)  # (P, H, T_p, Dh)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.prefill_allowed).transpose(1, 2)


@torch.inference_mode()
def paged_forward(model, cache: PagedKVCache, chunks: list, *, paged_attention=paged_attention,
                  slot_mapping=slot_mapping) -> torch.Tensor:
    """Run a course_lib.gpt.GPT over the chunks of several sequences at once; logits of each chunk's last token.

    chunks: list of (block_table (n,) int64, start, tokens (T,) int64), each table and tokens a tensor or a list of
    ints: tokens at positions start..start+T-1, their blocks already allocated. Every token goes through the linear
    layers in one (sum T, C) matrix. In each layer, the new keys and values go to their slots in one copy; attention
    reads each sequence's keys and values through its block table: one ``paged_attention`` for all the
    chunks of one token (decodes), their block tables padded into one tensor, and one masked attention for all the
    longer chunks (prefill), padded into one batch. The slots come from slot_mapping, called twice per pass whatever the
    number of chunks (``_layout``). A pass whose linear work is small runs on one thread (``ONE_THREAD_WORK``); a
    larger one on one thread or the caller's, whichever ``kernels.THREAD_CHOICE`` measures faster now. Returns (len(chunks), V).
    paged_attention and slot_mapping: the functions run for paged attention and the slot mapping (the learner's, say),
    with the contracts of the course's ``paged_attention`` and ``slot_mapping``.
    """
    n = torch.get_num_threads()
    if n == 1:  # nothing to choose
        return _paged_forward(model, cache, chunks, paged_attention, slot_mapping)
    tokens = sum(len(t) for _, _, t in chunks)
    if tokens * 12 * model.config.n_embd ** 2 < kernels.ONE_THREAD_WORK:  # per layer
        with kernels.threads(1):
            return _paged_forward(model, cache, chunks, paged_attention, slot_mapping)
    rows = 1 << (tokens - 1).bit_length()
    shape = (model.config.n_embd, model.config.n_layer)
    probe = partial(model.transformer.h[0], torch.zeros(1, rows, model.config.n_embd))  # one block on the pass's rows
    decided_by = kernels.THREAD_CHOICE.pick(shape, rows, n, probe)
    start = time.perf_counter()
    with kernels.threads(decided_by.threads):
        logits = _paged_forward(model, cache, chunks, paged_attention, slot_mapping)
    kernels.THREAD_CHOICE.record(shape, n, decided_by, rows, tokens, time.perf_counter() - start)
    return logits


def _paged_forward(model, cache: PagedKVCache, chunks: list, paged_attention, slot_mapping) -> torch.Tensor:
    """``paged_forward``'s pass, on the threads it chose: the GPT's one forward pass (``gpt_logits``) over every chunk's
    tokens as one row of N, the attention step reading and writing the pool."""
    layout = _layout(chunks, cache.block_size, slot_mapping)
    N = len(layout.ids)

    def attend(layer, attn, h):  # every chunk's attention in block `layer`, through the block tables: h (N, C)
        qkv = fused_qkv(attn, h)  # (N, 3, H, Dh): queries, keys, values
        q = qkv[:, 0]  # (N, H, Dh)
        cache.slots[layer].index_copy_(1, layout.slots, qkv[:, 1:].transpose(0, 1))  # the new keys, values: their slots
        key_pool, value_pool = cache.layers[layer]  # (N_blocks, S, H, Dh) each
        if layout.prefill_rows is None:  # a decode-only step: every row is a decode, in order
            y = paged_attention(q, key_pool, value_pool, layout.decode_tables, layout.decode_lens)
        else:
            y = torch.empty_like(q)
            if len(layout.decode_rows):
                y[layout.decode_rows] = paged_attention(q[layout.decode_rows], key_pool, value_pool, layout.decode_tables,
                                                  layout.decode_lens)
            chunked = _prefill_attention(q, key_pool, value_pool, layout)  # (P, T_p, H, Dh), padding included
            y[layout.prefill_rows[layout.prefill_real]] = chunked[layout.prefill_real]
        return attn.c_proj(y.reshape(N, -1))

    every = N == len(chunks)  # one token per chunk (a decode-only step): every row is a chunk's last, in order
    return gpt_logits(model, layout.ids, layout.positions, attend, at=None if every else layout.last)  # (len(chunks), V)
