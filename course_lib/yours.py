"""Your code runs the chapter: the learner's function once it passes its visible check, else the course's.

After an exercise, the chapter's demonstrations call the learner's own function as soon as it passes the
exercise's visible check, and the course's reference until then, saying which in one line:

    masked_softmax = yours(masked_softmax, checks.check_masked_softmax, attention.masked_softmax)
    # using your masked_softmax
    # or: your masked_softmax does not pass its check yet: the course's version runs below

The check runs again, quietly (what it prints is dropped); any exception it raises, a failed check or an
unfinished exercise's NotImplementedError, means "not yet". Grading is not affected: the clean room
grades the answer cells alone.

The one way the course runs the learner's function inside its own machinery: a keyword argument named
after the course function it replaces, whose default is the course's own, in every module and chapter:

    generate(model, idx, 50, do_sample=True, top_k=10, top_k_filter=top_k_filter)   # chapter 06
    generate(model, idx, 50, num_beams=4, beam_search=beam_search)
    mine = dict(top_k_filter=top_k_filter, beam_search=beam_search); generate(..., **mine)
    engine.run(requests, slot_mapping=slot_mapping, paged_attention=paged_attention, schedule_step=schedule_step)

and, for a class, the same keyword given to its constructor
(``GQASelfAttention(..., cached_attention_step=cached_attention_step)``). No {name: function} mapping
is looked up by name anywhere.

Later chapters run the learner's machines of earlier chapters the same way, found in the learner's notebook
of that chapter beside the current one (``yours_from``):

    GPT = yours_from("04-gpt", "GPT", checks.check_gpt, course_lib.gpt.GPT)
    # using your GPT from ../04-gpt/gpt.ipynb
    # or: no ../04-gpt/gpt.ipynb beside this notebook: the course's GPT runs below

The earlier notebook is read, never written; of it runs only its set-up cell (the first code cell), the
definitions in its answer cells (imports, functions, classes, constants: what the clean room grades) and
its lines that choose the learner's function or the course's (``X = yours(...)``), up to the answer that
defines the name. Grading does not depend on it: the clean room runs none of the cells that call it.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import random
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from . import kernels
from .answers import student_definitions

F = TypeVar("F", bound=Callable)


def passes(function: Callable, check: Callable[[Callable], None]) -> bool:
    """Whether ``check(function)`` returns without raising; what the check prints is dropped, and the random
    numbers it draws (building layers, say) are given back, so that the cells after it draw the same ones
    whether the learner's function passed, failed early or is not written yet."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), torch.random.fork_rng():
            check(function)
    except Exception:  # noqa: BLE001 - any failure of the learner's code or of the check means "not yet"
        return False
    return True


def yours(function: F, check: Callable[[Callable], None], reference: F) -> F:
    """``function`` (the learner's) if it passes ``check``, else ``reference``; prints which one runs below."""
    name = getattr(reference, "__name__", None) or getattr(function, "__name__", "function")
    if passes(function, check):
        print(f"using your {name}")
        return function
    print(f"your {name} does not pass its check yet: the course's version runs below")
    return reference


#: a chapter folder's name: two digits, then words of lowercase letters and digits joined by hyphens ("04-gpt")
CHAPTER = re.compile(r"\d\d(-[a-z0-9]+)+")


def notebook_of(chapter: str) -> Path:
    """The learner's notebook of ``chapter``, relative to the working directory: ``../<chapter>/<name>.ipynb``, its
    name the folder's without the number, hyphens as underscores ('05-kv-cache' -> ../05-kv-cache/kv_cache.ipynb).
    The layout of notebooks/, solutions/ and an nbgrader learner's course folder alike; copies are not read."""
    if not isinstance(chapter, str) or not CHAPTER.fullmatch(chapter):
        raise ValueError(f"chapter must be a chapter folder's name such as '04-gpt' (two digits, then lowercase words "
                         f"joined by hyphens), got {chapter!r}")
    return Path("..") / chapter / f"{chapter[3:].replace('-', '_')}.ipynb"


def yours_from(chapter: str, name: str, check: Callable[[Any], None], reference: F) -> F:
    """The learner's ``name`` from their notebook of an earlier ``chapter`` (``notebook_of``) if it passes ``check``,
    else ``reference``; prints which one runs below, and why not theirs. Their notebook absent (the clean room),
    unreadable, outside this course folder, its answer not run (an exception, a syntax error), not written yet or
    failing the check: the course's."""
    path = notebook_of(chapter)
    where = path.as_posix()
    found = _learners(path, name)
    if isinstance(found, str):
        print(f"{found}: the course's {name} runs below")
        return reference
    if passes(found, check):
        print(f"using your {name} from {where}")
        return found
    print(f"your {name} in {where} does not pass its check yet: the course's version runs below")
    return reference


def _learners(path: Path, name: str):
    """The object the learner's notebook at ``path`` binds to ``name`` (its last answer cell defining it), or a
    sentence saying why there is none."""
    where = path.as_posix()
    if not path.is_file():
        return f"no {where} beside this notebook"
    real = path.resolve()
    if real.parent.parent != Path.cwd().resolve().parent:  # a link out of the course folder is not followed
        return f"{where} lies outside this course folder"
    try:
        stamp = real.stat()
        key = (str(real), stamp.st_mtime_ns, stamp.st_size)
        if key not in _RUNS:  # read once, and again once saved since
            for older in [k for k in _RUNS if k[0] == key[0]]:
                del _RUNS[older]
            _RUNS[key] = _EarlierNotebook(json.loads(real.read_text(encoding="utf-8"))["cells"])
        return _RUNS[key].definition(name, where)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{where} cannot be read ({type(error).__name__})"


class _EarlierNotebook:
    """A learner's earlier notebook, run as far as a name asks and no further, in a namespace of its own: its set-up
    cell, then in order the definitions of its answer cells and its ``X = yours(...)`` lines."""

    def __init__(self, cells: list[dict]):
        code = [_source(c) for c in cells if c.get("cell_type") == "code"]
        answers = [c.get("metadata", {}).get("nbgrader", {}).get("solution") is True
                   for c in cells if c.get("cell_type") == "code"]
        self.setup = code[0] if code else ""
        self.steps: list[tuple[str, set[str]]] = []  # (what runs, the names it defines)
        for source, answer in zip(code[1:], answers[1:]):
            if answer:  # as the clean room grades it: its definitions only
                self.steps.append((_definitions(source), _defined(source)))
            elif _chooses(source):
                self.steps.append((source, set()))
        self.namespace: dict | None = None
        self.setup_error = ""
        self.done = 0  # steps run so far
        self.found: dict[str, Any] = {}  # name -> what its latest answer cell bound, right after that cell ran
        self.failed: dict[str, str] = {}  # name -> why its latest answer cell did not run

    def definition(self, name: str, where: str):
        last = max((i for i, (_, names) in enumerate(self.steps) if name in names), default=None)
        if last is None:
            return f"{where} has no answer cell that defines {name}"
        with _quiet_and_reproducible():
            if self.namespace is None:
                self.namespace = {"__name__": "__main__"}
                try:
                    exec(compile(self.setup, f"{where}: set-up cell", "exec"), self.namespace)
                except Exception as error:  # noqa: BLE001 - a failing set-up cell: nothing of the notebook is used
                    why = f"{error.msg}, line {error.lineno}" if isinstance(error, SyntaxError) else str(error)
                    self.setup_error = f"{where}'s set-up cell does not run ({type(error).__name__}: {why})"
            if self.setup_error:
                return self.setup_error
            for source, names in self.steps[self.done:last + 1]:
                try:
                    exec(compile(source, f"{where}: an answer cell", "exec"), self.namespace)
                except Exception as error:  # noqa: BLE001 - a cell that fails: its names are not the learner's
                    for n in names:
                        self.found.pop(n, None)
                        self.failed[n] = f"your {n} in {where} does not run ({type(error).__name__}: {error})"
                else:
                    for n in names:
                        self.failed.pop(n, None)
                        self.found[n] = self.namespace.get(n)
            self.done = max(self.done, last + 1)
        return self.found[name] if name in self.found else self.failed[name]


_RUNS: dict[tuple, _EarlierNotebook] = {}  # the earlier notebooks read, by (path, modification time, size)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _definitions(source: str) -> str:
    """What the clean room grades of an answer cell: its definitions; of a cell that is not valid Python, a line
    that raises a SyntaxError saying what and where in the cell (line 1 is the cell's first)."""
    try:
        ast.parse(source)
    except SyntaxError as error:
        return f"raise SyntaxError({f'{error.msg}, line {error.lineno} of its answer cell'!r})"
    return student_definitions(source)


def _defined(source: str) -> set[str]:
    """The names an answer cell's definitions bind (functions, classes, ``NAME = constant``); of a cell that is not
    valid Python, those its lines seem to bind (its definitions run as a SyntaxError, which then names them)."""
    try:
        ast.parse(source)
    except SyntaxError:
        return {a or b for a, b in re.findall(r"^(?:def|class)\s+(\w+)|^(\w+)\s*=[^=]", source, re.MULTILINE)}
    tree = ast.parse(_definitions(source))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _chooses(source: str) -> bool:
    """Whether a cell only chooses between the learner's functions and the course's: ``X = yours(...)`` lines."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return bool(tree.body) and all(isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                                   and isinstance(node.value.func, ast.Name) and node.value.func.id == "yours"
                                   for node in tree.body)


@contextlib.contextmanager
def _quiet_and_reproducible():
    """What the earlier notebook prints is dropped, and the random states and thread count it sets (its set-up cell
    calls setup_notebook) are given back, so that the cells after a yours_from draw the same numbers either way."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                torch.random.fork_rng(), kernels.threads(torch.get_num_threads()):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
