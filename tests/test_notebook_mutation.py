"""Notebook 02 catches a broken kernel: a mutation test of its kernel-vs-reference assertion.

The repository's `mk` package is copied to a temp dir and one deliberate bug is injected into the
copy (the MoE combine subtracts the expert outputs instead of adding them). Notebook 02 then runs
against the copy (first on the kernel's PYTHONPATH, and its working directory) on a tiny synthetic
checkpoint, one step at one prefetch depth. The run must FAIL, and fail on the notebook's own
kernel-vs-reference assertion: an ImportError or any other crash would prove nothing.
"""
import shutil

import nbformat
import pytest

from mk.notebooks.runner import NOTEBOOK_DIR, run_all

REPO = NOTEBOOK_DIR.parent
NOTEBOOK = "02_prefetch_tuning.ipynb"
TARGET = "mk/kernel/moe.py"
ANCHOR = "r.routed_acc[...] = r.routed_acc[...] + weight * f32(out)"
MUTANT = "r.routed_acc[...] = r.routed_acc[...] - weight * f32(out)"
WHERE = 'import mk.kernel.moe as _mutated\nprint("mk.kernel.moe imported from", _mutated.__file__)'


def _mutated_tree(root):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "mk", root / "mk", ignore=ignore)
    shutil.copytree(REPO / "data", root / "data", ignore=ignore)
    path = root / TARGET
    text = path.read_text()
    n = text.count(ANCHOR)
    if n != 1:
        pytest.fail(f"mutation anchor found {n} times in {TARGET} (expected once): {ANCHOR!r}. The MoE combine "
                    f"was rewritten; update ANCHOR/MUTANT in {__file__} to flip the sign of the new combine.")
    path.write_text(text.replace(ANCHOR, MUTANT))
    return path


def _error(nb):
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return i, out
    return None, None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_02_fails_on_a_sign_flipped_moe_combine(tmp_path):
    from mk.io import synth
    from mk.model.config import get_config

    root = tmp_path / "mutant"
    mutated = _mutated_tree(root)

    # small and fast: two layers (dense MLP, then MLA + MoE), so the MoE combine runs in step one
    ckpt = tmp_path / "tiny-k3"
    synth.write_checkpoint(get_config("mini").replace(layers=2, full_attention=(1,)), ckpt, seed=0)

    src = tmp_path / "src"
    src.mkdir()
    nb = nbformat.read(str(NOTEBOOK_DIR / NOTEBOOK), as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])) + 1
    nb.cells.insert(at, nbformat.v4.new_code_cell(WHERE))
    nbformat.write(nb, str(src / NOTEBOOK))

    params = {"checkpoint": str(ckpt), "depths": [0, 2], "tiles": [256], "compile_points": [],
              "check_depths": [2], "check_steps": 1}
    res = run_all(tmp_path / "out", params, directory=src, root=root, html=False)
    assert len(res) == 1 and not res[0]["ok"], f"notebook 02 passed against a kernel with a sign-flipped MoE combine: {res}"

    ran = nbformat.read(str(tmp_path / "out" / NOTEBOOK), as_version=4)
    printed = "".join(o.get("text", "") for c in ran.cells for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert f"mk.kernel.moe imported from {mutated}" in printed, \
        f"the notebook did not import the mutated copy ({mutated}):\n{printed[:2000]}"
    i, err = _error(ran)
    assert err is not None, res
    assert err["ename"] == "AssertionError" and err["evalue"].startswith("kernel vs reference"), \
        f"notebook 02 failed, but not on its kernel-vs-reference assertion (cell {i}): {err['ename']}: {err['evalue'][:1000]}"
