"""What runs of a learner's answer cell: its definitions, nothing else.

The clean room grades an answer by these definitions (``grading/cleanroom.py``), and the notebook's
``yours_from`` runs the same ones of an earlier chapter's notebook (``yours.py``): both read them here, so that
feedback in the notebook does not depend on the grader.
"""
from __future__ import annotations

import ast


def _target_names(target: ast.expr) -> list[str] | None:
    """The names an assignment target binds (``A``, ``A, B``, ``[A, *B]``), or None for any other target."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        parts = [_target_names(t) for t in target.elts]
        return None if None in parts else [name for part in parts for name in part]
    return None


def _calls(node: ast.AST) -> bool:
    """Whether evaluating an expression calls something (a lambda's body runs only when the lambda is called; its
    defaults run now)."""
    if isinstance(node, ast.Lambda):
        return any(_calls(default) for default in [*node.args.defaults, *node.args.kw_defaults] if default is not None)
    return isinstance(node, ast.Call) or any(_calls(child) for child in ast.iter_child_nodes(node))


def _is_constant_line(node: ast.stmt) -> bool:
    """``NAME = value``, ``A, B = value``, ``NAME: type = value``: names bound to a value whose evaluation calls
    nothing."""
    if isinstance(node, ast.Assign):
        return all(_target_names(t) is not None for t in node.targets) and not _calls(node.value)
    return (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
            and not _calls(node.value) and not _calls(node.annotation))


def student_definitions(source: str) -> str:
    """Imports, defs, classes and constant lines (``_is_constant_line``) of a cell; nothing else runs."""
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        return f"raise SyntaxError({str(error)!r})"
    # A forbidden import is kept: grading zeroes the exercise that uses it (``grading.cleanroom.forbidden_use``).
    kept = [node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
            or _is_constant_line(node)]
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
            names |= {name for target in node.targets for name in _target_names(target)}
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names
