"""Start the clean room for one learner, in its closed box, and read its verdicts.

The grader builds a job (``chapter_job``) for each chapter notebook of the learner: the course's
set-up cell, each solution cell's reference code and the learner's answer, and the test cells
of the *source* notebook (visible and hidden). ``run_cleanroom`` runs every chapter of one
learner in one process (``cleanroom.py``), sandboxed when bubblewrap is available, with the
``Limits`` applied, and returns ``{(chapter, grade_id): Verdict}``. A test with no verdict
(the clean room itself stopped, or ran out of time) fails with the reason.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import sandbox
from .limits import Confinement, Limits, preexec
from .submission import exercise_of, nbgrader_meta, source_text


@dataclass(frozen=True)
class Verdict:
    passed: bool
    message: str = ""  # why the test failed
    error: str = ""  # set when the test could not run normally (time, memory, processes, a dead process)


def setup_cell(source: dict) -> str:
    """The course's set-up cell: the first code cell that is not an nbgrader cell."""
    return next(source_text(c) for c in source["cells"] if c["cell_type"] == "code" and not nbgrader_meta(c))


def chapter_job(chapter: str, source: dict, answers: dict[str, str | None]) -> dict:
    """The clean room's job for one chapter notebook: set-up, solutions (reference and answer), tests by exercise."""
    solutions, exercises = [], {}
    for cell in source["cells"]:
        meta = nbgrader_meta(cell)
        if meta.get("solution") and cell["cell_type"] == "code":
            exercise = exercise_of(meta["grade_id"])
            solutions.append({"grade_id": meta["grade_id"], "exercise": exercise, "reference": source_text(cell),
                              "answer": answers.get(meta["grade_id"])})
            exercises.setdefault(exercise, [])
        elif meta.get("grade"):
            exercises.setdefault(exercise_of(meta["grade_id"]), []).append(
                {"grade_id": meta["grade_id"], "source": source_text(cell)})
    return {"chapter": chapter, "setup": setup_cell(source), "solutions": solutions,
            "exercises": [{"name": name, "tests": tests} for name, tests in exercises.items()]}


def run_cleanroom(jobs: list[dict], limits: Limits, sandboxed: bool, hidden: list[Path] = (),
                  name: str = "course-grading", log: Path | None = None) -> dict[tuple[str, str], Verdict]:
    """Run the chapters ``jobs`` of one learner in one clean room; ``{(chapter, grade_id): Verdict}``."""
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "limits": limits.as_job(), "chapters": jobs}
    command = [sys.executable, "-c", "from course_lib.grading.cleanroom import main; main()"]
    if sandboxed:
        command = sandbox.bwrap_command(command, hidden=list(hidden))
    tests = [(j["chapter"], t["grade_id"]) for j in jobs for e in j["exercises"] for t in e["tests"]]
    # the whole run may take every test's time limit, plus the set-up of each chapter
    budget = limits.timeout * (len(tests) + 1) + 60 * len(jobs)
    verdicts: dict[tuple[str, str], Verdict] = {}
    with Confinement(limits, f"{name}-{os.getpid()}-{secrets.token_hex(4)}") as confinement:
        try:
            proc = subprocess.run(command, input=json.dumps(job), capture_output=True, text=True, timeout=budget,
                                  cwd="/", env=sandbox.clean_environment() | {"PATH": os.environ.get("PATH", "")},
                                  preexec_fn=preexec(limits, confinement))
            stdout, stderr = proc.stdout, proc.stderr
            problem = f"the grading process stopped (exit {proc.returncode})"
        except subprocess.TimeoutExpired as expired:
            stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
            stderr = ""
            problem = f"the grading did not finish within {budget:g} s"
        memory_exceeded = confinement.memory_exceeded()
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ clean room ({'sandboxed' if sandboxed else 'not sandboxed'}): {problem}\n{stderr[-20000:]}\n")
    for line in stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        verdict = json.loads(line[len(nonce) + 1:])
        if "grade_id" in verdict:
            error = verdict["error"]
            if memory_exceeded and "SIGKILL" in error:
                error = f"your code used more than {limits.memory_gib:g} GiB of memory (the grading limit)"
            verdicts.setdefault((verdict["chapter"], verdict["grade_id"]),
                                Verdict(verdict["passed"], error or verdict["message"], error))
    return {test: verdicts.get(test, Verdict(False, problem, problem)) for test in tests}
