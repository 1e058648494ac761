# Two commands do all the set-up:  `make lab` (start the course)  and  `make test` (run every test).
# Both create the virtual environment in .venv and install the pinned dependencies if needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
JOBS ?= 2
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup lab test check release clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

lab: setup                     ## start JupyterLab on notebooks/
	$(BIN)/course lab

test: setup                    ## the whole suite: library tests, nbval on solutions/, release and grading round trips
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile

check: setup                   ## grade your own notebook: make check CH=01
	$(BIN)/course check $(CH)

release: setup                 ## regenerate notebooks/ from solutions/
	$(BIN)/course release

clean:
	rm -rf $(VENV) .grading
