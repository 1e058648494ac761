# Two commands do all the set-up:  `make lab` (start the course)  and  `make test` (run every test).
# Both create the virtual environment in .venv and install the pinned dependencies if needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
JOBS ?= 2
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup system-packages hub lab test quick busy check release clean

setup: $(VENV)/.installed

# Byte-compiled after the install, on every core (pip's own compiling, its default, took about half a minute of one core;
# this, about 20 s on 2): the clean rooms and the hub import from a read-only venv, where Python could not keep what it
# compiles, and would compile the same modules again in each. Left out, as nothing here imports them (or one process
# does, which compiles what it imports as this would): the packages' own test suites (some of whose files are not
# Python 3.11), pip, networkx, and Hugging Face's models other than GPT-2, Llama and Mistral (about 3,200 files).
# Installed without their dependencies: xgrammar (chapter 15's comparison) declares triton, a GPU compiler it does not
# import on CPU; what it does import is pinned in pyproject.toml (torch, transformers, numpy), comes with a pin (pydantic, with openai) or is here.
NO_DEPS = xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# pip itself first, pinned: the venv's own pip (23.2 with Python 3.11.7) spends about 30 s of one core resolving this
# project's dependencies, pip 26.3 about 12 s (measured from a fresh HOME: the whole install 79 s -> 67 s).
PIP = pip==26.3
PIP_INSTALL = $(BIN)/python -m pip install --quiet --disable-pip-version-check
NOT_COMPILED = site-packages/(.*/(tests?|testing/_internal)/|pip/|networkx/|transformers/models/(?!auto/|gpt2/|llama/|mistral/)[^/]+/)
COMPILE_VENV = $(BIN)/python -m compileall -q -j 0 -x '$(NOT_COMPILED)' $(VENV)/lib > /dev/null
# Taken out after the install: jsonschema's checker of the "iri" formats (rfc3987-syntax, which jupyter-events asks for,
# and lark, its parser). It builds its Earley parsers when jsonschema is imported: about 1 s of CPU in every process
# that imports nbformat, nbgrader, jupyter-events or jsonschema (JupyterLab's and the hub's servers, nbgrader, the
# test workers, chapter 15's kernels), some 45 s in a run of the suite. No schema here or in Jupyter's asks for an
# "iri" format, and jsonschema checks formats only when asked; without it, jsonschema leaves that one format unchecked.
NOT_USED = rfc3987-syntax lark

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) $(PIP)
	$(PIP_INSTALL) --no-compile -e .
	$(PIP_INSTALL) --no-compile --no-deps $(NO_DEPS)
	$(BIN)/python -m pip uninstall --quiet --yes $(NOT_USED)
	$(COMPILE_VENV)
	@touch $@

lab: setup                     ## start JupyterLab on notebooks/
	$(BIN)/course lab

# Debian packages the tests use: bubblewrap (the grading sandbox) and chromium (the browser test).
# Installed when possible (root or password-less sudo); without them those tests are skipped, saying why.
SYSTEM_PACKAGES_MISSING = $(strip $(if $(shell command -v bwrap),,bubblewrap) $(if $(wildcard /usr/bin/chromium),,chromium))
system-packages:
	@if [ -n "$(SYSTEM_PACKAGES_MISSING)" ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo"; \
	  else echo "note: apt-get install $(SYSTEM_PACKAGES_MISSING) to run the sandbox and browser tests"; exit 0; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(SYSTEM_PACKAGES_MISSING) \
	    || echo "note: could not install $(SYSTEM_PACKAGES_MISSING); the tests that need them are skipped"; \
	fi

# JupyterHub's proxy (configurable-http-proxy, from npm, pinned by docs/hub/package-lock.json), for the hub test and
# for instructors who run the course on a hub (docs/hub.md). JupyterHub itself is a pinned Python dependency.
PROXY := $(VENV)/chp/node_modules/.bin/configurable-http-proxy
hub: $(PROXY)
$(PROXY): docs/hub/package.json docs/hub/package-lock.json
	@if command -v npm >/dev/null; then \
	  mkdir -p $(VENV)/chp && cp docs/hub/package.json docs/hub/package-lock.json $(VENV)/chp/ && \
	  cd $(VENV)/chp && npm ci --no-audit --no-fund --loglevel=error; \
	else echo "note: npm not found: the JupyterHub test is skipped"; fi

# nbval runs every notebook twice in the same session: as is, and as on another CPU (--other-cpu: its kernel gets ATen's
# generic kernels, MKL's vendor-neutral path, oneDNN without AVX; see conftest.py). No stored output may show a number
# that the CPU's rounding decides (the measurements that end a notebook, with nothing to check there, run as is only:
# tests/other_cpu.py). The workers get the longest units of work first, as the last run measured them: each
# run rewrites tests/durations.json (tests/schedule.py; commit it when it changed); the 25 slowest tests are listed at the end.
# Waiting OpenMP threads sleep rather than spin while two test processes share the cores (see tests/conftest.py).
# The course's own modules byte-compiled first: every process of a run imports them (notebook kernels, clean rooms,
# servers), and where Python may not write bytecode (PYTHONDONTWRITEBYTECODE=1, a read-only sandbox) each would
# compile them again (about 0.3 s of CPU for the whole of course_lib).
BYTECODE = $(BIN)/python -m compileall -q course_lib tests > /dev/null
test: setup system-packages hub ## the whole suite: library tests, nbval on solutions/ (as is and as on another CPU), round trips, browser
	@$(BYTECODE)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n $(JOBS) --dist loadfile --other-cpu --durations=25 --record-durations

# Daily work: the tests under tests/ whose unit of work (a file, mostly) took at most QUICK seconds in the recorded run
# (tests/durations.json): library tests, checks, hidden tests, most grading and system tests; no nbval of solutions/,
# no grading round trip, no hub. The summary lists what it left out; `make test` runs everything.
QUICK ?= 10
quick: setup                   ## the tests/ units that took at most QUICK=10 s in the last full run (a few minutes)
	@$(BYTECODE)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n $(JOBS) --dist loadfile --skip-slower-than $(QUICK) tests

# The timed chapters' stored notebooks on a busy machine: two processes keep both cores busy (ended however nbval ends)
# while nbval re-executes them, as is and as on another CPU. Their measured claims must hold there too. OpenMP's
# threads spin here (no OMP_WAIT_POLICY), as on a learner's machine: the harder case for the timed claims.
# `course execute` reads this list too: it refuses these chapters on a busy machine unless --busy-ok.
TIMED = solutions/05-kv-cache solutions/07-speculative solutions/08-memory-bound solutions/11-modern-decoder solutions/12-serving solutions/14-tiled-attention solutions/16-tensor-parallel
busy: setup                    ## nbval of the timed chapters while both cores are kept busy
	@$(BIN)/python -c "while True: pass" & a=$$!; $(BIN)/python -c "while True: pass" & b=$$!; \
	trap 'kill $$a $$b 2>/dev/null' EXIT; \
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile --other-cpu $(TIMED)

check: setup                   ## grade your own notebook: make check CH=01
	$(BIN)/course check $(CH)

release: setup                 ## regenerate notebooks/ from solutions/
	$(BIN)/course release

clean:
	rm -rf $(VENV) .grading
