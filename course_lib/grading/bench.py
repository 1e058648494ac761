"""``course bench grade``: how fast grading is, measured (it prints; it asserts nothing).

Every learner is the reference solution of every chapter (the slowest honest learner: every test
runs to the end). Prints the one-off cost of preparing nbgrader's templates, the seconds one learner
costs chapter by chapter and for the whole course, the throughput in students per minute at each
``--jobs``, and the peak memory of one learner's clean room.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from . import books, sandbox
from .course import SOURCE_DIR, chapters, repo_root, resolve_chapter
from .grading_run import grade_students
from .limits import Limits


def _learners(root: Path, folder: Path, names: list[str], count: int) -> Path:
    for i in range(count):
        for chapter in names:
            shutil.copytree(root / SOURCE_DIR / chapter, folder / f"learner{i:03d}" / chapter)
    return folder


def bench_grade(students: int = 4, jobs: tuple[int, ...] = (1, 2), chapter_names: list[str] | None = None,
                sandboxed: bool | None = None) -> dict:
    root = repo_root()
    names = [resolve_chapter(c, root) for c in chapter_names] if chapter_names else chapters(root)
    sandboxed = sandbox.available() if sandboxed is None else sandboxed
    limits = Limits()
    result: dict = {"chapters": names, "sandboxed": sandboxed, "per_chapter": {}, "throughput": {}}
    with tempfile.TemporaryDirectory(prefix="course-bench-grade-") as tmp:
        tmp = Path(tmp)
        submissions = _learners(root, tmp / "submitted", names, max(students, 1))
        workdir = tmp / "work"
        started = time.perf_counter()
        templates = {chapter: books.prepare_template(root, workdir, chapter) for chapter in names}
        result["templates_s"] = time.perf_counter() - started
        options = dict(submissions=submissions, workdir=workdir, root=root, templates=templates, limits=limits,
                       sandboxed=sandboxed, feedback=True, hidden=(workdir / "runs", workdir / "templates", submissions))

        def timed(learners: list[str], chapter_names: list[str], at_once: int = 1) -> float:
            begun = time.perf_counter()
            graded = grade_students(learners, at_once, chapter_names=chapter_names, **options)
            if any(r.error or r.score != r.max_score for r in graded):
                raise RuntimeError(f"the reference did not get full marks: {[(r.chapter, r.error) for r in graded]}")
            return time.perf_counter() - begun

        for chapter in names:
            result["per_chapter"][chapter] = timed(["learner000"], [chapter])
        # a run the loop above made already (one chapter) is not made again, nor this one (one learner, --jobs 1)
        result["course_s"] = result["per_chapter"][names[0]] if len(names) == 1 else timed(["learner000"], names)
        for n in jobs:  # as `course grade --jobs n` runs them (its templates are already made)
            seconds = result["course_s"] if (students, n) == (1, 1) else \
                timed([f"learner{i:03d}" for i in range(students)], names, n)
            result["throughput"][n] = students / seconds * 60
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def format_grade(result: dict) -> str:
    lines = [f"grading benchmark: reference learners, {'sandboxed' if result['sandboxed'] else 'NOT sandboxed'}",
             f"  nbgrader templates for {len(result['chapters'])} chapters: {result['templates_s']:.1f} s "
             "(built once per chapter source, then copied from the cache)",
             "  one learner, one chapter at a time (each pays one clean room's start):"]
    lines += [f"    {chapter:<18} {seconds:5.1f} s" for chapter, seconds in result["per_chapter"].items()]
    lines.append(f"  one learner, these {len(result['chapters'])} chapters at once (one clean room): {result['course_s']:.1f} s")
    for n, rate in result["throughput"].items():
        lines.append(f"  --jobs {n}: {rate:.1f} students per minute ({len(result['chapters'])} chapters each)")
    lines.append(f"  peak memory of one process (a clean room or a grading worker): {result['peak_rss_mib']:.0f} MiB (RSS); "
                 "a job holds one of each")
    rate = max(result["throughput"].values())
    lines.append(f"  a class of 200 at the best rate: {200 / rate:.0f} min")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course bench grade", description="grading speed (prints; asserts nothing)")
    parser.add_argument("--students", type=int, default=4, help="learners graded for the throughput rows (default: %(default)s)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="--jobs values to measure (default: 1 2)")
    parser.add_argument("--chapter", action="append", default=[], help="only this chapter (repeatable)")
    args = parser.parse_args(argv)
    if args.students < 1 or any(n < 1 for n in args.jobs):
        raise SystemExit("course bench grade: --students and --jobs must be >= 1")
    print(format_grade(bench_grade(args.students, tuple(args.jobs), args.chapter or None)))
    return 0
