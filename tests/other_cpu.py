"""Which cells of a notebook the run as on another CPU (conftest.py, --other-cpu) leaves out: the measurements that
end it. Such a cell has nothing to check there: nbval ignores its output, it asserts nothing, and no later cell reads
what it computed (none runs after it); the run as is still runs it, asserting that it runs (one round of its timings,
conftest.py's TRAILING_TIMING_ENV)."""
from __future__ import annotations

import ast

from nbval.plugin import find_comment_markers, find_metadata_tags

#: the calls that make a cell's printed number a claim (course_lib.claims): they raise when the claim fails
CLAIMS = {"below", "above", "between"}


def asserts_nothing(source: str) -> bool:
    """Whether a cell's code can fail only by crashing: no assert, raise, claim (``below``, ``above``, ``between``,
    called by name or as an attribute), ``checks.`` call, or call of anything named ``assert...`` or ``check...``
    (``torch.testing.assert_close``, ``check_gpt``). A cell that does not parse (IPython syntax) counts as asserting."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.Raise)):
            return False
        if isinstance(node, ast.Call):
            function = node.func
            name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")
            if name in CLAIMS or name.startswith(("assert", "check")):
                return False
            if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) and function.value.id == "checks":
                return False
    return True


def measurement_only(cell) -> bool:
    """A code cell whose output nbval ignores (NBVAL_IGNORE_OUTPUT) and that asserts nothing: a timing, printed."""
    options = {**dict(find_metadata_tags(cell.metadata)), **dict(find_comment_markers(cell.source))}
    return options.get("check", True) is False and asserts_nothing(cell.source)


def trailing_measurements(cells: list) -> list:
    """The measurement-only code cells that end a notebook (nothing runs after them but others of their kind)."""
    trailing = []
    for cell in reversed([c for c in cells if c.cell_type == "code"]):
        if not measurement_only(cell):
            break
        trailing.append(cell)
    return trailing[::-1]
