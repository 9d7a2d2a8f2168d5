"""mk: a Kimi-K3-shaped decode step as one Pallas TPU megakernel.

Modules: `config` (the model contract), `params` (random well-behaved weights), `reference`
(pure-JAX decode step, the oracle), `checkpoint` / `synth` / `tokenizer` (HF checkpoints),
`plan` + `kernel` (the megakernel), `roofline` + `sim` (performance model).
"""
from mk.config import K3Config, PRESETS, get_config

__all__ = ["K3Config", "PRESETS", "get_config"]
__version__ = "0.1.0"
