source .whl-tpu/env.sh; export JAX_PLATFORMS=tpu,cpu
python3 - <<'PY'
import nbformat, os
os.makedirs("/tmp/src", exist_ok=True)
nb = nbformat.v4.new_notebook(); nb.cells = [nbformat.v4.new_code_cell("import jax; print(jax.devices())")]
nbformat.write(nb, "/tmp/src/01_chip.ipynb")
from mk.notebooks.runner import run_all
r = run_all("/tmp/nbout", directory="/tmp/src", html=False); print(r)
out = nbformat.read("/tmp/nbout/01_chip.ipynb", 4).cells[0].outputs; print(out)
PY
