"""The clean room: a learner's answers tested in a fresh process, one exercise at a time.

This program runs inside the grading sandbox (``sandbox.py``), never in the grader. It reads a
job (JSON, on stdin) with, for each chapter, the course's set-up cell, every solution cell's
reference code and the learner's answer, and the chapter's test cells; it writes one line
per test on stdout: ``<nonce> {"chapter", "grade_id", "passed", "message", "error"}``.

For each chapter the set-up cell (trusted, the course's own) runs once. Then each exercise
runs in a forked child of its own, in a namespace where

* the *other* exercises are the reference solutions, so one mistake costs one exercise;
* this exercise is only the *definitions* of the learner's answer (imports, functions,
  classes and ``NAME = constant`` lines): no other top-level statement runs;
* the identity of every attribute of the modules the tests use is recorded, and checked
  after each call into the learner's code and after each test, so monkeypatching is caught
  before an assertion can use it; so is a new subclass of torch.Tensor that decides what
  torch's operations do on it (its own ``__torch_function__`` or ``__torch_dispatch__``);
* the tests see the learner's definitions of what the exercise asks for only: a name of
  the learner's own that is also a set-up name or a builtin (``checks``, ``abs``) is, for the
  tests, what the set-up bound; and they run with subclasses' ``__torch_function__`` off.

The parent watches each child: a test that runs past the time limit is stopped, a child that
dies (``os._exit``, a crash) is reported, and the child's own output goes nowhere, so a loop
that prints forever is just a loop. Memory and process caps are set on the sandbox by the
grader (``limits.py``); hitting them is reported in plain words. The learner's code shares a
process with the tests: this defeats monkeypatching, it is not a defence against code written
to attack this module itself (the sandbox bounds what such code can reach to its own score).
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import json
import math
import os
import select
import signal
import sys
import time
import types

from ..answers import defined_names, student_definitions

FORBIDDEN_NAMES = {"course_lib", "importlib", "__import__"}


def forbidden_use(source: str) -> str:
    """The first line of a cell that reaches for the course's reference code, or ''."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    lines = source.splitlines()
    for node in ast.walk(tree):
        hit = (isinstance(node, ast.Import) and any(a.name.split(".")[0] in FORBIDDEN_NAMES for a in node.names)
               or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_NAMES
               or isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES
               or isinstance(node, ast.Constant) and isinstance(node.value, str) and "course_lib" in node.value)
        if hit:
            return lines[node.lineno - 1].strip()
    return ""


#: imported by torch on first use (an optimizer step, importing transformers' models) and then re-binding
#: ``torch.manual_seed``, the one watched attribute it re-binds (``TorchRewrap``); importing it takes 0.9 s
LAZY_IMPORT = "torch._dynamo"
#: what a learner's course imports in several exercises' processes, each time afresh (they end with their exercise):
#: LAZY_IMPORT, and Hugging Face's models (1 s), which the tests of 4 chapters build through ``course_lib.hf`` (the
#: sandbox's environment keeps them off the hub, as ``course_lib.hf`` does); imported once, before the exercises fork
SHARED_IMPORTS = (LAZY_IMPORT, "transformers.modeling_utils")


class TorchRewrap:
    """Recognises torch's own re-binding of ``torch.manual_seed`` when it imports ``LAZY_IMPORT``: a function running
    the code of torch's ``_disable_dynamo`` wrapper, in its module, around the original. What that code and module
    are is read when this is made, before any learner code runs (learner code could replace ``_disable_dynamo``)."""

    def __init__(self):
        from torch import _compile

        self._code = _compile._disable_dynamo(TorchRewrap).__code__  # the wrapper's code, whatever it wraps
        self._globals = vars(_compile)

    def __call__(self, namespace, key: str, old, new) -> bool:
        """Whether ``namespace.key``'s change from ``old`` to ``new`` is torch's own re-binding."""
        import torch

        if namespace is not torch or key != "manual_seed" or getattr(new, "__code__", None) is not self._code:
            return False
        cells = dict(zip(self._code.co_freevars, new.__closure__ or ()))
        return new.__globals__ is self._globals and "fn" in cells and cells["fn"].cell_contents is old


def tensor_subclasses() -> set[type]:
    """Every subclass of torch.Tensor that exists now, however made (a class statement, ``type(...)``)."""
    import torch

    found, todo = set(), [torch.Tensor]
    while todo:
        for sub in type.__subclasses__(todo.pop()):  # type's own: a metaclass cannot hide a class from it
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def overriding_tensor(cls: type) -> bool:
    """Whether a subclass of torch.Tensor decides what torch's operations do on it (``__torch_function__`` or
    ``__torch_dispatch__`` of its own), and is not a module's: torch defines such classes when it imports its own
    modules (fake tensors, say), each reachable as ``module.QualifiedName``; a learner's is defined in a cell."""
    import torch

    overrides = any(getattr(cls, hook, None) is not getattr(torch.Tensor, hook, None) and
                    getattr(cls, hook, None) is not torch._C._disabled_torch_function_impl
                    for hook in ("__torch_function__", "__torch_dispatch__"))
    found = sys.modules.get(cls.__module__) if cls.__module__ != "__main__" else None
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return overrides and found is not cls


class Integrity:
    """Remembers the identity of every attribute of some modules and classes, and which subclasses of torch.Tensor
    exist; reports changes (torch re-binding its own attribute on a lazy import is not one: ``TorchRewrap``) and new
    subclasses that decide what torch's operations do on them (``overriding_tensor``)."""

    def __init__(self, namespaces: list):
        self._namespaces = [(ns, dict(vars(ns))) for ns in namespaces]
        self._rewrapped_by_torch = TorchRewrap()
        self._tensor_subclasses = tensor_subclasses()

    def changes(self) -> list[str]:
        changed = []
        for ns, before in self._namespaces:
            now = vars(ns)
            for key, value in before.items():
                if key not in now or now[key] is not value and not self._rewrapped_by_torch(ns, key, value, now[key]):
                    changed.append(f"{getattr(ns, '__name__', ns)}.{key}")
        changed += [f"what torch's operations do on a tensor (your subclass {cls.__qualname__} of torch.Tensor)"
                    for cls in tensor_subclasses() - self._tensor_subclasses if overriding_tensor(cls)]
        return changed


def tampering(changed: list[str]) -> str:
    return f"your code replaced {', '.join(changed[:3])}: tests cannot be tricked"


def _watched(namespace: dict) -> list:
    import numpy
    import torch

    import course_lib.checks

    watched = [builtins, math, torch, torch.Tensor, torch._C.TensorBase, torch.nn.functional, torch.testing, numpy]
    watched += [m for name, m in sys.modules.items() if name.startswith("course_lib.checks") and m is not None]
    watched += [v for v in namespace.values() if isinstance(v, types.ModuleType)]
    watched.append(course_lib.checks)
    return list({id(ns): ns for ns in watched}.values())


def _guarded(function, integrity: Integrity):
    """Call the learner's function, then refuse its result if it changed a watched module."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        changed = integrity.changes()
        if changed:
            raise AssertionError(tampering(changed))
        return result
    return wrapper


def _guard(namespace: dict, names: set[str], integrity: Integrity) -> None:
    for name in names:
        obj = namespace.get(name)
        if inspect.isfunction(obj):
            namespace[name] = _guarded(obj, integrity)
        elif inspect.isclass(obj):
            for attr, value in list(vars(obj).items()):
                if inspect.isfunction(value):
                    setattr(obj, attr, _guarded(value, integrity))


def limit_hit(error: BaseException, limits: dict) -> str:
    """The plain-words error for an exception that means a grading limit was hit, or ''."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "can't allocate memory" in text or "Cannot allocate memory" in text:
        return f"your code used more than {limits['memory_gib']:g} GiB of memory (the grading limit)"
    if isinstance(error, BlockingIOError) or "Resource temporarily unavailable" in text:
        return f"your code started more than {limits['processes']} processes or threads (the grading limit)"
    return ""


# --- the child: one exercise ------------------------------------------------------------------

_UNBOUND = object()  # a name nothing bound before the learner's cell


def _exercise_namespace(setup: dict, solutions: list[dict], exercise: str) -> tuple[dict, set[str], dict]:
    """The set-up namespace with every solution cell loaded: the reference ones for the other
    exercises, the learner's definitions for ``exercise``. Returns it, the learner's names, and
    ``shadowed``: for each name the learner bound that the exercise does not ask for (its reference
    solution does not define it), what it was before (``_UNBOUND``: nothing, a builtin's name)."""
    namespace = dict(setup)
    learner: set[str] = set()
    asked: set[str] = set()
    before_learner, learners_value = {}, {}
    for solution in solutions:
        if solution["exercise"] != exercise:
            exec(compile(solution["reference"], f"<reference {solution['grade_id']}>", "exec"), namespace)
            continue
        asked |= defined_names(solution["reference"])
        if solution["answer"] is None:
            continue
        before = dict(namespace)
        exec(compile(student_definitions(solution["answer"]), f"<{solution['grade_id']}>", "exec"), namespace)
        bound = {name for name, value in namespace.items() if name not in before or before[name] is not value}
        for name in bound:
            before_learner.setdefault(name, before.get(name, _UNBOUND))
            learners_value[name] = namespace[name]
        learner |= bound
    shadowed = {name: before_learner[name] for name in learner - asked
                if namespace.get(name, _UNBOUND) is learners_value[name]}  # not bound again by a later reference
    return namespace, learner, shadowed


def _tests_namespace(namespace: dict, shadowed: dict) -> dict:
    """What a test cell runs in: the learner's definitions of what the exercise asks for, and every other
    name as the set-up and the references bound it. A learner's own ``checks``, ``torch`` or ``abs`` stays
    theirs (their functions still see it), but the tests never call it."""
    seen = dict(namespace)
    for name, value in shadowed.items():
        if value is _UNBOUND:
            del seen[name]
        else:
            seen[name] = value
    return seen


def _run_exercise(setup: dict, solutions: list[dict], exercise: dict, limits: dict, send) -> None:
    import torch

    from course_lib.checks.core import explain

    integrity = Integrity(_watched(setup))
    try:
        namespace, learner, shadowed = _exercise_namespace(setup, solutions, exercise["name"])
    except BaseException as error:  # noqa: BLE001 - the tests below report what is missing
        namespace, learner = None, set()
        loading = f"{type(error).__name__}: {error}"
    else:
        _guard(namespace, learner, integrity)
        namespace = _tests_namespace(namespace, shadowed)
    for test in exercise["tests"]:
        send({"start": test["grade_id"]})
        verdict = {"grade_id": test["grade_id"], "passed": False, "message": "", "error": ""}
        changed = integrity.changes()
        if namespace is None:
            verdict["message"] = f"your answer could not be loaded: {loading}"
        elif changed:
            verdict["message"] = tampering(changed)
        else:
            try:
                # a tensor subclass's own __torch_function__ does not run here: torch's operations are torch's
                with torch._C.DisableTorchFunctionSubclass():
                    exec(compile(test["source"], f"<{test['grade_id']}>", "exec"), dict(namespace))
            except BaseException as error:  # noqa: BLE001 - a failed test, whatever it raised
                verdict["message"] = explain(error)
                verdict["error"] = limit_hit(error, limits)
            else:
                changed = integrity.changes()
                verdict["passed"] = not changed
                verdict["message"] = tampering(changed) if changed else ""
        send(verdict)


# --- the parent: one child per exercise, watched ------------------------------------------------

def _describe_exit(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        if number == signal.SIGKILL:
            return "the process running your code was killed (signal SIGKILL: often, out of memory)"
        return f"the process running your code died (signal {name})"
    return f"your code ended the process running the tests (exit code {os.WEXITSTATUS(status)})"


def _watch(pid: int, fd: int, exercise: dict, timeout: float):
    """Yield the child's verdicts; stop it if a test runs past ``timeout``; turn its death into error verdicts."""
    expected = [t["grade_id"] for t in exercise["tests"]]
    done: set[str] = set()
    running, deadline, buffer = None, time.monotonic() + timeout, b""
    problem = ""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([pipe], [], [], max(left, 0))
            if not ready:
                problem = f"a test of this exercise did not finish within {timeout:g} s (the grading limit per test)"
                os.kill(pid, signal.SIGKILL)
                break
            chunk = pipe.read(65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:  # not a line the tests wrote: ignored
                    continue
                if not isinstance(message, dict):
                    continue
                if "start" in message:
                    running, deadline = message["start"], time.monotonic() + timeout
                elif message.get("grade_id") in expected and message["grade_id"] not in done:
                    done.add(message["grade_id"])
                    running = None
                    yield message
            if len(done) == len(expected):  # processes it left behind may still hold the pipe open
                break
    _, status = os.waitpid(pid, 0)
    _stop_leftovers(pid)
    if not problem and len(done) < len(expected):
        problem = _describe_exit(status)
    for grade_id in expected:
        if grade_id not in done:
            where = " while this test ran" if grade_id == running else ""
            yield {"grade_id": grade_id, "passed": False, "message": problem + where, "error": problem}


def _stop_leftovers(group: int) -> None:
    """Kill what the exercise's child left running (its process group), and reap it: in the sandbox this
    process is PID 1, orphans become its children, and a zombie still counts against the process cap."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _fork_exercise(setup: dict, solutions: list[dict], exercise: dict, limits: dict, verdicts_fd: int):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the learner's code runs here, with nowhere to print and no way to the verdicts
        os.setpgid(0, 0)
        os.close(read_end)
        os.close(verdicts_fd)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        channel = os.fdopen(write_end, "w")

        def send(message: dict) -> None:
            channel.write(json.dumps(message) + "\n")
            channel.flush()

        try:
            _run_exercise(setup, solutions, exercise, limits, send)
        finally:
            os._exit(0)
    os.close(write_end)
    return pid, read_end


def run(job: dict, out) -> None:
    """Test every chapter of ``job``; write each verdict to ``out`` as soon as it is known."""
    nonce, limits = job["nonce"], job["limits"]

    def report(chapter: str, verdict: dict) -> None:
        out.write(f"{nonce} {json.dumps({'chapter': chapter, **verdict})}\n")
        out.flush()

    if len(job["chapters"]) > 1:
        # a learner's course: some chapters' tests import them (4 of 17 transformers' models, 1 more torch's own code
        # that imports LAZY_IMPORT): once here, not in each of their exercises' processes. One chapter seldom does.
        for name in SHARED_IMPORTS:
            importlib.import_module(name)
    for chapter in job["chapters"]:
        setup: dict = {"__name__": "__main__"}
        exec(compile(chapter["setup"], "<set-up cell>", "exec"), setup)  # trusted: the course's own cell
        _watched(setup)  # its imports happen once here, not in every child
        for exercise in chapter["exercises"]:
            if not exercise["tests"]:
                continue
            pid, fd = _fork_exercise(setup, chapter["solutions"], exercise, limits, out.fileno())
            for verdict in _watch(pid, fd, exercise, limits["timeout"]):
                report(chapter["chapter"], verdict)
    out.write(f"{nonce} {json.dumps({'done': True})}\n")
    out.flush()


def main() -> None:
    job = json.loads(sys.stdin.read())
    # the verdicts go to a private copy of stdout; whatever else prints goes nowhere (stderr is the grader's log)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)
    run(job, out)


if __name__ == "__main__":
    main()
