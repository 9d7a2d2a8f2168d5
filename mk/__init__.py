"""mk: a Kimi-K3-shaped decode step as one Pallas TPU megakernel.

Modules: `config` (the model contract), `params` (random well-behaved weights), `reference`
(pure-JAX decode step, the oracle), `checkpoint` / `synth` / `tokenizer` (HF checkpoints),
`plan` + `kernel` (the megakernel), `roofline` + `sim` (performance model).
"""
import os as _os

# XLA must round at every bf16 point the spec names (spec 3.9); by default XLA CPU keeps fused
# bf16 intermediates in fp32, which silently skips rounding points. Set before any backend starts.
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()

# On a CPU-only run libtpu (present for deviceless compilation) warns that it cannot find TPU
# workers; tell it this host is the only one. Real TPU runs (JAX_PLATFORMS unset/tpu) are untouched.
if _os.environ.get("JAX_PLATFORMS", "") == "cpu":
    _os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

from mk.config import K3Config, PRESETS, get_config  # noqa: E402

__all__ = ["K3Config", "PRESETS", "get_config"]
__version__ = "0.1.0"
