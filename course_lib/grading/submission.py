"""Read a submission the way the course wrote it, forgiving the accidents learners make.

A submission is matched to the chapter's source notebook by grade id and cell id:

* a copied or pasted cell (JupyterLab keeps a cell's nbgrader metadata when it is copied, so the
  copy carries the same grade id) is ignored for grading: the course's own cell is the one whose
  cell id is the release's, or else the first; the copy stays in the notebook as a plain cell;
* a cell whose nbgrader metadata names a grade id the course does not have is ignored for grading;
* the course's own cells keep the course's nbgrader metadata and cell type: points and kinds edited in a
  submission change nothing;
* an answer cell switched to markdown by a stray keystroke is graded as the code it holds;
* any other cell the learner added never runs while grading (only the answers' definitions do);
* a deleted answer cell is put back, empty, where the course had it, so that nbgrader can restore the
  deleted test cells after it (its exercise's tests fail; the others are graded as usual);
* a file with none of the chapter's cells (an nbformat 3 notebook, another course's notebook) is not
  graded: ``NotThisNotebook`` says so in one plain line.

``read_submission`` returns the answers, a note in plain words for each thing it ignored or
repaired ("a copy of masked_softmax-solution was ignored"), and the notebook as nbgrader gets it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field


def nbgrader_meta(cell: dict) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def source_text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def exercise_of(grade_id: str) -> str:
    """'masked_softmax-mask' -> 'masked_softmax'."""
    return grade_id.split("-", 1)[0]


@dataclass
class Reading:
    """A submission read against its source notebook."""

    answers: dict[str, str | None]  # solution grade id -> the learner's code (None: the cell is gone)
    notebook: dict  # the submission as nbgrader gets it: copies and foreign cells without nbgrader metadata
    notes: list[str] = field(default_factory=list)  # what was ignored or repaired, in plain words


class NotThisNotebook(ValueError):
    """The submitted file is a notebook, but not the chapter's: none of its cells is the course's."""


#: What a deleted answer cell is replaced with, so that nbgrader can put the deleted test cells back after it.
MISSING_ANSWER = "# This answer cell was missing from the submitted notebook: its exercise's tests fail.\n"


def _plain(cell: dict) -> None:
    """Make a cell an ordinary one: nbgrader no longer sees it."""
    cell.get("metadata", {}).pop("nbgrader", None)


def _restore_kind(cell: dict, original: dict, notes: list[str]) -> None:
    """The course's cell keeps the course's nbgrader metadata (points, kind) and cell type, whatever was edited."""
    grade_id = nbgrader_meta(original)["grade_id"]
    cell.setdefault("metadata", {})["nbgrader"] = copy.deepcopy(original["metadata"]["nbgrader"])
    if cell.get("cell_type") != original["cell_type"]:
        what = "graded as the code it holds" if nbgrader_meta(original).get("solution") else "restored"
        notes.append(f"{grade_id} had been switched to {cell.get('cell_type')}: it was {what}")
        cell["cell_type"] = original["cell_type"]
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            cell.pop("attachments", None)
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)


def _put_back(cells: list[dict], original: dict, previous: list[str], placed: dict[str, dict]) -> None:
    """Insert an empty copy of the answer cell ``original`` after the nearest of the ``previous`` course cells placed."""
    cell = copy.deepcopy(original)
    cell["source"] = MISSING_ANSWER
    _plain_outputs(cell)
    anchor = next((placed[g] for g in reversed(previous) if g in placed), None)
    position = next((i + 1 for i, c in enumerate(cells) if c is anchor), 0)
    cells.insert(position, cell)
    placed[nbgrader_meta(original)["grade_id"]] = cell


def _plain_outputs(cell: dict) -> None:
    if cell.get("cell_type") == "code":
        cell["outputs"], cell["execution_count"] = [], None


def read_submission(source: dict, submitted: dict) -> Reading:
    """Match ``submitted`` (a notebook dict) to ``source``; see the module docstring for the rules.

    Raises ``NotThisNotebook`` when the file holds none of the chapter's cells.
    """
    course = {nbgrader_meta(c)["grade_id"]: c for c in source["cells"] if nbgrader_meta(c).get("grade_id")}
    if not isinstance(submitted, dict) or not isinstance(submitted.get("nbformat"), int):
        raise NotThisNotebook("it is not a Jupyter notebook (no nbformat version)")
    if submitted["nbformat"] < 4:
        raise NotThisNotebook(f"it is an nbformat {submitted['nbformat']} notebook, an old format that has none "
                              "of this chapter's cells: open the chapter's notebook from the course and "
                              "copy your answers into it")
    notebook = copy.deepcopy(submitted)
    cells = [c for c in notebook.get("cells", []) if isinstance(c, dict)]
    notes: list[str] = []
    candidates: dict[str, list[dict]] = {}
    for cell in cells:
        if "nbgrader" not in cell.get("metadata", {}):
            continue
        grade_id = nbgrader_meta(cell).get("grade_id")
        if grade_id in course:
            candidates.setdefault(grade_id, []).append(cell)
        else:
            _plain(cell)
            what = f"grade id {grade_id!r}" if grade_id else "no grade id"
            notes.append(f"a cell with nbgrader metadata the course does not have ({what}) was ignored")
    if course and not candidates:
        raise NotThisNotebook("it has none of this chapter's cells: is it another notebook? Submit the "
                              "chapter's own notebook, with your answers in its cells")
    answers: dict[str, str | None] = {}
    placed: dict[str, dict] = {}
    for index, (grade_id, original) in enumerate(course.items()):
        found = candidates.get(grade_id, [])
        kept = next((c for c in found if c.get("id") == original.get("id")), found[0] if found else None)
        for copy_ in found:
            if copy_ is not kept:
                _plain(copy_)
                notes.append(f"a copy of {grade_id} was ignored")
        if kept is not None:
            _restore_kind(kept, original, notes)
            placed[grade_id] = kept
        if not nbgrader_meta(original).get("solution") or original.get("cell_type") != "code":
            continue
        if kept is None:
            answers[grade_id] = None
            _put_back(notebook["cells"], original, list(course)[:index], placed)
            notes.append(f"{grade_id} is missing from the notebook: the tests of its exercise fail")
            continue
        answers[grade_id] = source_text(kept)
    return Reading(answers, notebook, notes)
