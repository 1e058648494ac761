"""The engine's model on p processes, chapter 16: a tensor-parallel model runner (vLLM's ``executor/``, its
``MultiprocExecutor``), what ``Engine(..., tensor_parallel_size=p)`` runs its passes on.

The scheduler, the block pool's bookkeeping (free list, reference counts, prefix cache) and the sampler stay in the
caller's process; p worker processes, forked by ``tensor_parallel``'s launcher (one thread each, a gloo group on the
loopback address), each hold rank r's share of the model (``tensor_parallel.shard_gpt``: H/p heads of every block,
1/p of its weights) and the keys and values of those H/p heads in a paged pool of the same blocks. Each step the
caller sends every worker the step's input (the chunks with their block tables, and the block copies that parallel
sampling's copy on write asked for), each runs chapter 12's ``paged_forward`` on its shard and its pool (two
all-reduces per layer among the workers), and each answers, rank 0 with the logits. So the caller never takes part
in a collective: it waits for the workers with a time limit, and a worker that raises, crashes or stops answering ends
the group with a ``tensor_parallel.RankError`` naming it, never a hang (vLLM v1 runs its engine core the same way,
broadcasting the scheduler's output to every worker and reading rank 0's). A driver that is itself rank 0 (vLLM's
older driver worker) would save one message per step, but the caller, a notebook's kernel or a server, would then sit
inside gloo's all-reduce, where only gloo's own timeout could get it out, and would become a member of the group.
"""
from __future__ import annotations

import marshal
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import weakref
from functools import partial
from multiprocessing.connection import wait

from .. import tensor_parallel as tp
from .block_pool import PagedKVCache
from .model_runner import paged_forward

#: Seconds a stopped worker gets to leave by itself before it is terminated.
STOP_S = 5.0


class ExecutorError(RuntimeError):
    """The step cannot run on the workers, through no request's fault: they are stopped, or the step's functions
    cannot reach them."""


class BlockBookkeeping(PagedKVCache):
    """The caller's side of a pool whose keys and values live on the ranks: the blocks' free list, reference counts
    and prefix cache, no keys or values (storage (L, 2, N, S, 0, Dh)). ``block_bytes`` is a block of the whole
    model's (every head, summed over the ranks' pools). ``copy_on_write`` keeps its bookkeeping and records the copy
    in ``copies`` ([(source block, fresh block)], in order) for the ranks to make before the next pass."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype):
        super().__init__(config.n_layer, 0, config.n_embd // config.n_head, num_blocks, block_size, dtype=dtype)
        self.full_block_bytes = config.n_layer * 2 * block_size * config.n_embd * self.storage.element_size()
        self.copies: list = []

    @property
    def block_bytes(self) -> int:
        return self.full_block_bytes

    def copy_on_write(self, block: int) -> int:
        fresh = super().copy_on_write(block)
        self.copies.append((block, fresh))
        return fresh


class _Channel:
    """A worker's end of its pipe to the caller, as ``tensor_parallel._worker`` reports through it (``put``): every
    message pickled by the standard pickle (not multiprocessing's, which would move tensors to shared memory)."""

    def __init__(self, connection):
        self.connection = connection

    def put(self, message) -> None:
        self.connection.send_bytes(pickle.dumps(message))


def _codes(functions) -> list:
    """Each function's compiled code as bytes (a ``partial``'s function's; None for a callable without code): what
    tells a worker's copy of a function from the caller's current definition of the same name. Only the function
    itself is compared: a helper it calls, redefined after the fork, is not seen (make a new Engine then)."""
    def code(f):
        while isinstance(f, partial):
            f = f.func
        return marshal.dumps(f.__code__) if hasattr(f, "__code__") else None
    return [code(f) for f in functions]


def _step_functions(message: bytes) -> tuple:
    """A step's message unpickled: (copies, chunks, (paged_attention, slot_mapping), stale), stale {the position of
    each function this worker holds no current copy of: "defined" (pickle found no function of that name at the
    fork) or "redefined" (its code differs from the caller's)}."""
    copies, chunks, pickled, codes = pickle.loads(message)
    functions, stale = [], {}
    for i, data in enumerate(pickled):
        try:
            functions.append(pickle.loads(data))
        except AttributeError:  # pickle finds a function by its module and name: there was none at the fork
            functions.append(None)
            stale[i] = "defined"
            continue
        if _codes([functions[i]]) != [codes[i]]:
            stale[i] = "redefined"
    return copies, chunks, functions, stale


def _stale_message(functions, stale: dict) -> str:
    """What the caller did wrong: each step function (position in `functions`: "defined" or "redefined") named."""
    def name(f):
        while isinstance(f, partial):
            f = f.func
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
    said = "; ".join(f"{('paged_attention', 'slot_mapping')[i]} {name(functions[i])} was {why} after the Engine "
                     f"started its workers" for i, why in sorted(stale.items()))
    return (f"{said}: the workers hold the definitions of that moment (found by name), and a step runs the current "
            "ones or none: make a new Engine")


def _serve(rank: int, world_size: int, model, num_blocks: int, block_size: int, pipes: list) -> None:
    """A worker: rank `rank`'s shard of `model` and its heads' pool; then, for each step the caller sends
    (copies, chunks, paged_attention, slot_mapping), the copies made and ``paged_forward`` run, every rank replying
    (rank, "step", its result: rank 0's logits (len(chunks), V), None from the others), so that a step out of time
    names the ranks that did not answer. A step whose functions it holds no current copy of runs nowhere: it replies
    (rank, "stale", {position: "defined" or "redefined"}) and waits for the next. It leaves on an empty message
    (``close``) or when the caller is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every process: the caller handles it
    for r, (caller_end, worker_end) in enumerate(pipes):  # forked with every end: keep only its own, so that the
        caller_end.close()  # caller's end closing (the caller gone) reaches this worker as the end of its pipe
        if r != rank:
            worker_end.close()
    channel = _Channel(pipes[rank][1])
    shard = tp.shard_gpt(model, rank, world_size)
    c = model.config
    pool = PagedKVCache(c.n_layer, c.n_head // world_size, c.n_embd // c.n_head, num_blocks, block_size,
                        dtype=model.transformer.wte.weight.dtype)
    channel.put((rank, "ready", None))
    while True:
        try:
            message = channel.connection.recv_bytes()
        except EOFError:
            return  # the caller is gone
        if not message:
            return  # close
        copies, chunks, (paged_attention, slot_mapping), stale = _step_functions(message)
        if stale:  # every rank holds the fork's definitions: every rank refuses, before any collective
            channel.put((rank, "stale", stale))
            continue
        for source, fresh in copies:
            pool.copy_block(source, fresh)
        logits = paged_forward(shard, pool, chunks, paged_attention=paged_attention, slot_mapping=slot_mapping)
        channel.put((rank, "step", logits if rank == 0 else None))


def _stop(processes: list, connections: list, folder: str) -> None:
    """Ask every worker to leave, wait STOP_S for them, terminate (then kill) those still there; close the pipes."""
    for connection in connections:
        try:
            connection.send_bytes(b"")
        except OSError:
            pass  # that worker is gone already
    deadline = time.monotonic() + STOP_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=STOP_S)
            if process.is_alive():
                process.kill()
                process.join()
    for connection in connections:
        connection.close()
    shutil.rmtree(folder, ignore_errors=True)


class TensorParallelExecutor:
    """`model` (a course_lib.gpt.GPT) sharded across world_size worker processes, each with its heads' share of a
    paged pool of num_blocks blocks of block_size slots; see the module's docstring.

    ``block_pool()``: a fresh ``BlockBookkeeping`` for the caller. ``forward``: ``paged_forward``'s contract, run on
    the workers. Every collective among the workers waits at most `timeout` seconds
    (``tensor_parallel.TIMEOUT_S`` by default), and the caller waits that long (and GRACE_S for their reports) for
    every worker's answer (at their start, at each step); a worker that fails raises ``tensor_parallel.RankError``
    naming the rank that failed first, or the ranks that did not answer, after which every worker is stopped and the
    executor is closed. ``close()`` stops them (also at garbage collection and at exit; an interrupt while waiting
    closes it too); ``forward`` on stopped workers, or with functions that cannot be pickled or that the workers hold
    no current copy of, raises ``ExecutorError``.
    ValueError unless world_size (an integer >= 1) divides n_head, or for timeout <= 0.
    """

    def __init__(self, model, world_size: int, num_blocks: int, block_size: int, *, timeout: float | None = None,
                 threads: int = 1):
        tp.check_divides("n_head", model.config.n_head, world_size, by="tensor_parallel_size")
        timeout = tp.TIMEOUT_S if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.model, self.world_size, self.timeout = model, world_size, timeout
        self.num_blocks, self.block_size = num_blocks, block_size
        context = multiprocessing.get_context("fork")  # the learner's model and functions reach the workers
        folder = tempfile.mkdtemp(prefix="course-tp-engine-")
        pipes = [context.Pipe() for _ in range(world_size)]
        self.processes = [context.Process(target=tp._worker, daemon=True, args=(
            _serve, rank, world_size, os.path.join(folder, "store"), timeout, threads,
            (model, num_blocks, block_size, pipes), _Channel(pipes[rank][1]))) for rank in range(world_size)]
        self.connections = [caller_end for caller_end, _ in pipes]
        self._stop = weakref.finalize(self, _stop, self.processes, self.connections, folder)
        started = time.monotonic()
        try:
            try:
                for process in self.processes:
                    process.start()
            finally:
                for _, worker_end in pipes:
                    worker_end.close()
            self._wait(("ready",), started)
        except BaseException:  # a start that failed part way, or a worker that did not get ready: stop those started
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    def block_pool(self) -> BlockBookkeeping:
        """A fresh pool's bookkeeping for the caller (the workers' pools need no reset: no block table points into
        them)."""
        config = self.model.config
        return BlockBookkeeping(config, self.num_blocks, self.block_size, self.model.transformer.wte.weight.dtype)

    def forward(self, model, cache: BlockBookkeeping, chunks: list, *, paged_attention, slot_mapping):
        """``paged_forward(model, cache, chunks, ...)`` on the workers: logits (len(chunks), V). `model` is the one
        sharded at the start (the workers hold its shards); the copies `cache` recorded are made first.
        paged_attention and slot_mapping reach the workers by name, as they were when the workers were forked: a
        function defined or redefined since is the caller's error, not a rank's (ExecutorError naming it; the step runs
        on no worker, and the workers are stopped), rather than a run of its old definition."""
        if self.closed:
            raise ExecutorError("the tensor-parallel workers are stopped (closed, or a rank failed): make a new Engine")
        try:
            functions = (paged_attention, slot_mapping)
            message = pickle.dumps((cache.copies, chunks, [pickle.dumps(f) for f in functions], _codes(functions)))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ExecutorError(f"paged_attention and slot_mapping must be functions a module defines to reach the "
                                f"workers (pickled by name; not a lambda or a nested function): {error}") from error
        cache.copies = []
        try:
            sent = time.monotonic()
            for connection in self.connections:
                try:
                    connection.send_bytes(message)
                except OSError:
                    break  # that worker is gone: the wait below names it (its process has ended)
            answers = self._wait(("step", "stale"), sent)
            stale = {i: why for what, payload in answers.values() if what == "stale" for i, why in payload.items()}
            if stale:
                raise ExecutorError(_stale_message(functions, stale))
            return answers[0][1]
        except BaseException:  # a rank failed, or the caller was interrupted: the group is in an unknown state
            for process in self.processes:
                if process.is_alive():
                    process.terminate()  # no step is worth finishing: a worker may be stuck in a collective
            self.close()
            raise

    def _wait(self, statuses: tuple, since: float) -> dict:
        """Wait for every rank's answer, one of `statuses`, to what was sent at `since` (``time.monotonic``); returns
        {rank: (status, payload)}. RankError when a rank reports a failure or crashes: the one that failed first, once
        the others had GRACE_S to report; or when ranks stay silent: those named, if no rank failed before `timeout`
        had passed (a rank inside a collective waits that long for a silent one, then fails because of it)."""
        answers, failed = {}, {}
        watched = {connection: rank for rank, connection in enumerate(self.connections)}
        watched.update({process.sentinel: rank for rank, process in enumerate(self.processes)})
        limit_at = since + self.timeout
        deadline, first_failure = limit_at + tp.GRACE_S, None  # GRACE_S: for the reports of the ranks that waited
        while len(answers) + len(failed) < self.world_size and time.monotonic() < deadline:
            if first_failure is not None and time.monotonic() > first_failure + tp.GRACE_S:
                break  # the other ranks had their time to report why they stopped
            limit = deadline if first_failure is None else min(deadline, first_failure + tp.GRACE_S)
            ready = wait(list(watched), timeout=max(0.0, limit - time.monotonic()))
            for handle in ready:
                rank = watched[handle]
                if handle is self.connections[rank]:
                    try:
                        _, what, payload = pickle.loads(handle.recv_bytes())
                    except EOFError:  # its process is ending: its sentinel says how
                        del watched[handle]
                        continue
                    if what == "error":
                        failed[rank] = payload
                    elif what in statuses:
                        answers[rank] = (what, payload)
                else:  # the process ended; one that failed reported it first, so this is a crash
                    del watched[handle]
                    self.processes[rank].join(timeout=1.0)  # its sentinel closes as it exits, before its exit code is set
                    code = self.processes[rank].exitcode
                    failed.setdefault(rank, (float("-inf"), f"rank {rank} of {self.world_size} died (exit code {code})",
                                             None))
                if failed and first_failure is None:
                    first_failure = time.monotonic()
        silent = sorted(set(range(self.world_size)) - set(answers) - set(failed))
        if silent and all(when >= limit_at for when, _, _ in failed.values()):
            waited = sorted(failed)
            raise tp.RankError(silent[0], (
                f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of {self.world_size} did not "
                f"answer within {self.timeout} s (for {statuses[0]!r})" + (
                    f"; rank{'s' if len(waited) > 1 else ''} {', '.join(map(str, waited))} failed after waiting that "
                    f"long in a collective for {'them' if len(silent) > 1 else 'it'}" if waited else
                    ": a rank stuck outside the collectives holds the others inside them")))
        if failed:
            raise tp.first_failure_error(failed, self.world_size)
        return answers

    def close(self) -> None:
        """Stop the workers (each leaves when asked, or is terminated after STOP_S); again does nothing."""
        self._stop()
