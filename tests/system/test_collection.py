"""The README's conda command is plain `pytest`: it must collect exactly what `python -m pytest` collects."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


def collected(command: list[str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what pytest's own settings put on sys.path
    # --assert=plain: every test module is imported all the same, without rewriting its asserts first (4 of 9 s of CPU)
    proc = subprocess.run([*command, "--collect-only", "-q", "-p", "no:xdist", "--assert=plain", "tests"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def this_sessions_tests(config: pytest.Config, items: list) -> list[str] | None:
    """What this session collected under tests/, when it is a ``python -m pytest`` run that collected all of it
    (`make test`'s): the same list as a second ``python -m pytest --collect-only`` would give, seconds sooner."""
    argv = getattr(config, "workerinput", {}).get("mainargv", sys.argv)  # an xdist worker: the main process's argv
    selected = not (config.getoption("keyword") or config.getoption("markexpr") or config.getoption("deselect"))
    ids = [item.nodeid for item in items if item.nodeid.startswith("tests/")]
    files = {f"tests/{path.relative_to(ROOT / 'tests').as_posix()}" for path in (ROOT / "tests").rglob("test_*.py")}
    if Path(argv[0]).name == "__main__.py" and selected and {i.split("::", 1)[0] for i in ids} == files:
        return ids
    return None


def test_plain_pytest_collects_what_python_m_pytest_collects(request):
    plain = shutil.which("pytest", path=str(Path(sys.executable).parent))
    if plain is None:
        pytest.skip("no pytest script beside this Python")
    by_module = this_sessions_tests(request.config, request.session.items) or collected([sys.executable, "-m", "pytest"])
    assert len(by_module) > 1000, f"python -m pytest collected only {len(by_module)} tests"
    missing = sorted(set(by_module) - set(collected([plain])))
    assert not missing, f"plain pytest misses {len(missing)} tests, e.g. {missing[:3]}"


def test_no_test_file_imports_another():
    offenders = [f"{path.name}: {line.strip()}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for line in path.read_text().splitlines() if line.startswith(("from tests.test_", "import tests.test_"))]
    assert not offenders, "shared code belongs in tests/helpers.py or tests/planted.py:\n" + "\n".join(offenders)


def test_every_test_file_the_course_names_exists():
    """Prose, docstrings and docs name test files (``tests/lib/test_hf.py checks ...``): each must be there
    (a pattern such as tests/chapters/chNN/test_grading_NN.py aside)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = {(path, match) for path in tracked if path.endswith((".py", ".md", ".ipynb", ".yml", ".cfg")) or path == "Makefile"
             for match in re.findall(r"tests/[\w/]+\.(?:py|cfg)", (ROOT / path).read_text(errors="replace"))}
    missing = sorted(f"{path} names {match}" for path, match in named if "NN" not in match and not (ROOT / match).exists())
    assert len(named) > 20 and not missing, "\n".join(missing)
