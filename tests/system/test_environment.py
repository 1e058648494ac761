"""Set-up files agree with each other and with the README."""
from __future__ import annotations

import re
import tomllib

import yaml

from tests.helpers import ROOT


def pyproject_pins() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_environment_yml_pins_equal_pyproject_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda_pins = sorted(p for p in pip_section if not p.startswith("-e"))
    assert conda_pins == sorted(pyproject_pins())
    assert "-e ." in pip_section


def test_every_dependency_is_pinned_exactly_and_torch_is_2_13():
    pins = pyproject_pins()
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", p) for p in pins), pins
    assert "torch==2.13.0" in pins


def test_readme_holds_the_two_commands_and_ci_calls_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_the_packages_installed_without_dependencies_are_pinned_alike_in_the_makefile_environment_yml_and_readme():
    """The Makefile's NO_DEPS (xgrammar without triton) is what environment.yml's note and the README tell conda users
    to install, and what this environment has."""
    from importlib.metadata import version

    pins = re.search(r"^NO_DEPS = (.+)$", (ROOT / "Makefile").read_text(), re.M)[1].split()
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", p) for p in pins), pins
    note = "pip install --no-deps " + " ".join(pins)
    assert note in (ROOT / "environment.yml").read_text()
    assert note in " ".join((ROOT / "README.md").read_text().split())
    assert all(version(p.split("==")[0]) == p.split("==")[1] for p in pins)
