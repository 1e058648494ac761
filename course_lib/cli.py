"""The ``course`` command: lab, check, execute, release, grade, collect-and-grade, report, validate, serve, pretrain,
scaling, bench."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import grading


#: nbgrader's instructor tools, off in the learner's lab: the formgrader (its Generate button rewrites notebooks/ without
#: asking), the exchange's assignment and course lists (no exchange here: "Error fetching courses!"). Validate stays: it
#: runs the open notebook in memory and reports each test, writing nothing. Their lab plugins are disabled in
#: course_lib/jupyter/learner/labconfig/page_config.json (a Jupyter config folder put first on JUPYTER_CONFIG_PATH).
INSTRUCTOR_SERVER_EXTENSIONS = ("nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.assignment_list",
                                "nbgrader.server_extensions.course_list")


def lab_command(instructor: bool = False, extra: tuple[str, ...] = (), environ: dict | None = None,
                root: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``course lab``: JupyterLab on notebooks/ for a learner, on the course's
    root with nbgrader's instructor tools for an instructor (``--instructor``).

    Both: this interpreter's bin/ first on PATH (``course check`` in a terminal; nbgrader runs ``alembic`` by name),
    terminals as interactive shells that keep that PATH (a login shell resets it), no news pop-up and no update check,
    and widget state saved with the notebook (a reopened notebook draws its sliders instead of "model not found");
    these settings are course_lib/jupyter/overrides.json, JupyterLab's app settings folder for this server.
    `extra`: more arguments for jupyter lab; `environ`: the environment to start from (os.environ); `root`: the folder
    the lab shows (notebooks/, or the course's root for an instructor).
    """
    environ = os.environ if environ is None else environ
    course = grading.repo_root()
    root = root or (course if instructor else course / grading.RELEASE_DIR)
    settings = Path(__file__).parent / "jupyter"
    shell = environ.get("SHELL") or shutil.which("bash") or "/bin/sh"
    command = [sys.executable, "-m", "jupyter", "lab",
               f"--ServerApp.root_dir={root}",
               f"--LabApp.app_settings_dir={settings}", "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
               f"--ServerApp.terminado_settings=shell_command={[shell]!r}"]
    env = {**environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), environ.get("PATH", "")])}
    if not instructor:
        command += [f"--ServerApp.jpserver_extensions={name}=False" for name in INSTRUCTOR_SERVER_EXTENSIONS]
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(filter(None, [str(settings / "learner"),
                                                                   environ.get("JUPYTER_CONFIG_PATH")]))
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI machines often run as root
        command.append("--allow-root")
    return command + list(extra), env


def _lab(args) -> int:
    command, env = lab_command(args.instructor, tuple(args.extra))
    os.execve(sys.executable, command, env)


def _check(args) -> int:
    from .grading.grading_run import own_notebooks

    chapter = grading.resolve_chapter(args.chapter)
    for path in [args.notebook] if args.notebook else own_notebooks(chapter, grading.repo_root()):
        print(f"grading a copy of {Path(path).resolve()} (save it first)")
    results = grading.check(args.chapter, args.notebook)
    for result in results:
        print(grading.format_report(result))
    return 0


def _execute(args) -> int:
    names = [grading.resolve_chapter(c) for c in args.chapters] or grading.chapters()
    load, cores = grading.load_per_core()
    busy = load >= grading.BUSY_LOAD_PER_CORE
    print(f"machine load: {load:.2f} per core over the last minute ({cores} cores): "
          + (f"busy (at or above {grading.BUSY_LOAD_PER_CORE})" if busy else "quiet"))
    refused = grading.refused_when_busy(names, load, args.busy_ok)
    if refused:
        print(f"course execute: not re-executing the timed chapters {', '.join(refused)} on a busy machine: their stored "
              "timings would contradict their prose. Wait until the machine is quiet, or pass --busy-ok to store them "
              "anyway (to be re-executed quietly before a release)", file=sys.stderr)
    elif busy and args.busy_ok:
        print("--busy-ok: the timed chapters' stored timings come from a busy machine", file=sys.stderr)
    for path in grading.execute_solutions([name for name in names if name not in refused]):
        print(f"executed {path.relative_to(grading.repo_root())}")
    return 1 if refused else 0


def _release(args) -> int:
    names = [grading.resolve_chapter(c) for c in args.chapters] or None
    for folder in grading.release(names):
        print(f"released {folder.relative_to(grading.repo_root())}")
    return 0


def _grade(args) -> int:
    names = [grading.resolve_chapter(c) for c in args.chapter] or None
    from .grading import Limits, sandbox
    from .grading.limits import Confinement

    limits = Limits(timeout=args.timeout, memory_gib=args.memory, processes=args.processes)
    if not sandbox.available():
        print("warning: bubblewrap (bwrap) is not available: submissions are graded without a sandbox, with network "
              "access, and could write to each other's files. Install it with `apt-get install bubblewrap`.", file=sys.stderr)
    with Confinement(limits, "course-grading-probe") as probe:
        if not probe.processes_capped:
            print("warning: no pids cgroup can be made here and the kernel exempts root from RLIMIT_NPROC: "
                  "the process cap is not enforced", file=sys.stderr)
    results = grading.grade(Path(args.submissions), Path(args.out), names, jobs=args.jobs, limits=limits)
    for result in results:
        print(grading.format_report(result))
    print(f"\nwrote {args.out}/grades.csv, grades_by_exercise.csv, grades_by_test.csv; "
          f"nbgrader's gradebook and feedback for each student in {args.out}/runs/<chapter>/<student>/")
    return 0


def _collect_and_grade(args) -> int:
    from .grading import Limits

    limits = Limits(timeout=args.timeout, memory_gib=args.memory, processes=args.processes)
    results, warnings = grading.collect_and_grade(args.chapter, Path(args.course_dir), args.out and Path(args.out),
                                                  jobs=args.jobs, limits=limits, feedback=not args.no_feedback)
    for result in results:
        print(grading.format_report(result))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"\ngraded {len({r.student for r in results})} learners"
          + ("" if args.no_feedback else "; feedback released (learners: Assignments tab, Fetch Feedback)"))
    return 0


def _report(args) -> int:
    print(grading.class_report(Path(args.workdir)))
    return 0


def _validate(args) -> int:
    """Autograde the reference solutions: each must get full marks."""
    root = grading.repo_root()
    names = [grading.resolve_chapter(c) for c in args.chapters] or grading.chapters(root)
    with tempfile.TemporaryDirectory() as tmp:
        submissions = Path(tmp) / "submitted"
        for name in names:
            (submissions / "reference").mkdir(parents=True, exist_ok=True)
            shutil.copytree(root / grading.SOURCE_DIR / name, submissions / "reference" / name)
        results = grading.grade(submissions, Path(tmp) / "work", names, root=root, feedback=False)  # scores only
    ok = True
    for result in results:
        print(grading.format_report(result))
        ok &= not result.error and result.score == result.max_score
    print("all reference solutions get full marks" if ok else "SOME REFERENCE SOLUTIONS DO NOT GET FULL MARKS")
    return 0 if ok else 1


def _serve(args) -> int:
    import torch

    from .server import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0: one the OS chooses), got {args.port}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    serve(args.model, args.port, num_blocks=args.num_blocks, block_size=args.block_size, token_budget=args.token_budget,
          max_num_seqs=args.max_num_seqs)
    return 0


def _tool(module: str, argv: list[str]) -> int:
    """Hand the rest of the command line to course_lib.<module>.main (it has its own --help)."""
    import importlib

    return importlib.import_module(f"course_lib.{module}").main(argv)


def _limit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=grading.CELL_TIMEOUT, help="seconds one test may run (default: %(default)s)")
    p.add_argument("--memory", type=float, default=grading.Limits.memory_gib, help="GiB of memory one learner's tests may use (default: %(default)s)")
    p.add_argument("--processes", type=int, default=grading.Limits.processes,
                   help="processes and threads one learner's tests may run (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=1, help="students graded at once (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course", description="From Attention to Decoding: course commands.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("lab", help="start JupyterLab on notebooks/ (--instructor: on the course, with nbgrader's formgrader)")
    p.add_argument("--instructor", action="store_true",
                   help="JupyterLab on the course's root with nbgrader's instructor tools (formgrader, Create Assignment): "
                        "the formgrader's Generate rewrites notebooks/")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="extra arguments for jupyter lab, e.g. --no-browser --port=8899 --ip=127.0.0.1")
    p.set_defaults(func=_lab)

    p = sub.add_parser("check", help="grade your own notebook of a chapter against the hidden tests")
    p.add_argument("chapter", help="chapter number or name, e.g. 01")
    p.add_argument("--notebook", type=Path, help="the notebook to grade (default: ./<chapter>/*.ipynb as fetched on a hub, "
                                                         "else notebooks/<chapter>/*.ipynb)")
    p.set_defaults(func=_check)

    p = sub.add_parser("execute", help="re-execute reference notebooks in solutions/ so their stored outputs are current")
    p.add_argument("chapters", nargs="*", help="chapters to execute (default: all)")
    p.add_argument("--busy-ok", action="store_true", help="re-execute the timed chapters (the Makefile's TIMED list) even "
                                                          "when the load per core says the machine is busy")
    p.set_defaults(func=_execute)

    p = sub.add_parser("release", help="regenerate notebooks/ from solutions/ (nbgrader generate_assignment)")
    p.add_argument("chapters", nargs="*", help="chapters to release (default: all)")
    p.set_defaults(func=_release)

    p = sub.add_parser("grade", help="autograde a folder of submissions: <dir>/<student>/<chapter>/*.ipynb")
    p.add_argument("submissions", help="folder of submissions")
    p.add_argument("--out", default=".grading", help="work folder for the gradebook, feedback and CSVs (default: .grading)")
    p.add_argument("--chapter", action="append", default=[], help="grade only this chapter (repeatable)")
    _limit_options(p)
    p.set_defaults(func=_grade)

    p = sub.add_parser("collect-and-grade", help="on a hub: nbgrader collect, grade in the clean room, release feedback")
    p.add_argument("chapter", help="chapter number or name, e.g. 01")
    p.add_argument("--course-dir", default=".", help="your nbgrader course folder, with its nbgrader_config.py (default: .)")
    p.add_argument("--out", help="work folder for the gradebooks, feedback and CSVs (default: <course-dir>/grading/<chapter>)")
    p.add_argument("--no-feedback", action="store_true", help="collect and grade only; release the feedback later")
    _limit_options(p)
    p.set_defaults(func=_collect_and_grade)

    p = sub.add_parser("report", help="class summary of a `course grade` run: mean per exercise, tests failed most")
    p.add_argument("workdir", nargs="?", default=".grading", help="the --out folder of `course grade` (default: .grading)")
    p.set_defaults(func=_report)

    p = sub.add_parser("validate", help="autograde the reference solutions; each must get full marks")
    p.add_argument("chapters", nargs="*", help="chapters to validate (default: all)")
    p.set_defaults(func=_validate)

    p = sub.add_parser("serve", help="chapter 12's engine behind an OpenAI-compatible HTTP server (/v1/completions, "
                                     "streaming) on 127.0.0.1; Ctrl-C stops it, letting running requests finish")
    p.add_argument("--model", default="char-gpt", help="a language model of course_lib.assets with a tokenizer "
                                                        "(char-gpt, bpe-gpt; default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=None, help="blocks in the KV pool (default: 32 full contexts)")
    p.add_argument("--block-size", type=int, default=8, help="tokens per block (default: %(default)s)")
    p.add_argument("--token-budget", type=int, default=64, help="most tokens per engine step (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once (default: no cap)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s: a serving step is many "
                                                          "small operations; see `course bench serve --help`)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("pretrain", help="train the shipped checkpoints in course_lib/assets (deterministic)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _tool("pretrain", a.args))

    p = sub.add_parser("scaling", help="train the scaling family of chapter 10 and write course_lib/assets/scaling-family.json "
                                       "(deterministic)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _tool("scaling", a.args))

    p = sub.add_parser("bench", help="benchmarks: `course bench train`, `course bench decode`, `course bench serve` "
                                     "(against Hugging Face), `course bench serve-http` (`course serve` under Poisson "
                                     "arrivals), `course bench structured` (chapter 15's constraint against xgrammar), "
                                     "`course bench grade` (grading speed)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda a: _tool("bench", a.args))

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("pretrain", "scaling", "bench"):  # their options (and --help) are their own
        return _tool(argv[0], argv[1:])
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "lab":  # everything after `lab` but its own flags goes to jupyter lab, in order
        args.extra = [a for a in argv[1:] if a not in ("--instructor", "--")]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as error:
        print(f"course {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
