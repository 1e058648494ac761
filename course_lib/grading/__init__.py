"""The course's grader: nbgrader's workflow, with tests run in a closed clean room.

    course.py      the course on disk, nbgrader's settings, release and re-execution
    submission.py  reading a submission against its source, forgiving honest accidents
    runner.py      starting the clean room for one learner and reading its verdicts
    cleanroom.py   the clean room itself (runs in the sandbox): one exercise at a time, each answer by its
                   definitions (``course_lib.answers``, which the notebook's ``yours_from`` runs too)
    sandbox.py     the closed box (bubblewrap): no network, clean environment, hidden folders
    limits.py      time, memory and process caps, and their plain-words errors
    books.py       nbgrader's gradebook, autograded notebooks and feedback
    grading_run.py ``grade`` (a class: the grading run, submissions to gradebook) and ``check`` (a learner's own notebook)
    exchange.py    ``collect_and_grade``: a chapter from nbgrader's exchange on a hub, feedback back
    reports.py     results, the CSVs, the class report and the learner's report
    bench.py       ``course bench grade``: seconds per chapter and learner, students per minute
"""
from .course import (BUSY_LOAD_PER_CORE, CELL_TIMEOUT, CODE_STUB, COURSE_ID, RELEASE_DIR, RUNS_ON, SOURCE_DIR, chapters,
                     configure, configure_course_folder, execute_solutions, is_visible_test, load_per_core,
                     refused_when_busy, release, repo_root, resolve_chapter, run_nbgrader, timed_chapters)
from .grading_run import check, grade
from .exchange import collect_and_grade
from .limits import Limits
from .reports import NotebookResult, TestResult, class_report, format_report, write_csvs
from .submission import exercise_of

__all__ = ["BUSY_LOAD_PER_CORE", "CELL_TIMEOUT", "CODE_STUB", "COURSE_ID", "RELEASE_DIR", "RUNS_ON", "SOURCE_DIR",
           "Limits", "NotebookResult", "TestResult", "chapters", "check", "class_report", "collect_and_grade",
           "configure", "configure_course_folder", "execute_solutions", "exercise_of", "format_report", "grade",
           "is_visible_test", "load_per_core", "refused_when_busy", "release", "repo_root", "resolve_chapter",
           "run_nbgrader", "timed_chapters", "write_csvs"]
