"""The grading sandbox works whatever exists on the machine, and hides what it must.

The fresh-machine case is reproduced, not assumed: Jupyter's runtime folder and HOME point at
folders that do not exist yet, outside /tmp (inside the sandbox /tmp is an empty tmpfs where
bubblewrap can create anything, so a path under /tmp would hide the bug).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from course_lib import grading
from course_lib.grading import sandbox
from course_lib.grading.limits import Confinement, Limits, preexec
from tests.roundtrip import Chapter, write_submissions

needs_bwrap = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@pytest.fixture
def outside_tmp():
    """A fresh folder on a real disk, outside /tmp."""
    folder = Path(tempfile.mkdtemp(prefix="course-sandbox-test-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fresh_machine(outside_tmp, monkeypatch):
    """Environment of a user who has never run Jupyter: HOME and the runtime folder do not exist yet."""
    for name in ("JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR", "XDG_DATA_HOME", "XDG_RUNTIME_DIR", "IPYTHONDIR", "MPLCONFIGDIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(outside_tmp / "home-never-made"))
    runtime = outside_tmp / "never-made" / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    return runtime


def mounts(command: list[str]) -> list[tuple[str, str]]:
    """(option, target) of each mount after the fixed prefix, in bubblewrap's order."""
    args, found, i = command[:command.index("--")], [], 0
    while i < len(args):
        if args[i] in ("--ro-bind", "--bind"):
            found.append((args[i], args[i + 2]))
            i += 3
        elif args[i] == "--tmpfs":
            found.append((args[i], args[i + 1]))
            i += 2
        else:
            i += 1
    return found


def test_a_missing_folder_to_hide_is_created_owner_only(outside_tmp):
    target = outside_tmp / "a" / "b" / "runtime"
    assert sandbox.cover_for(target) == target
    assert target.is_dir() and target.stat().st_mode & 0o777 == 0o700


def test_where_a_folder_cannot_be_created_its_nearest_existing_ancestor_is_hidden(outside_tmp):
    (outside_tmp / "a-file").write_text("not a folder")
    assert sandbox.cover_for(outside_tmp / "a-file" / "runtime") == outside_tmp


def test_deeper_mounts_go_on_top(outside_tmp, monkeypatch):
    # a hidden folder inside another hidden one, and a hidden one inside the (re-bound) course
    course = Path(sandbox.__file__).resolve().parents[2]
    hidden_outer, hidden_in_course = outside_tmp / "runs", course / ".grading-test-never-made"
    hidden_inner = hidden_outer / "student"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(outside_tmp / "runtime"))
    try:
        order = mounts(sandbox.bwrap_command(["true"], hidden=[hidden_inner, hidden_outer, hidden_in_course]))
    finally:
        shutil.rmtree(hidden_in_course, ignore_errors=True)
    position = {target: i for i, (_, target) in enumerate(order)}
    assert ("--tmpfs", str(hidden_outer)) in order and ("--tmpfs", str(hidden_inner)) in order
    assert position[str(hidden_outer)] < position[str(hidden_inner)]
    assert position[str(course)] < position[str(hidden_in_course)]
    assert ("--tmpfs", str(outside_tmp / "runtime")) in order


@needs_bwrap
def test_the_sandbox_starts_where_jupyter_never_ran_and_hides_kernels_started_later(fresh_machine):
    assert not fresh_machine.exists()
    probe = f"import os; print(sorted(os.listdir({str(fresh_machine)!r})))"
    command = sandbox.bwrap_command([sys.executable, "-c", probe])
    # another kernel starts after the sandbox was set up: its connection file must stay invisible
    (fresh_machine / "kernel-1234.json").write_text('{"key": "another kernel secret"}')
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", "another kernel's connection file is visible inside the sandbox"


@needs_bwrap
@pytest.mark.slow
def test_grading_works_on_a_machine_where_jupyter_never_ran(fresh_machine, outside_tmp):
    chapter = Chapter("00-orientation", "orientation")
    submissions = write_submissions(outside_tmp / "submissions", chapter, {"learner": chapter.untouched()})
    assert not fresh_machine.exists() and not Path(outside_tmp / "home-never-made").exists()
    [result] = grading.grade(submissions, outside_tmp / "work", sandboxed=True)
    assert not result.error, result.error


@needs_bwrap
def test_a_loopback_process_group_runs_inside_the_sandbox_under_its_caps():
    """Chapter 16's build exercise is graded with its processes: two, then four ranks joined by gloo on loopback inside the
    sandbox's own network namespace, under the clean room's process and memory caps, sum what they should."""
    probe = ("import torch, torch.distributed as dist\n"
             "from course_lib.tensor_parallel import launch\n"
             "def rank_sum(rank, world_size):\n"
             "    x = torch.tensor([rank + 1.0])\n"
             "    dist.all_reduce(x)\n"
             "    return x.item()\n"
             "print(launch(rank_sum, 2, timeout=30), launch(rank_sum, 4, timeout=30))\n")
    limits = Limits()
    with Confinement(limits, f"course-sandbox-test-{os.getpid()}") as confinement:
        result = subprocess.run(sandbox.bwrap_command([sys.executable, "-c", probe]), capture_output=True, text=True,
                                timeout=120, cwd="/", env=sandbox.clean_environment() | {"PATH": os.environ["PATH"]},
                                preexec_fn=preexec(limits, confinement))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[3.0, 3.0] [10.0, 10.0, 10.0, 10.0]"
