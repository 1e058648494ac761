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


def bwrap_command(command: list[str], writable: list[Path] = (), readable: list[Path] = (), hidden: list[Path] = ()) -> list[str]:
    """``command`` inside bubblewrap, layered in this order:

    1. the whole filesystem read-only, with a private, empty /tmp;
    2. the interpreter and the course repository read-only again (they may live under /tmp);
    3. the ``hidden`` folders replaced by empty ones (e.g. every student's grading folder);
    4. the ``readable`` paths (single files or folders) read-only;
    5. the ``writable`` folders writable.

    The command runs as PID 1 of its own PID namespace (it cannot see or signal other
    processes); ``--as-pid-1`` keeps ipykernel from mistaking the namespace's init for a
    dead parent.
    """
    args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--die-with-parent", "--unshare-pid", "--as-pid-1", "--unshare-ipc",
            "--setenv", "HOME", "/tmp", "--setenv", "MPLCONFIGDIR", "/tmp/matplotlib",
            "--setenv", "IPYTHONDIR", "/tmp/ipython", "--setenv", "TMPDIR", "/tmp"]
    for path in _system_paths():
        args += ["--ro-bind", str(path), str(path)]
    for path in hidden:
        args += ["--tmpfs", str(path)]
    for path in readable:
        args += ["--ro-bind", str(path), str(path)]
    for path in writable:
        args += ["--bind", str(path), str(path)]
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
    from jupyter_core.paths import jupyter_runtime_dir

    kernel = [sys.executable, "-m", "ipykernel_launcher", *argv]
    # other kernels' connection files (with their keys) live in the runtime folder: hide them,
    # and every grading folder the grader names (other students' work, the gradebooks)
    command = bwrap_command(kernel, writable=[Path.cwd()], readable=[connection_file],
                            hidden=[Path(jupyter_runtime_dir()).resolve(), *hidden_from_environment()])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
