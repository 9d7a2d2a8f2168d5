# mk: the two commands of the README, and what they need.
#   make run   - execute every notebook headless (papermill) on the mini config -> runs/<timestamp>/
#   make test  - the whole test suite (unit, interpret-mode kernel, deviceless TPU compile, nbval)
#   make check-sharded - the sharded kernel vs the sharded reference, 8 steps: every batch in both DMA modes on 8
#                        devices, MXFP4 experts on both MXU paths, 4 and 2 devices (~20 min)
#   make lab   - open the notebooks interactively in JupyterLab (LAB_ARGS="--no-browser --ip=0.0.0.0" on a VM)
#   make peer  - install the peer for `mk bench --impl peer` (tpu-inference 0.26.0, the release for jax 0.10.2)
#                without its dependencies; make peer-wheels downloads its wheel into .whl-tpu/ instead
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: run test venv demo clean browser lab check-sharded peer peer-wheels

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

# PNG figures need a headless browser for kaleido; best effort (root + apt), else figures are HTML.
browser:
	@if [ ! -x /usr/bin/chromium-headless-shell ] && [ ! -x /usr/bin/chromium ] && [ -z "$$BROWSER_PATH" ] \
	    && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium-headless-shell (PNG figures via kaleido)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq chromium-headless-shell >/dev/null 2>&1 \
	  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium-headless-shell >/dev/null 2>&1; } \
	  || echo "could not install chromium-headless-shell: figures will be written as HTML"; \
	fi

run: $(STAMP) browser
	$(PY) -m mk notebooks --out runs/$$(date +%Y%m%d-%H%M%S)

LAB_ARGS ?=
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS) notebooks/

demo: $(STAMP)
	$(PY) -m mk generate --config mini --seed 0 --prompt-tokens 1,2,3 --max-new-tokens 16

test: $(STAMP) browser
	$(PY) -m pytest -q -n 2 --dist loadfile tests
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(PY) -m pytest -q -n 2 --dist loadfile --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg notebooks/; \
	fi

# The full interpret-mode matrix of the sharded step (make test runs a few of these cases, fewer steps).
SHARDED_CASES ?= 8:1:on_wait:bf16 8:2:on_wait:bf16 8:4:on_wait:bf16 8:8:on_wait:bf16 8:1:eager:bf16 8:2:eager:bf16 8:4:eager:bf16 8:8:eager:bf16 8:1:on_wait:fp8 8:8:eager:fp8 4:4:on_wait:bf16 4:1:eager:fp8 2:2:on_wait:bf16 2:8:eager:bf16
check-sharded: $(STAMP)
	@for c in $(SHARDED_CASES); do set -- $$(echo $$c | tr : ' '); \
	  echo "== mk check --config mini-tp8 --mesh $$1 --batch $$2 --dma-mode $$3 --mxfp4-matmul $$4 --steps 8 --exact"; \
	  $(PY) -m mk check --config mini-tp8 --mesh $$1 --batch $$2 --dma-mode $$3 --mxfp4-matmul $$4 --steps 8 --exact || exit 1; \
	done

# vLLM TPU's fused MoE kernel, alone: --no-deps leaves out vLLM's serving stack and the wheel's own pins
# (libtpu 0.0.43, torchvision, fastapi, ...); mk loads the kernel's module without importing vLLM.
PEER_WHEEL ?= tpu-inference==0.26.0
PEER_WHEELS ?= .whl-tpu
peer: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(PEER_WHEEL)

peer-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: -d $(PEER_WHEELS) $(PEER_WHEEL)
	@echo "$(PEER_WHEELS)/: carry it; install there with pip install --no-index --no-deps $(PEER_WHEELS)/tpu_inference-*.whl"

clean:
	rm -rf $(VENV) runs .pytest_cache
