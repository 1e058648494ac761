"""The prose check: every number a notebook's markdown states is shown by that notebook.

A number in a markdown cell (any decimal, any number in scientific notation, any count with two or
more significant figures) must appear in the same notebook's code or stored outputs, or be on the
chapter's short list of cited constants (a paper's figure, with its source: ``CITED`` in
``tests/grading/test_prose.py``). "Appears" means some number there rounds to it at the precision the prose
writes it with, read in the prose's unit: ``38.6 M`` is shown by ``38,597,376``, ``61 %`` by ``0.613``
or ``61.3%``, ``2.3`` by ``2.26``.

Only what nbval checks counts as shown: outputs are read after nbval's sanitizer (so a measured value
beside a claim, "2.87, checked: between 2.5 and 3.5", shows the bounds but not the 2.87), and the
outputs of a ``# NBVAL_IGNORE_OUTPUT`` cell (timings) show nothing: a figure that changes from machine to
machine is not a fact the prose can state. The code of every cell counts.

What is not a claim and is skipped: the header's estimate of a learner's time ("**Time:** about 75
minutes", which no cell can show), years (1950-2030, as in "Vaswani et al., 2017"), chapter and
exercise numbers ("chapter 05", a row "| 11 from GPT-2 to Llama |" of a table of chapters), numbers inside words or identifiers (``float32``, ``GPT-2``, ``top_k``),
link targets, and arXiv identifiers.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

#: A number as prose writes it: 104,973 / 0.02 / 1e-5 / 2.26 / 38.6 (a suffix is read separately).
_NUMBER = re.compile(
    r"(?<![\w.\-/^_{])"  # not inside a word, an identifier, a version, a path, an exponent or a LaTeX group
    r"(?P<text>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+)"
    r"(?P<exp>e[-+−]?\d+)?"
    r"(?P<after>\s?(?:%|K\b|k\b|M\b|B\b|G\b|thousand\b|million\b|billion\b|×|x\b))?"
)
_UNITS = {"%": 0.01, "K": 1e3, "k": 1e3, "thousand": 1e3, "M": 1e6, "million": 1e6, "B": 1e9, "G": 1e9,
          "billion": 1e9}
_SKIP = [
    re.compile(r"\]\([^)]*\)"),                      # link targets
    re.compile(r"<[^>]+>"),                          # HTML tags and autolinks
    re.compile(r"arXiv:\s*\d{4}\.\d{4,5}", re.I),
    re.compile(r"\b(?:chapters?|ch\.|exercises?|sections?|steps?)\s+\d+(?:\s*(?:[-–,]|and|to)\s*\d+)*", re.I),
    re.compile(r"\b\d{2}-[a-z]+"),                   # chapter folders: 05-kv-cache
    re.compile(r"^\|\s*\d{2}\s", re.M),               # a chapter number opening a row of a table of chapters
    re.compile(r"\bc\d+\b"),                         # cell references
    re.compile(r"^#\s+\d{2}\s+·", re.M),               # the chapter's number in its title: "# 14 · ..."
    re.compile(r"\*\*Time:\*\*\s*about\s+\d+\s+minutes"),  # the header's estimate of a learner's time
]
#: Numbers anywhere in code or outputs, with thousands separators, exponents and a trailing %.
_ANY_NUMBER = re.compile(r"(?<![\w.])-?(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d*\.\d+|\d+)(e[-+]?\d+)?(%?)")


@dataclass(frozen=True)
class Number:
    text: str        # as written, e.g. "38.6 M"
    value: float     # in the prose's own unit, e.g. 38.6
    scale: float     # what the unit multiplies by, e.g. 1e6
    decimals: int    # digits after the point as written (for exponents: of the mantissa)


def _significant_figures(digits: str) -> int:
    digits = digits.replace(",", "")
    if "." in digits:
        return len(digits.replace(".", "").lstrip("0")) or 1
    return len(digits.lstrip("0").rstrip("0")) or 1


def prose_numbers(markdown: str) -> list[Number]:
    """The numbers in a markdown cell that the check holds the notebook to."""
    text = markdown
    for pattern in _SKIP:
        text = pattern.sub(" ", text)
    numbers = []
    for match in _NUMBER.finditer(text):
        digits, exponent, after = match["text"], match["exp"], (match["after"] or "").strip()
        plain = digits.replace(",", "")
        is_decimal = "." in plain or exponent is not None
        if not is_decimal and _significant_figures(digits) < 2:
            continue
        if not is_decimal and after == "" and len(plain) == 4 and 1950 <= int(plain) <= 2030:
            continue  # a year
        value = float(plain + (exponent or "").replace("−", "-"))
        decimals = len(plain.split(".")[1]) if "." in plain else 0
        scale = _UNITS.get(after, 1.0)
        numbers.append(Number(match.group(0).strip(), value, scale, decimals))
    return numbers


def shown_values(texts: list[str]) -> set[float]:
    """Every number in code and outputs, and the same number read as a percentage if it is one."""
    values = set()
    for text in texts:
        for match in _ANY_NUMBER.finditer(text):
            try:
                value = float(match[1].replace(",", "") + (match[2] or ""))
            except ValueError:
                continue
            values.add(value)
            if match[3] == "%":
                values.add(value / 100)
    return values


def _rounds_to(value: float, number: Number) -> bool:
    if number.value == 0:
        return value == 0
    if "e" in number.text.lower() and "e" in number.text:
        # scientific notation: compare mantissa at its precision, same exponent
        mantissa, exponent = f"{value:.{number.decimals}e}".split("e")
        return float(f"{mantissa}e{exponent}") == number.value
    return round(value, number.decimals) == round(number.value, number.decimals)


def is_shown(number: Number, values: set[float]) -> bool:
    """Some value, read in the prose's unit (also as a fraction for %, also unscaled), rounds to the number."""
    scales = {number.scale, 1.0}
    for value in values:
        for scale in scales:
            if _rounds_to(abs(value) / scale, number):
                return True
    return False


def cell_text(cell: dict) -> str:
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def output_texts(cell: dict) -> list[str]:
    texts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            texts.append(cell_text({"source": output["text"]}))
        for kind, data in output.get("data", {}).items():
            if kind in ("text/plain", "text/markdown", "text/html", "text/latex"):
                texts.append(cell_text({"source": data}))
    return texts


def sanitized(text: str) -> str:
    """The text as nbval compares it: after every pattern of tests/nbval_sanitize.cfg, read by nbval itself."""
    from nbval.plugin import get_sanitize_patterns

    for regex, replace in get_sanitize_patterns((Path(__file__).parent / "nbval_sanitize.cfg").read_text()):
        text = re.sub(regex, replace, text)
    return text


def unshown_numbers(notebook_path: Path, cited: dict[str, str]) -> list[str]:
    """'cell N: "number" ...' for every number in the markdown that nothing in the notebook shows."""
    notebook = json.loads(Path(notebook_path).read_text())
    shown = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            shown.append(cell_text(cell))
            if "NBVAL_IGNORE_OUTPUT" not in cell_text(cell):
                shown.extend(sanitized(text) for text in output_texts(cell))
    values = shown_values(shown)
    cited_numbers = {n.text for key in cited for n in prose_numbers(key)} | set(cited)
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for number in prose_numbers(cell_text(cell)):
            if number.text in cited_numbers or is_shown(number, values):
                continue
            problems.append(f"{notebook_path.name} cell {index}: {number.text!r} is in the prose but in no code, "
                            f"output or cited constant")
    return problems
