# mk: the two commands of the README, and what they need.
#   make run   - execute every notebook headless (papermill) on the mini config -> runs/<timestamp>/
#   make test  - the whole test suite (unit, interpret-mode kernel, deviceless TPU compile, nbval)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: run test venv demo clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(PY) -m mk notebooks --out runs/$$(date +%Y%m%d-%H%M%S)

demo: $(STAMP)
	$(PY) -m mk generate --config mini --seed 0 --prompt-tokens 1,2,3 --max-new-tokens 16

test: $(STAMP)
	$(PY) -m pytest -q tests
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg notebooks/; \
	fi

clean:
	rm -rf $(VENV) runs .pytest_cache
