#!/usr/bin/env bash
# The notebook runner's ipc kernel on the lent TPU v5e (no TCP socket opens there): a one-cell
# notebook that prints the chip, run through mk.notebooks.runner.run_all (on the chip, 2026-12-05: its one cell in 14 s).
#   OUT=DIR bash docs/tpu-v5e/run-ipc-kernel.sh
source docs/tpu-v5e/steps.sh
python3 - <<'PY'
import nbformat, os
src, out = os.path.join(os.environ["OUT"], "src"), os.path.join(os.environ["OUT"], "nb")
os.makedirs(src, exist_ok=True)
nb = nbformat.v4.new_notebook(); nb.cells = [nbformat.v4.new_code_cell("import jax; print(jax.devices())")]
nbformat.write(nb, os.path.join(src, "01_chip.ipynb"))
from mk.notebooks.runner import run_all
print(run_all(out, directory=src, html=False))
print(nbformat.read(os.path.join(out, "01_chip.ipynb"), 4).cells[0].outputs)
PY
