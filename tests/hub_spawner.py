"""The test hub's spawner: JupyterHub's LocalProcessSpawner, for a machine whose Python is not readable by users.

CI's Python lives under root's private home (/root is 0700), so a learner's server could not even start
its interpreter. On such a machine each server starts in a mount namespace of its own in which that
private folder is an empty tmpfs holding only what the server needs (the interpreter, the course's
virtual environment): the rest of root's home stays out of reach, nothing on the machine is changed,
and the server is still the hub's direct child, running as its own Unix user (LocalProcessSpawner's
setuid). On a machine where the interpreter is readable (any real hub) nothing is mounted.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner

CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE, MS_MOVE = 0x00020000, 0x1000, 0x4000, 1 << 18, 0x2000


def private_ancestor(path: Path) -> Path | None:
    """The first folder above ``path`` that other users cannot enter, or None."""
    for folder in reversed(path.parents):
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _mount(source, target, fstype, flags, data=None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source and os.fsencode(source), os.fsencode(target), fstype and os.fsencode(fstype), flags,
                  data and os.fsencode(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target}")


def reveal(private: Path, keep: list[Path], stage: Path) -> None:
    """In a new mount namespace: ``private`` becomes an empty tmpfs holding only the ``keep`` folders.
    Runs in the child between fork and exec, as root."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    staged = []
    for i, path in enumerate(keep):
        target = stage / str(i)
        _mount(str(path), str(target), None, MS_BIND | MS_REC)
        staged.append((target, path))
    _mount("tmpfs", str(private), "tmpfs", 0, "mode=0755")
    for target, path in staged:
        path.mkdir(parents=True, exist_ok=True)
        _mount(str(target), str(path), None, MS_MOVE)


class RevealingSpawner(LocalProcessSpawner):
    """LocalProcessSpawner that first makes the interpreter reachable when a private folder hides it."""

    def make_preexec_fn(self, name):
        setuid = super().make_preexec_fn(name)
        keep = [Path(p) for p in os.environ.get("COURSE_HUB_KEEP", "").split(os.pathsep) if p]
        private = private_ancestor(keep[0]) if keep else None
        if private is None:
            return setuid
        keep = [p for p in keep if private in p.parents]
        stage = Path(os.environ["COURSE_HUB_STAGE"])
        for i in range(len(keep)):
            (stage / str(i)).mkdir(parents=True, exist_ok=True)

        def preexec():
            reveal(private, keep, stage)
            setuid()

        return preexec
