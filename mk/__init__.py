"""mk: a Kimi-K3-shaped decode step as one Pallas TPU megakernel.

A house in layers, each package importing only the ones below it (tests/test_layers_of_the_house.py):

    mk.cli        `python -m mk COMMAND`                                          (top)
    mk.notebooks  what the research notebooks call, and their runner
    mk.perf       hardware data, roofline, simulator, traces, microbench, bench
    mk.kernel     the plan, its schedules, weight packing, the Pallas megakernel, aot, check
    mk.io         checkpoints, synthetic checkpoints, the tokenizer
    mk.model      config, params, sublayers, the pure-JAX reference, layouts and sharding
    mk.errors     the user-facing error base                                      (bottom)
"""
import os as _os
import time as _time

STARTED = _time.perf_counter()       # the clock of a command's timeline (`mk.cli.common.Timeline`)

# XLA must round at every bf16 point the spec names (spec 3.9); by default XLA CPU keeps fused
# bf16 intermediates in fp32, which silently skips rounding points. Set before any backend starts.
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()


# Google's PCI vendor id and the TPU chips' device ids (as jax._src.hardware_utils lists them).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}


def _tpu_attached() -> bool:
    """Whether this host has a TPU chip (/dev/accel*, or a Google TPU device on the PCI bus).
    Cheap: no runtime is started."""
    import glob

    if glob.glob("/dev/accel*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(_os.path.join(_os.path.dirname(vendor), "device")) as f:
                if f.read().strip() in _TPU_PCI_DEVICES:
                    return True
        except OSError:
            continue
    return False


def _quiet_libtpu_without_tpu() -> None:
    """libtpu (loaded for deviceless compilation and TPU interpret mode) looks for TPU workers it
    cannot find on a CPU-only host and logs about it: "could not determine TPU accelerator type"
    (no host bounds) and "E0000 ... INVALID_ARGUMENT: unexpected worker hostname" (no worker list).
    Tell it the truth instead of lowering any log level: one host (`TPU_HOST_BOUNDS=1,1,1`), which
    is this one (`TPU_WORKER_HOSTNAMES=localhost`), no GCE metadata server to ask
    (`TPU_SKIP_MDS_QUERY=1`). With no chip attached at all there is nothing for libtpu's
    multi-process lockfile to guard, so several processes may compile deviceless at once
    (`ALLOW_MULTIPLE_LIBTPU_LOAD=1`). Deviceless topologies are unchanged (same devices and
    coordinates). Only when JAX_PLATFORMS=cpu or no TPU is attached; values already in the
    environment win; a TPU VM running on its TPU is left untouched."""
    attached = _tpu_attached()
    if attached and _os.environ.get("JAX_PLATFORMS", "") != "cpu":
        return
    quiet = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}
    if not attached:
        quiet["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    for key, value in quiet.items():
        _os.environ.setdefault(key, value)


_quiet_libtpu_without_tpu()

from mk.model.config import K3Config, PRESETS, get_config  # noqa: E402

__all__ = ["K3Config", "PRESETS", "get_config"]
__version__ = "0.1.0"
