"""Session-wide pytest settings, whatever is run (tests/ or solutions/): nbval as on another CPU (--other-cpu), and
the order in which xdist's workers get the files (tests/schedule.py). The tests' fixtures are in tests/conftest.py."""
from __future__ import annotations

import os

from nbval.plugin import IPyNbFile

from tests.schedule import OTHER_CPU, LongestFirstPlugin

#: Another CPU's float rounding, on any machine: ATen's generic kernels instead of AVX2/AVX-512, MKL's vendor-neutral
#: path, oneDNN without AVX. With --other-cpu (`make test`), nbval runs every notebook a second time, in a kernel
#: started with these: no stored output may show a number that the CPU's rounding decides. Those tests' ids read
#: ``solutions/NN-name/name.ipynb::other-cpu::Cell N``.
OTHER_CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def pytest_addoption(parser):
    parser.addoption("--other-cpu", action="store_true",
                     help="with --nbval: run every notebook once more, its kernel as on another CPU (conftest.py OTHER_CPU_ENV)")


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # its scheduler hook is unknown to pytest without xdist
        config.pluginmanager.register(LongestFirstPlugin(), "longest-first")


def pytest_collect_file(file_path, parent):
    """With --other-cpu, each notebook that nbval collects is collected a second time, to run as on another CPU."""
    options = parent.config.option
    if file_path.suffix == ".ipynb" and options.other_cpu and (options.nbval or options.nbval_lax):
        try:
            path = file_path.relative_to(parent.config.rootpath).as_posix()
        except ValueError:  # a notebook outside the repository, named on the command line
            path = file_path.as_posix()
        return OtherCpuNotebook.from_parent(parent, path=file_path, nodeid=f"{path}::{OTHER_CPU}")
    return None


class OtherCpuNotebook(IPyNbFile):
    """nbval's notebook, its kernel started with OTHER_CPU_ENV (the test process's own variables are restored)."""

    def setup(self):
        saved = {name: os.environ.get(name) for name in OTHER_CPU_ENV}
        os.environ.update(OTHER_CPU_ENV)
        try:
            super().setup()
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
