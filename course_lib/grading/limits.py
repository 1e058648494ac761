"""What one learner's tests may use while they are graded: time, memory, processes, disk.

``Limits`` is set by the instructor (``course grade --timeout/--memory/--processes``) and applied
by the grader to the clean-room process (``cleanroom.py``) before it starts:

* time: each test may run ``timeout`` seconds; the clean room stops it after that;
* memory: ``RLIMIT_AS`` (address space) of ``memory_gib``: an allocation past it fails in the
  learner's code, and the test reports "used more than 4 GiB";
  Where the grader may create cgroups (root, cgroup v1), a memory cgroup also caps the whole
  process tree, so forking many large processes cannot exhaust the machine;
* processes: a ``pids`` cgroup of ``processes`` tasks (threads count) where the grader may create
  one; otherwise ``RLIMIT_NPROC`` for the grader's own user, counted on top of the tasks that user
  already runs. Root without cgroups gets no process cap (``course grade`` warns): the kernel
  exempts root from ``RLIMIT_NPROC``;
* files: ``RLIMIT_FSIZE`` per file, and the sandbox's private /tmp is a tmpfs of bounded size.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
FILE_BYTES = 256 << 20  # largest file the learner's code may write (in its private /tmp)


@dataclass(frozen=True)
class Limits:
    timeout: float = 120.0  # seconds one test may run
    memory_gib: float = 4.0  # address space of the whole clean room
    processes: int = 64  # tasks (processes and threads) of the whole clean room

    def __post_init__(self):
        if not self.timeout >= 1:
            raise ValueError(f"timeout must be at least 1 second, got {self.timeout}")
        if not 1 <= self.memory_gib <= 1024:
            raise ValueError(f"memory must be between 1 and 1024 GiB, got {self.memory_gib}")
        if not 8 <= self.processes <= 100_000:
            raise ValueError(f"processes must be between 8 and 100000, got {self.processes}")

    def as_job(self) -> dict:
        return {"timeout": self.timeout, "memory_gib": self.memory_gib, "processes": self.processes}


class Confinement:
    """The cgroups of one clean room (a context manager): a pids cap and a memory cap on its whole
    process tree, where the grader may create them; otherwise the RLIMIT_NPROC fallback."""

    def __init__(self, limits: Limits, name: str):
        self.limits = limits
        self.folders: dict[str, Path] = {}
        for controller, setting, value in (("pids", "pids.max", str(limits.processes)),
                                           ("memory", "memory.limit_in_bytes", str(int(limits.memory_gib * GIB)))):
            folder = self._make(controller, name, setting, value)
            if folder is not None:
                self.folders[controller] = folder

    @staticmethod
    def _make(controller: str, name: str, setting: str, value: str) -> Path | None:
        """A cgroup (v1) ``/sys/fs/cgroup/<controller>/<name>`` with ``setting`` = ``value``, or None."""
        hierarchy = Path("/sys/fs/cgroup") / controller
        if not (hierarchy / "cgroup.procs").exists() or not os.access(hierarchy, os.W_OK):
            return None
        folder = hierarchy / name
        try:
            folder.mkdir(exist_ok=True)
            (folder / setting).write_text(value)
        except OSError:
            try:
                folder.rmdir()
            except OSError:
                pass
            return None
        return folder

    @property
    def processes_capped(self) -> bool:
        return "pids" in self.folders or os.geteuid() != 0

    def memory_exceeded(self) -> bool:
        """True when the memory cgroup had to refuse memory (its OOM killer may have stopped a process)."""
        folder = self.folders.get("memory")
        try:
            return folder is not None and int((folder / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError):
            return False

    def enter(self) -> None:
        """In the child, before exec: join the cgroups, or cap RLIMIT_NPROC above this user's current tasks."""
        for folder in self.folders.values():
            (folder / "cgroup.procs").write_text(str(os.getpid()))
        if "pids" not in self.folders and os.geteuid() != 0:
            cap = _tasks_of(os.getuid()) + self.limits.processes
            resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))

    def close(self) -> None:
        for folder in self.folders.values():
            for _ in range(50):  # the sandbox's processes are gone a moment after it ends
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tasks_of(uid: int) -> int:
    """Processes and threads that ``uid`` runs now (what RLIMIT_NPROC counts)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def preexec(limits: Limits, confinement: Confinement):
    """The function the clean room's process runs before exec: every cap in place, its own session."""
    def apply() -> None:
        os.setsid()
        memory = int(limits.memory_gib * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        confinement.enter()
    return apply
