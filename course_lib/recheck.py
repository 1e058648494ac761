"""Re-run a chapter's tests outside the student's kernel, where monkeypatching gains nothing.

nbgrader runs the tests in the student's own kernel, after the student's code: a solution
cell that sets ``torch.allclose = lambda *a, **k: True`` passes every naive test. This
module runs in a fresh process (sandboxed like the kernel when bubblewrap is available):

1. the source notebook's first code cell (trusted imports and set-up) runs;
2. the identity of every attribute of the modules the tests rely on is recorded (torch,
   torch.Tensor, torch.nn.functional, numpy, math, builtins, course_lib.checks.*, and
   every module the set-up cell bound to a name);
3. only the *definitions* of the student's solution cells are loaded (imports, functions,
   classes, and plain ``NAME = value`` constants; no other top-level statement runs);
4. each graded test cell of the *source* notebook (visible and hidden tests) runs; after
   every call into the student's code and after every test, the recorded attributes are
   compared, so a function that patches a module when called is caught before any
   assertion can use the patch.

It prints one line per test: ``<nonce> {"grade_id": ..., "passed": ..., "message": ...}``;
the nonce is read from stdin before any student code runs. This defeats monkeypatching of
the namespace; it is not a defence against code written to attack this module itself
(for that the sandbox still bounds the damage to the student's own score).
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import json
import math
import subprocess
import sys
import types
from pathlib import Path


def _meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _source(cell: dict) -> str:
    return "".join(cell.get("source", ""))


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


def student_definitions(source: str) -> str:
    """Imports, defs, classes and ``NAME = constant-expression`` lines of a cell; nothing else runs."""
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        return f"raise SyntaxError({str(error)!r})"
    # A forbidden import is kept: grading zeroes the exercise that uses it (``forbidden_use``),
    # and the exercises that merely call it are judged on their own code.
    kept = [node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
            or isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets)
            and not any(isinstance(n, ast.Call) for n in ast.walk(node.value))]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


class Integrity:
    """Remembers the identity of every attribute of some modules and classes; reports changes."""

    def __init__(self, namespaces: list):
        self._namespaces = [(ns, dict(vars(ns))) for ns in namespaces]

    def changes(self) -> list[str]:
        changed = []
        for ns, before in self._namespaces:
            now = vars(ns)
            for key, value in before.items():
                if key not in now or now[key] is not value:
                    changed.append(f"{getattr(ns, '__name__', ns)}.{key}")
        return changed


def _watched(namespace: dict) -> list:
    import numpy
    import torch
    import torch._dynamo  # noqa: F401 - imported lazily by the first optimizer step, it re-binds torch attributes

    import course_lib.checks

    watched = [builtins, math, torch, torch.Tensor, torch._C.TensorBase, torch.nn.functional, torch.testing, numpy]
    watched += [m for name, m in sys.modules.items() if name.startswith("course_lib.checks") and m is not None]
    watched += [v for v in namespace.values() if isinstance(v, types.ModuleType)]
    watched.append(course_lib.checks)
    unique = {id(ns): ns for ns in watched}
    return list(unique.values())


def _guarded(function, integrity: Integrity):
    """Call the student's function, then refuse its result if it changed a watched module."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        changed = integrity.changes()
        if changed:
            raise AssertionError(f"your code replaced {', '.join(changed[:3])}: tests cannot be tricked")
        return result
    return wrapper


def _guard_definitions(namespace: dict, names: list[str], integrity: Integrity) -> None:
    for name in names:
        obj = namespace.get(name)
        if inspect.isfunction(obj):
            namespace[name] = _guarded(obj, integrity)
        elif inspect.isclass(obj):
            for attr, value in list(vars(obj).items()):
                if inspect.isfunction(value):
                    setattr(obj, attr, _guarded(value, integrity))


def _run(source_path: str, submitted_path: str, nonce: str) -> None:
    out = sys.stdout

    def report(grade_id: str, passed: bool, message: str = "") -> None:
        out.write(f"{nonce} {json.dumps({'grade_id': grade_id, 'passed': passed, 'message': message})}\n")
        out.flush()

    source = json.loads(Path(source_path).read_text())
    submitted = json.loads(Path(submitted_path).read_text())
    setup = next(_source(c) for c in source["cells"] if c["cell_type"] == "code" and not _meta(c))
    namespace: dict = {"__name__": "__main__"}
    exec(compile(setup, "<set-up cell>", "exec"), namespace)  # trusted: the course's own cell
    integrity = Integrity(_watched(namespace))
    solution_ids = {_meta(c)["grade_id"] for c in source["cells"] if _meta(c).get("solution")}
    loaded_error = ""
    before = set(namespace)
    for cell in submitted["cells"]:
        if _meta(cell).get("grade_id") in solution_ids and _meta(cell).get("solution"):
            try:
                exec(compile(student_definitions(_source(cell)), f"<{_meta(cell)['grade_id']}>", "exec"), namespace)
            except Exception as error:  # noqa: BLE001 - the tests will report what is missing
                loaded_error = loaded_error or f"{type(error).__name__}: {error}"
    _guard_definitions(namespace, sorted(set(namespace) - before), integrity)
    for cell in source["cells"]:
        meta = _meta(cell)
        if not meta.get("grade"):
            continue
        changed = integrity.changes()
        if changed:
            report(meta["grade_id"], False, f"your code replaced {', '.join(changed[:3])}: tests cannot be tricked")
            continue
        try:
            exec(compile(_source(cell), f"<{meta['grade_id']}>", "exec"), dict(namespace))
        except BaseException as error:  # noqa: BLE001 - a failed test, whatever it raised
            report(meta["grade_id"], False, f"{type(error).__name__}: {error}")
            continue
        changed = integrity.changes()
        report(meta["grade_id"], not changed, f"your code replaced {', '.join(changed[:3])}: tests cannot be tricked" if changed else "")


def recheck(source: Path, submitted: Path, timeout: float, sandboxed: bool, hidden: list[Path] = ()) -> dict[str, tuple[bool, str]]:
    """grade_id -> (passed, message) for every test cell, re-run outside the student's kernel.

    A test with no verdict (the process died or ran out of time) counts as failed.
    """
    import secrets

    from .sandbox import bwrap_command

    nonce = secrets.token_hex(16)
    command = [sys.executable, "-m", "course_lib.recheck", str(Path(source).resolve()), str(Path(submitted).resolve())]
    if sandboxed:
        command = bwrap_command(command, readable=[Path(source).resolve(), Path(submitted).resolve()], hidden=hidden)
    verdicts: dict[str, tuple[bool, str]] = {}
    try:
        proc = subprocess.run(command, input=nonce + "\n", capture_output=True, text=True, timeout=timeout, cwd="/")
        stdout, problem = proc.stdout, f"the re-check process stopped (exit {proc.returncode})"
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        problem = f"the re-check did not finish within {timeout:g} s"
    for line in stdout.splitlines():
        if line.startswith(nonce + " "):
            verdict = json.loads(line[len(nonce) + 1:])
            verdicts.setdefault(verdict["grade_id"], (verdict["passed"], verdict["message"]))
    tests = [_meta(c)["grade_id"] for c in json.loads(Path(source).read_text())["cells"] if _meta(c).get("grade")]
    return {gid: verdicts.get(gid, (False, problem)) for gid in tests}


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2], sys.stdin.readline().strip())
