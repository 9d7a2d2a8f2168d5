# mk: the two commands of the README, and what they need.
#   make run   - execute every notebook headless (papermill) on the mini config -> runs/<timestamp>/
#   make test  - the test suite (unit, interpret-mode kernel, deviceless TPU compile, nbval), ~14 min on 2 cores
#   make test-extended - the tests marked `extended`: more points of matrices make test covers (CI runs both)
#   make check-sharded - the sharded kernel vs the sharded reference, 8 steps: every batch in both DMA modes on 8
#                        devices, MXFP4 experts on both MXU paths, 4 and 2 devices (~20 min)
#   make lock  - refresh requirements-lock.txt (the versions make installs) from the newest pyproject.toml allows
#   make test-seeds - the tolerance tests again with params and prompts drawn from seeds 0-9 (not in make test)
#   make lab   - open the notebooks interactively in JupyterLab (LAB_ARGS="--no-browser --ip=0.0.0.0" on a VM)
#   make tpu-wheels - wheels for a TPU VM without network (JAX preinstalled there) -> .whl-tpu/ and .whl-tpu/env.sh
#   make peer  - install the peer for `mk bench --impl peer` (tpu-inference 0.26.0, the release for jax 0.10.2)
#                without its dependencies; make peer-wheels downloads its wheel into .whl-tpu/ instead
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements-lock.txt
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: run test test-extended test-seeds venv lock demo clean browser lab check-sharded tpu-wheels tpu-test-wheels peer peer-wheels

# The project, its extras and their dependencies at the locked versions (pip constraints).
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[dev]"
	@touch $(STAMP)

# A scratch venv with the newest versions pyproject.toml allows, frozen into the lock. Then run make test.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet ".[dev]"
	{ sed -n '/^#/p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^mk[ =@]'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock
	@echo "$(LOCK): $$(grep -vc '^#' $(LOCK)) packages; run make test before committing it"

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

# The notebooks nbval hands out first, the longest on CPU (the two workers then end together); the
# others follow in name order.
NB_FIRST ?= $(wildcard notebooks/04_throughput_sweep.ipynb notebooks/05_speculative.ipynb notebooks/02_prefetch_tuning.ipynb notebooks/03_profiling.ipynb)

test: $(STAMP) browser
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not extended" tests
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then \
	  $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --nbval-lax --nbval-current-env \
	    --nbval-sanitize-with notebooks/sanitize.cfg $(NB_FIRST) $(filter-out $(NB_FIRST),$(wildcard notebooks/*.ipynb)); \
	fi

# More points of the kernel's matrices (batches, meshes, DMA modes, widths) and the benches' kernel pipelines:
# each covers a path a test of make test already runs, at another point (~15 min on 2 cores). CI runs it after make test.
test-extended: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m extended tests

# The tests whose tolerance is a stated error model (docs/numerics.md), with params and prompts from 10 seeds:
# a bound fitted to one seed on one machine trips on other seeds.
test-seeds: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --seeds 10 -m seeded tests

# The full interpret-mode matrix of the sharded step (make test runs a few of these cases, fewer steps).
SHARDED_CASES ?= 8:1:on_wait:bf16 8:2:on_wait:bf16 8:4:on_wait:bf16 8:8:on_wait:bf16 8:1:eager:bf16 8:2:eager:bf16 8:4:eager:bf16 8:8:eager:bf16 8:1:on_wait:fp8 8:8:eager:fp8 4:4:on_wait:bf16 4:1:eager:fp8 2:2:on_wait:bf16 2:8:eager:bf16
check-sharded: $(STAMP)
	@for c in $(SHARDED_CASES); do set -- $$(echo $$c | tr : ' '); \
	  echo "== mk check --config mini-tp8 --mesh $$1 --batch $$2 --dma-mode $$3 --mxfp4-matmul $$4 --steps 8 --exact"; \
	  $(PY) -m mk check --config mini-tp8 --mesh $$1 --batch $$2 --dma-mode $$3 --mxfp4-matmul $$4 --steps 8 --exact || exit 1; \
	done

# A TPU VM with JAX, libtpu, numpy and ml_dtypes preinstalled but no network: download here (x86-64,
# CPython 3.11) the wheels of what mk imports beyond JAX, carry .whl-tpu/ there, and start each command
# with `source .whl-tpu/env.sh && python3 -m mk ...` from the repository root (mk itself is not
# installed: env.sh puts the root on PYTHONPATH). Wheels are fetched without their dependencies, so
# every extra one is named: TPU_WHEELS_EXTRA="pkg==v ..." and/or a requirements file, e.g. the
# notebooks' closure:   make tpu-wheels TPU_WHEELS_REQS=docs/tpu-v5e/notebook-wheels.txt
TPU_WHEELS_DIR   := .whl-tpu
TPU_WHEELS_BASE  ?= tiktoken regex safetensors tqdm requests urllib3 idna certifi charset_normalizer
TPU_WHEELS_EXTRA ?=
TPU_WHEELS_REQS  ?=
TPU_WHEELS_PLATFORMS := manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
  manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any   # the VM has glibc 2.36
PIP_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
tpu-wheels:   # starts from an empty .whl-tpu/: two versions of one package would not install side by side
	@rm -rf $(TPU_WHEELS_DIR) && mkdir -p $(TPU_WHEELS_DIR)
	$(PIP_PYTHON) -m pip download --quiet --no-deps --ignore-requires-python --only-binary=:all: --python-version 3.11 --implementation cp \
	  $(addprefix --platform ,$(TPU_WHEELS_PLATFORMS)) -d $(TPU_WHEELS_DIR) \
	  $(TPU_WHEELS_BASE) $(strip $(TPU_WHEELS_EXTRA)) $(if $(TPU_WHEELS_REQS),-r $(TPU_WHEELS_REQS))
	@printf '%s\n' \
	  '# Source from the repository root on the TPU VM: installs the wheels beside them (no network, no' \
	  '# dependency resolution), then puts them after the VM'"'"'s own JAX on PYTHONPATH, and the repository root.' \
	  'PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated --quiet --no-index --no-deps --no-compile --ignore-requires-python \' \
	  '  --no-cache-dir --upgrade --target "$$PWD/$(TPU_WHEELS_DIR)/site" "$$PWD"/$(TPU_WHEELS_DIR)/*.whl || return 3' \
	  'export PYTHONPATH="$${PYTHONPATH:+$$PYTHONPATH:}$$PWD/$(TPU_WHEELS_DIR)/site:$$PWD" PYTHONUNBUFFERED=1' \
	  > $(TPU_WHEELS_DIR)/env.sh
	@echo "$(TPU_WHEELS_DIR)/: $$(ls $(TPU_WHEELS_DIR)/*.whl | wc -l) wheels, $$(du -sh $(TPU_WHEELS_DIR) | cut -f1);" \
	  "carry it to the TPU VM and run 'source $(TPU_WHEELS_DIR)/env.sh && python3 -m mk ...' from the repository root"
# The test suite for a TPU VM's host CPU: the lock's versions of docs/tpu-v5e/vm-test-packages.txt (no network
# there). On the VM: source .whl-tpu/env.sh && JAX_PLATFORMS=cpu python3 -m pytest -q -n 8 tests
tpu-test-wheels:
	@mkdir -p build
	grep -v '^#' docs/tpu-v5e/vm-test-packages.txt | while read n; do \
	  grep -iE "^$$(echo $$n | sed 's/[-_.]/[-_.]/g')==" $(LOCK) || { echo "$$n: not in $(LOCK)" >&2; exit 1; }; \
	done > build/tpu-test-requirements.txt
	$(MAKE) tpu-wheels TPU_WHEELS_BASE= TPU_WHEELS_REQS=build/tpu-test-requirements.txt

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
