"""A dry run of the notebooks' TPU branches on CPU, for finding their Python errors before a chip
is spent on them (times and bandwidths are meaningless: every assert on them fails, as it should).

    MK_TPU_DRY_RUN=1 PYTHONPATH=tests/tpu_dry_run JAX_PLATFORMS=cpu \\
      python -m mk notebooks --only 02 -p config mini -p time_steps 2 --no-export --out /tmp/dry

Python imports this module at start-up in every process on PYTHONPATH (the runner's kernels too).
With MK_TPU_DRY_RUN set it makes mk believe it is on a TPU v5e (`on_tpu`, `local_chip`, the bench's
chip and its refusal off a TPU) while every kernel still runs in interpret mode. A trace has no
device plane on CPU, so notebook 03 stops where it reads one. Not used by any test."""
import os

if os.environ.get("MK_TPU_DRY_RUN"):
    from mk.kernel import decode
    from mk.notebooks import helpers
    from mk.perf import bench

    _build_call = decode.build_call
    decode.on_tpu = lambda: True
    decode.build_call = lambda plan, interpret=None: _build_call(
        plan, interpret or decode.interpret_params(detect_races=False))
    bench.require_tpu = lambda backend=None: None
    bench.chip_of_device = lambda kind: bench.DEVICE_KINDS.get("TPU v5 lite")
    helpers.local_chip = lambda: "tpu-v5e"
    helpers.backend_label = lambda: "TPU DRY RUN (CPU interpret mode, times meaningless)"
    print("mk: TPU dry run (tests/tpu_dry_run)")
