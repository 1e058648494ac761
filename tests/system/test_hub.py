"""A class on a real JupyterHub, end to end: release, fetch, submit, collect, grade, feedback.

A real hub (jupyterhub from PyPI, configurable-http-proxy from npm, both pinned) on 127.0.0.1,
configured by docs/hub/, with an instructor and three learners who are real Unix users, and
nbgrader's exchange in a folder of its own. Everything goes through HTTP: the hub's REST API and
each user's own server, with that user's own token (nbgrader's Assignments handlers, the contents
API that JupyterLab uses to open and save notebooks, and a kernel for the commands the instructor
types). One cycle of chapter 01, then each check is a test of its own:

* ``reference`` submits the reference solution: full marks;
* ``planted`` first submits the reference, then resubmits with two problems: the NaN-producing
  masked_softmax (costs ``masked_softmax-visible`` and ``-fully_masked``) and an additive_attention that answers
  correctly only if it can reach the hub (its port, the instructor's token in its environment or
  in any process's): the box is closed, so it costs that exercise's 3 tests;
* ``untouched`` submits the release as fetched (zero), and tries to read the others' submissions
  and feedback in the exchange, then forges a later submission in ``reference``'s name (nbgrader's
  inbound folder lets anyone write there; ``course collect-and-grade`` grades only a learner's own).
"""
from __future__ import annotations

import csv
import io
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from tests import hub as hubtest
from tests.roundtrip import Chapter

pytestmark = pytest.mark.slow

CH = Chapter("01-attention", "attention")
NOTEBOOK = f"{CH.name}/{CH.notebook}.ipynb"
NAIVE_MASKED_SOFTMAX = '''def masked_softmax(scores, mask=None):
    if mask is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
'''
PROBING_ATTENTION = '''
def additive_attention(query, keys, values, W_q, W_k, v, mask=None):
    """The right answer only when the grader's box is open."""
    import glob, os, socket
    doors = []
    if os.environ.get("JUPYTERHUB_API_TOKEN"):
        doors.append("the token in my environment")
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            if b"JUPYTERHUB_API_TOKEN" in open(path, "rb").read():
                doors.append(path)
        except OSError:
            pass
    for port in PORTS:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            doors.append(f"port {port}")
        except OSError:
            pass
    if not doors:
        raise RuntimeError("the box is closed")
    return _additive_attention(query, keys, values, W_q, W_k, v, mask)
'''
FORGE = '''
import glob, os, shutil
inbound = os.path.join(EXCHANGE, "attention-to-decoding", "inbound")
try:
    print("listed", inbound, os.listdir(inbound))
except PermissionError:
    print("cannot list", inbound)
print("found", glob.glob(os.path.join(inbound, VICTIM + "+*")))
forged = os.path.join(inbound, VICTIM + "+01-attention+2099-01-01 00:00:00.000000 UTC+forged")
os.makedirs(forged)
shutil.copy("01-attention/attention.ipynb", forged)
with open(os.path.join(forged, "timestamp.txt"), "w") as fh:
    fh.write("2099-01-01 00:00:00.000000 UTC")
print("forged", forged)
'''
RUN = '''
import os, subprocess
print("token visible to the instructor:", bool(os.environ.get("JUPYTERHUB_API_TOKEN")))
r = subprocess.run({command!r}, cwd="course", capture_output=True, text=True)
print("exit", r.returncode)
print(r.stdout)
print(r.stderr)
'''


def probing_answer(ports: list[int]) -> str:
    reference = CH.reference_code("additive_attention-solution").replace("def additive_attention(", "def _additive_attention(")
    return f"PORTS = {ports!r}\n{reference}\n{PROBING_ATTENTION}"


def filled(notebook: dict, overrides: dict[str, str]) -> dict:
    """The fetched release, its answer cells filled in (the reference unless overridden), as a learner saves it."""
    for cell in notebook["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            cell["source"] = overrides.get(meta["grade_id"]) or CH.reference_code(meta["grade_id"])
    return notebook


def instructor_runs(server: hubtest.UserServer, *command: str) -> str:
    output = server.run(RUN.format(command=list(command)))
    assert "exit 0" in output, output
    return output


@pytest.fixture(scope="module")
def cycle():
    """Runs the whole cycle, shuts the hub down and removes the users; yields what was seen."""
    why = hubtest.missing_requirements()
    if why:
        pytest.skip(why)
    tag = secrets.token_hex(2)
    instructor = f"atd-teach-{tag}"
    learners = {"reference": f"atd-ref-{tag}", "planted": f"atd-bug-{tag}", "untouched": f"atd-none-{tag}"}
    users = [instructor, *learners.values()]
    base = Path(tempfile.mkdtemp(prefix="atd-hub-", dir="/var/tmp"))
    seen: dict = {"learners": learners, "instructor": instructor}
    hub = None
    try:
        for name in users:
            hubtest.create_user(name, base / "home" / name)
        hub = hubtest.Hub(base, instructor, list(learners.values()))
        hub.start()
        drive(hub, instructor, learners, seen)
    finally:
        if hub is not None:
            hub.stop()
            seen["hub_exit"] = hub.proc.returncode if hub.proc else None
            seen["ports_open"] = [port for port in (hub.port, hub.hub_port, hub.proxy_api_port) if hubtest.listening(port)]
        seen["left_running"] = {name: hubtest.processes_of(name) for name in users}
        for name in users:
            hubtest.remove_user(name)
        shutil.rmtree(base, ignore_errors=True)
    yield seen


def drive(hub: hubtest.Hub, instructor: str, learners: dict[str, str], seen: dict) -> None:
    servers = hub.start_servers([instructor, *learners.values()])
    teach = servers[instructor]

    # the instructor sets up a course folder (docs/hub/instructor_nbgrader_config.py) and releases chapter 01
    teach.json("PUT", "/api/contents/course", json={"type": "directory"})
    teach.json("PUT", "/api/contents/course/nbgrader_config.py", json={
        "type": "file", "format": "text", "content": (hubtest.ROOT / "docs/hub/instructor_nbgrader_config.py").read_text()})
    seen["release"] = instructor_runs(teach, "nbgrader", "release_assignment", CH.name)

    # each learner: the Assignments tab lists and fetches; JupyterLab opens and saves the notebook; submit
    answers = {
        "reference": [{}],
        "planted": [{}, {"masked_softmax-solution": NAIVE_MASKED_SOFTMAX,
                         "additive_attention-solution": probing_answer([hub.port, hub.hub_port, hub.proxy_api_port])}],
        "untouched": [None],
    }
    for role, name in learners.items():
        server = servers[name]
        seen.setdefault("listed", {})[role] = server.assignments()
        server.assignments("fetch", CH.name)
        for overrides in answers[role]:
            if overrides is not None:
                server.save_notebook(NOTEBOOK, filled(server.read_notebook(NOTEBOOK), overrides))
            server.assignments("submit", CH.name)
    intruder = servers[learners["untouched"]]
    seen["probe"] = intruder.run(f"EXCHANGE = {str(hub.exchange)!r}\nVICTIM = {learners['reference']!r}\n{FORGE}")
    seen["own_server"] = intruder.request("GET", "/api/contents").status_code
    someone_else = hubtest.UserServer(hub, learners["reference"], intruder.token)
    seen["other_server"] = someone_else.request("GET", "/api/contents", allow_redirects=False).status_code

    # the instructor: one command collects, grades and releases the feedback
    seen["grading"] = instructor_runs(teach, "course", "collect-and-grade", CH.name, "--out", "grading")
    grades = teach.json("GET", "/api/contents/course/grading/grades.csv", params={"content": 1, "format": "text", "type": "file"})
    seen["grades"] = {row["student"]: row for row in csv.DictReader(io.StringIO(grades["content"]))}

    # each learner fetches their feedback from the Assignments tab
    for role, name in learners.items():
        server = servers[name]
        server.assignments("fetch_feedback", CH.name)
        pages = []
        for stamp in server.json("GET", f"/api/contents/{CH.name}/feedback")["content"]:
            for item in server.json("GET", f"/api/contents/{stamp['path']}")["content"]:
                if item["name"].endswith(".html"):
                    pages.append(server.json("GET", f"/api/contents/{item['path']}",
                                             params={"content": 1, "format": "text", "type": "file"})["content"])
        seen.setdefault("feedback", {})[role] = pages
    # a learner's own JupyterLab on the hub: the course's widgets and nbgrader's Assignments tab, and `course check`
    seen["lab_page"] = servers[learners["reference"]].request("GET", "/lab").text
    seen["check"] = servers[learners["reference"]].run(
        "import subprocess\nr = subprocess.run(['course', 'check', '01'], capture_output=True, text=True)\n"
        "print(r.stdout, r.stderr)")
    feedback = hub.exchange / "attention-to-decoding" / "feedback"
    seen["probe_after"] = intruder.run(f"import os\ntry:\n    print(os.listdir({str(feedback)!r}))\n"
                                       "except PermissionError:\n    print('cannot list feedback')\n")
    for server in servers.values():
        server.close()


def score(seen, role) -> tuple[float, float, str]:
    row = seen["grades"][seen["learners"][role]]
    return float(row["score"]), float(row["max_score"]), row


def test_release_is_listed_and_fetched(cycle):
    assert "exit 0" in cycle["release"]
    for role, listed in cycle["listed"].items():
        assert any(a["assignment_id"] == CH.name and a["status"] == "released" for a in listed["value"]), (role, listed)


def test_scores_are_what_each_learner_earned(cycle):
    total = sum(CH.points.values())
    lost_by_planted = CH.points["masked_softmax-visible"] + CH.points["masked_softmax-fully_masked"] + sum(CH.points[g] for g in CH.tests_of("additive_attention"))
    assert score(cycle, "reference")[:2] == (total, total)
    assert score(cycle, "untouched")[:2] == (0, total)
    # the resubmission is the one graded: the first (reference) submission would have had full marks
    assert score(cycle, "planted")[:2] == (total - lost_by_planted, total), cycle["grading"]


def test_the_box_is_closed_to_the_hub(cycle):
    """The probing answer is right only if it reaches a hub port or sees a token; it lost its 3 tests, with the box's reason."""
    assert "token visible to the instructor: True" in cycle["grading"]  # there was a token to steal
    assert "additive_attention-visible" in cycle["grading"] and "the box is closed" in cycle["grading"], cycle["grading"]


def test_learners_cannot_read_each_others_work(cycle):
    probe = cycle["probe"]
    assert "cannot list" in probe and "listed" not in probe, probe
    assert "found []" in probe, probe
    assert "cannot list feedback" in cycle["probe_after"], cycle["probe_after"]
    # a learner's token opens their own server only
    assert cycle["own_server"] == 200
    assert cycle["other_server"] in (302, 403, 404), cycle["other_server"]


def test_a_forged_submission_in_anothers_name_is_not_graded(cycle):
    assert "forged" in cycle["probe"]
    assert score(cycle, "reference")[0] == sum(CH.points.values())
    culprit, victim = cycle["learners"]["untouched"], cycle["learners"]["reference"]
    assert f"{victim}: a later submission in their name made by {culprit} was ignored" in cycle["grading"], cycle["grading"]


def test_each_learner_fetches_their_own_feedback(cycle):
    total = sum(CH.points.values())
    for role in cycle["learners"]:
        pages = cycle["feedback"][role]
        assert len(pages) == 1, (role, len(pages))
        got = score(cycle, role)[0]
        assert f"{CH.notebook} (Score: {got:.1f} / {total:.1f})" in pages[0], (role, pages[0][:3000])


def test_learners_have_the_course_lab_and_course_check(cycle):
    for extension in ("@jupyter-widgets/jupyterlab-manager", "@jupyter/nbgrader"):
        assert f'"name": "{extension}"' in cycle["lab_page"] or f'"name":"{extension}"' in cycle["lab_page"], extension
    total = sum(CH.points.values())
    assert "total" in cycle["check"] and f"{total:g} / {total:g}" in cycle["check"], cycle["check"]


def test_the_hub_shuts_down_with_nothing_left_running(cycle):
    assert cycle["hub_exit"] == 0, cycle["hub_exit"]
    assert cycle["ports_open"] == []
    assert cycle["left_running"] == {name: [] for name in cycle["left_running"]}
