"""A class on a hub: nbgrader's exchange in, ``grade`` in the middle, nbgrader's feedback out.

``collect_and_grade`` is what an instructor runs on JupyterHub for one chapter, from their nbgrader
course folder (the folder with their ``nbgrader_config.py``; see docs/hub.md):

1. ``nbgrader collect --update``: each learner's latest submission into ``submitted/``;
2. a check nbgrader only warns about: a submission is graded only if the learner's own Unix account
   made it. The exchange's inbound folder is writable by every learner, so one learner can drop a
   later "submission" in another's name; such forgeries are skipped, with a warning, and the
   learner's latest genuine submission is graded instead;
3. ``grade`` (the clean room, sandboxed, with the CSVs), with the course folder's private parts
   and the exchange hidden from the learners' code too;
4. nbgrader's feedback for each learner into ``feedback/`` and ``nbgrader release_feedback``, so
   that each learner fetches their own from the Assignments tab.
"""
from __future__ import annotations

import os
import pwd
import shutil
from contextlib import chdir
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from .course import repo_root, resolve_chapter, run_nbgrader
from .grading_run import grade
from .limits import Limits
from .reports import NotebookResult


def nbgrader_settings(course_dir: Path) -> dict:
    """nbgrader's configuration as its commands see it from ``course_dir`` (its nbgrader_config.py, then
    Jupyter's config path, e.g. /etc/jupyter/nbgrader_config.py)."""
    from nbgrader.apps.baseapp import NbGrader

    app = NbGrader()
    with chdir(course_dir):
        app.load_config_file()
    return app.config


def filesystem_exchange(config) -> Path | None:
    """The folder of nbgrader's default exchange, or None when another exchange is configured
    (``ExchangeFactory``, e.g. ngshare on Kubernetes: it authenticates learners itself)."""
    from nbgrader.exchange.default.exchange import Exchange

    if any(str(name) and not str(name).startswith("nbgrader.exchange.default.") for name in config.get("ExchangeFactory", {}).values()):
        return None
    return Path(config.get("Exchange", {}).get("root") or Exchange.class_traits()["root"].default_value)


@dataclass(frozen=True)
class Inbound:
    """One submission in the exchange's inbound folder: ``student+chapter+timestamp+random``."""
    path: Path
    student: str
    timestamp: datetime
    owner: str


def inbound_submissions(exchange: Path, course_id: str, chapter: str) -> list[Inbound]:
    """Every submission of ``chapter`` in the exchange, newest first."""
    from nbgrader.utils import parse_utc

    found = []
    for path in (exchange / course_id / "inbound").glob(f"*+{chapter}+*"):
        parts = path.name.split("+")
        try:
            owner = pwd.getpwuid(path.stat().st_uid).pw_name
            found.append(Inbound(path, parts[0], parse_utc(parts[2]), owner))
        except (KeyError, IndexError, ValueError):
            continue
    return sorted(found, key=lambda s: s.timestamp, reverse=True)


def keep_genuine(course_dir: Path, submissions: list[Inbound], chapter: str) -> list[str]:
    """Replace each collected submission that another account made by the learner's latest genuine one
    (or remove it if there is none); returns the warnings."""
    from nbgrader.utils import parse_utc

    warnings = []
    collected = course_dir / "submitted"
    for student in sorted({s.student for s in submissions}):
        folder = collected / student / chapter
        stamp = folder / "timestamp.txt"
        if not stamp.is_file():
            continue
        timestamp = parse_utc(stamp.read_text().strip())
        forged = [s for s in submissions if s.student == student and s.owner != student]
        if not any(s.timestamp == timestamp for s in forged):
            continue
        genuine = [s for s in submissions if s.student == student and s.owner == student]
        shutil.rmtree(folder)
        culprits = ", ".join(sorted({s.owner for s in forged}))
        if genuine:
            shutil.copytree(genuine[0].path, folder)
            warnings.append(f"{student}: a later submission in their name made by {culprits} was ignored; "
                            f"their own submission of {genuine[0].timestamp} is graded")
        else:
            warnings.append(f"{student}: the only submissions in their name were made by {culprits}: not graded")
    return warnings


def release_feedback(course_dir: Path, out: Path, chapter: str, results: list[NotebookResult]) -> int:
    """Put each graded learner's feedback where nbgrader's release_feedback looks, and release it;
    returns how many learners' feedback was released."""
    released = 0
    for student in sorted({r.student for r in results if not r.error}):
        html = out / "runs" / chapter / student / "feedback" / student / chapter
        submitted = course_dir / "submitted" / student / chapter
        target = course_dir / "feedback" / student / chapter
        if not html.is_dir():
            continue
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for page in html.glob("*.html"):
            shutil.copy2(page, target / page.name)
        for name in ("timestamp.txt", "submission_secret.txt"):  # nbgrader names the feedback by the submission's secret
            if (submitted / name).is_file():
                shutil.copy2(submitted / name, target / name)
        released += 1
    if released:
        run_nbgrader(["release_feedback", chapter], cwd=course_dir, log=out / "nbgrader.log")
    return released


def collect_and_grade(chapter_spec: str, course_dir: Path, out: Path | None = None, jobs: int = 1,
                      limits: Limits | None = None, feedback: bool = True) -> tuple[list[NotebookResult], list[str]]:
    """Collect, grade and return feedback for one chapter from nbgrader's exchange (see the module's docstring).

    Returns the results (as ``grade``) and the warnings about forged submissions.
    """
    chapter = resolve_chapter(chapter_spec, repo_root())
    course_dir = Path(course_dir).resolve()
    if not course_dir.is_dir():
        raise ValueError(f"course_dir must be your nbgrader course folder, got {course_dir}")
    out = Path(out or course_dir / "grading" / chapter).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = nbgrader_settings(course_dir)
    course_id = config.get("CourseDirectory", {}).get("course_id")
    if not course_id:
        raise ValueError(f"no course id: {course_dir}/nbgrader_config.py must set c.CourseDirectory.course_id "
                         "(docs/hub/instructor_nbgrader_config.py does)")
    exchange = filesystem_exchange(config)
    if exchange is not None and not (exchange / course_id / "inbound").is_dir():
        raise ValueError(f"no exchange for course {course_id!r} at {exchange}: release the chapter first "
                         f"(nbgrader release_assignment {chapter})")
    run_nbgrader(["collect", chapter, "--update"], cwd=course_dir, log=out / "nbgrader.log")
    warnings = []
    if exchange is not None:  # learners share the inbound folder: only a learner's own submission counts
        warnings = keep_genuine(course_dir, inbound_submissions(exchange, course_id, chapter), chapter)
    submitted = course_dir / "submitted"
    if not submitted.is_dir():
        return [], warnings + [f"no submissions of {chapter} to grade"]
    private = [submitted, course_dir / "feedback", course_dir / "autograded", Path(os.path.expanduser("~/.jupyter")),
               *([exchange] if exchange is not None else [])]
    results = grade(submitted, out, [chapter], jobs=jobs, limits=limits, hide=tuple(private))
    if feedback:
        release_feedback(course_dir, out, chapter, [r for r in results if r.chapter == chapter])
    return results, warnings
