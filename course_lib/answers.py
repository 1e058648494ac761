"""What runs of a learner's answer cell: its definitions, nothing else.

The clean room grades an answer by these definitions (``grading/cleanroom.py``), and the notebook's
``yours_from`` runs the same ones of an earlier chapter's notebook (``yours.py``): both read them here, so that
feedback in the notebook does not depend on the grader.
"""
from __future__ import annotations

import ast


def student_definitions(source: str) -> str:
    """Imports, defs, classes and ``NAME = constant-expression`` lines of a cell; nothing else runs."""
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        return f"raise SyntaxError({str(error)!r})"
    # A forbidden import is kept: grading zeroes the exercise that uses it (``grading.cleanroom.forbidden_use``).
    kept = [node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
            or isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets)
            and not any(isinstance(n, ast.Call) for n in ast.walk(node.value))]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def import_statements(source: str) -> str:
    """The imports at top level of a cell (of ``student_definitions(source)``), nothing else."""
    tree = ast.parse(student_definitions(source))
    return ast.unparse(ast.Module(body=[node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))],
                                  type_ignores=[]))


def defined_names(source: str) -> set[str]:
    """The names a cell's definitions bind at top level (of ``student_definitions(source)``): functions, classes,
    ``NAME = ...`` targets and imports (``import a.b`` binds ``a``)."""
    names: set[str] = set()
    for node in ast.parse(student_definitions(source)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names
