"""The closed box a learner's code runs in while it is graded: bubblewrap.

Only the clean room (``cleanroom.py``) runs in it, never the grader. Inside:

* the whole filesystem is read-only, with a private, empty /tmp of bounded size; every
  student's grading folder, the submissions and Jupyter's runtime folder (other kernels'
  connection keys) are hidden behind empty folders;
* no network at all: a network namespace of its own, with nothing but a loopback that
  nobody listens on (the job comes in on stdin, the verdicts go out on stdout);
* its own PID, IPC and UTS namespaces: it cannot see or signal the grader's processes;
* a clean environment: none of the grader's variables (a hub's API token, say), only the
  few the course needs (``ENVIRONMENT``).

Where bubblewrap is not available (``available()`` is False) grading still works, with a
warning that submissions are not isolated from each other or from the network.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: the grader's variables the clean room keeps (float rounding and thread settings); nothing else passes
PASSED_THROUGH = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "LANG", "LC_ALL", "TZ")
#: the environment the clean room sees, besides PASSED_THROUGH
ENVIRONMENT = {"HOME": "/tmp", "TMPDIR": "/tmp", "MPLCONFIGDIR": "/tmp/matplotlib", "MPLBACKEND": "Agg",
               "IPYTHONDIR": "/tmp/ipython", "PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1"}
#: size of the private /tmp
TMP_BYTES = 512 << 20


def clean_environment() -> dict[str, str]:
    """What the clean room's process gets: ENVIRONMENT plus the grader's PASSED_THROUGH variables."""
    return {**ENVIRONMENT, **{name: os.environ[name] for name in PASSED_THROUGH if name in os.environ}}


@functools.cache
def available() -> bool:
    """True when bubblewrap is installed and may create a sandbox here."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return False
    probe = subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--", "true"],
                           capture_output=True)
    return probe.returncode == 0


def _system_paths() -> list[Path]:
    """What any Python process here must be able to read: its interpreter and the course itself."""
    course = Path(__file__).resolve().parents[2]
    return sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), course})


def _runtime_dir() -> Path:
    """Jupyter's runtime folder: the connection files (with their keys) of every kernel started on this machine."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()).resolve()


def cover_for(path: Path) -> Path | None:
    """The folder to cover with an empty tmpfs so that ``path`` is hidden, now and whatever appears there later.

    bubblewrap mounts only on a folder that exists: inside the sandbox the root is read-only, so it
    cannot create one (on a machine where Jupyter never ran, its runtime folder does not exist yet).
    A missing folder is created here, outside the sandbox, owner-only as Jupyter itself creates it;
    where that is not allowed, its nearest existing ancestor folder is covered instead (None if that
    is the root itself: nothing can appear where nobody may write).
    """
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
    except OSError:
        ancestor = next((p for p in path.parents if p.is_dir()), Path("/"))
        return None if ancestor == Path("/") else ancestor


def bwrap_command(command: list[str], hidden: list[Path] = ()) -> list[str]:
    """``command`` inside bubblewrap:

    * the whole filesystem read-only, with a private, empty /tmp (TMP_BYTES at most);
    * the interpreter and the course repository read-only (they may live under /tmp or a hidden folder);
    * the ``hidden`` folders, and Jupyter's runtime folder, replaced by empty ones (every student's
      grading folder, the submissions, other kernels' connection files);
    * no network, and its own PID, IPC and UTS namespaces; the environment is ``clean_environment()``.

    Deeper paths are mounted on top of shallower ones, so a hidden folder inside the course (solutions/)
    comes out hidden. The command runs
    as PID 1 of its own PID namespace (it cannot see or signal other processes).
    """
    args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
            "--die-with-parent", "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-net", "--unshare-uts",
            "--new-session", "--clearenv"]
    for name, value in clean_environment().items():
        args += ["--setenv", name, value]
    covers = {cover_for(p) for p in [_runtime_dir(), *hidden]} - {None}
    mounts = [("--ro-bind", p) for p in _system_paths()] + [("--tmpfs", p) for p in covers]
    # sorted by depth (stable: at equal depth, the order above), so that a mount is never buried by its parent's
    for option, path in sorted(mounts, key=lambda mount: len(mount[1].parts)):
        args += [option, str(path)] if option == "--tmpfs" else [option, str(path), str(path)]
    return [*args, "--", *command]
