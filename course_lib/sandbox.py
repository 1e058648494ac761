"""Run a student's kernel in a bubblewrap sandbox while nbgrader grades it.

Only the kernel is sandboxed, not nbgrader: the whole filesystem is read-only except the
folder the notebook runs in (the student's own autograded copy) and a private, empty
/tmp. The gradebook, the other students' files and the course itself cannot be written.

The kernel spec written by ``write_kernel_spec`` starts ``python -m course_lib.sandbox
-f {connection_file}``, which execs ``bwrap ... python -m ipykernel_launcher``.
Where bubblewrap is not available (``available()`` is False) grading still works, with
a warning that submissions are not isolated from each other.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

KERNEL_NAME = "course-sandbox"


@functools.cache
def available() -> bool:
    """True when bubblewrap is installed and may create a sandbox here."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return False
    probe = subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--", "true"],
                           capture_output=True)
    return probe.returncode == 0


#: set by the grader (trusted) for the kernel launcher: folders to hide, os.pathsep-separated
HIDE_ENV = "COURSE_SANDBOX_HIDE"


def _system_paths() -> list[Path]:
    """What any Python process here must be able to read: its interpreter and the course itself."""
    course = Path(__file__).resolve().parents[1]
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


def bwrap_command(command: list[str], writable: list[Path] = (), readable: list[Path] = (), hidden: list[Path] = ()) -> list[str]:
    """``command`` inside bubblewrap:

    * the whole filesystem read-only, with a private, empty /tmp;
    * the interpreter and the course repository read-only (they may live under /tmp or a hidden folder);
    * the ``hidden`` folders, and Jupyter's runtime folder, replaced by empty ones (every student's
      grading folder, other kernels' connection files);
    * the ``readable`` paths (single files or folders) read-only;
    * the ``writable`` folders writable.

    Deeper paths are mounted on top of shallower ones, whatever their kind, so a writable folder
    inside a hidden one, or a hidden one inside the course, come out as listed. The command runs
    as PID 1 of its own PID namespace (it cannot see or signal other processes); ``--as-pid-1``
    keeps ipykernel from mistaking the namespace's init for a dead parent.
    """
    args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--die-with-parent", "--unshare-pid", "--as-pid-1", "--unshare-ipc",
            "--setenv", "HOME", "/tmp", "--setenv", "MPLCONFIGDIR", "/tmp/matplotlib",
            "--setenv", "IPYTHONDIR", "/tmp/ipython", "--setenv", "TMPDIR", "/tmp"]
    covers = {cover_for(p) for p in [_runtime_dir(), *hidden]} - {None}
    mounts = ([("--ro-bind", p) for p in _system_paths()] + [("--tmpfs", p) for p in covers]
              + [("--ro-bind", Path(p)) for p in readable] + [("--bind", Path(p)) for p in writable])
    # sorted by depth (stable: at equal depth, the order above), so that a mount is never buried by its parent's
    for option, path in sorted(mounts, key=lambda mount: len(mount[1].parts)):
        args += [option, str(path)] if option == "--tmpfs" else [option, str(path), str(path)]
    return [*args, "--", *command]


def hidden_from_environment() -> list[Path]:
    return [Path(p) for p in os.environ.get(HIDE_ENV, "").split(os.pathsep) if p]


def write_kernel_spec(jupyter_path: Path) -> Path:
    """Write kernels/course-sandbox/kernel.json under ``jupyter_path`` (put it on JUPYTER_PATH)."""
    folder = jupyter_path / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "course_lib.sandbox", "-f", "{connection_file}"],
            "display_name": "Python 3 (course grading sandbox)", "language": "python",
            "interrupt_mode": "signal", "metadata": {"debugger": False}}
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1))
    return folder


def main(argv: list[str] | None = None) -> None:
    """Kernel launcher: exec ipykernel inside the sandbox, writable only in the current folder."""
    argv = list(sys.argv[1:] if argv is None else argv)
    connection_file = Path(argv[argv.index("-f") + 1]).resolve()
    kernel = [sys.executable, "-m", "ipykernel_launcher", *argv]
    # every grading folder the grader names is hidden (other students' work, the gradebooks)
    command = bwrap_command(kernel, writable=[Path.cwd()], readable=[connection_file], hidden=hidden_from_environment())
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
