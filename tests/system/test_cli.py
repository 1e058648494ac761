"""The `course` command as a learner and an instructor use it."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.planted import ACCIDENT_NOTES, accidents
from tests.planted import CH01 as CH

COURSE = [sys.executable, "-m", "course_lib.cli"]


def run(*args, **kwargs):
    return subprocess.run([*COURSE, *args], capture_output=True, text=True, cwd=ROOT, **kwargs)


@pytest.mark.slow
def test_course_check_grades_a_learner_notebook_and_prints_a_report(tmp_path):
    import json

    notebook = tmp_path / "my attempt.ipynb"  # any name: it is graded as the chapter's notebook
    notebook.write_text(json.dumps(accidents()))  # full marks, and the learner is told what was ignored
    before = notebook.read_bytes()
    proc = run("check", "01", "--notebook", str(notebook))
    assert proc.returncode == 0, proc.stderr
    total = sum(CH.points.values())
    assert f"{total:g} / {total:g}" in proc.stdout.splitlines()[-1]
    for exercise in ("masked_softmax", "additive_attention", "attention_decoder", "scaled_dot_product_attention"):
        assert exercise in proc.stdout
    for note in ACCIDENT_NOTES:
        assert f"note: {note}" in proc.stdout
    assert notebook.read_bytes() == before


@pytest.mark.parametrize("args,message", [
    (("check", "42"), "chapter must be one of 00, 01"),
    (("release", "nope"), "chapter must be one of"),
    (("grade", "/no/such/folder"), "submissions must be a folder"),
    (("collect-and-grade", "01", "--course-dir", "/no/such/folder"), "course_dir must be your nbgrader course folder"),
])
def test_bad_arguments_get_a_clear_error(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_console_script_is_installed():
    script = shutil.which("course") or str((ROOT / ".venv" / "bin" / "course"))
    proc = subprocess.run([script, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "check" in proc.stdout and "release" in proc.stdout


def test_collect_and_grade_before_a_release_says_what_to_do(tmp_path):
    """A course folder whose exchange has no course yet: the instructor is told to release first."""
    (tmp_path / "nbgrader_config.py").write_text(
        f"c = get_config()\nc.CourseDirectory.course_id = 'attention-to-decoding'\nc.Exchange.root = {str(tmp_path / 'exchange')!r}\n")
    proc = run("collect-and-grade", "01", "--course-dir", str(tmp_path))
    assert proc.returncode == 2
    assert f"no exchange for course 'attention-to-decoding' at {tmp_path / 'exchange'}" in proc.stderr
    assert "nbgrader release_assignment 01-attention" in proc.stderr


def test_course_check_finds_a_notebook_fetched_on_a_hub(tmp_path):
    """On a hub, nbgrader's Assignments tab fetches into ./<chapter>/: `course check NN` grades that copy."""
    import json

    fetched = tmp_path / CH.name
    fetched.mkdir()
    (fetched / f"{CH.notebook}.ipynb").write_text(json.dumps(CH.solved()))
    proc = subprocess.run([*COURSE, "check", "01"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    total = sum(CH.points.values())
    assert f"{total:g} / {total:g}" in proc.stdout.splitlines()[-1]  # the solved copy, not the untouched notebooks/


def test_course_lab_passes_jupyter_options_through_in_order(monkeypatch):
    """`course lab --no-browser --port=8899` (and the same after `--`) hands those options to jupyter lab as given:
    argparse's REMAINDER alone refused an option first and passed a bare `--` on, which jupyter took for a file."""
    from course_lib import cli

    started = []
    monkeypatch.setattr(cli.os, "execve", lambda path, command, env: started.append(command))
    options = ["--no-browser", "--port", "8899", "--ip=127.0.0.1"]
    for argv in (["lab", *options], ["lab", "--", *options], ["lab", "--instructor", *options]):
        cli.main(argv)
        assert started[-1][-len(options):] == options and "--" not in started[-1], argv
    assert "--ServerApp.jpserver_extensions" not in " ".join(started[-1])  # --instructor still read
    with pytest.raises(SystemExit):
        cli.main(["check", "01", "--no-such-flag"])


def test_course_lab_keeps_the_instructors_tools_out_of_the_learners_lab():
    """`course lab`: nbgrader's formgrader and exchange lists off, their lab plugins disabled (ids the installed
    nbgrader really has), Validate kept; PATH starts with this interpreter's bin/ (which holds `course`), terminals
    are not login shells (a login shell resets PATH). `course lab --instructor`: all of nbgrader, the course's root."""
    import json
    from pathlib import Path

    from course_lib import grading
    from course_lib.cli import INSTRUCTOR_SERVER_EXTENSIONS, lab_command

    environ = {"PATH": "/usr/bin:/bin", "SHELL": "/bin/bash"}
    learner, env = lab_command(environ=environ)
    assert f"--ServerApp.root_dir={ROOT / grading.RELEASE_DIR}" in learner
    assert {f"--ServerApp.jpserver_extensions={name}=False" for name in INSTRUCTOR_SERVER_EXTENSIONS} <= set(learner)
    assert not any("validate_assignment" in arg for arg in learner)
    assert "--ServerApp.terminado_settings=shell_command=['/bin/bash']" in learner
    bin_dir = Path(env["PATH"].split(":")[0])
    assert bin_dir == Path(sys.executable).parent and (bin_dir / "course").exists() and env["PATH"].endswith("/usr/bin:/bin")
    page_config = Path(env["JUPYTER_CONFIG_PATH"].split(":")[0]) / "labconfig" / "page_config.json"
    disabled = json.loads(page_config.read_text())["disabledExtensions"]
    bundle = "".join(p.read_text() for p in (Path(sys.prefix) / "share/jupyter/labextensions/@jupyter/nbgrader/static").glob("*.js"))
    for plugin in ("formgrader", "create-assignment", "assignment-list", "course-list"):
        assert disabled[f"@jupyter/nbgrader:{plugin}"] is True and f'"@jupyter/nbgrader:{plugin}"' in bundle
    assert '"@jupyter/nbgrader:validate-assignment"' not in disabled

    instructor, env = lab_command(instructor=True, environ=environ)
    assert f"--ServerApp.root_dir={ROOT}" in instructor and "JUPYTER_CONFIG_PATH" not in env
    assert not any("jpserver_extensions" in arg for arg in instructor)
