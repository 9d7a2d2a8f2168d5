"""What a notebook's `parameters` cell turns into: a config and the weights to run.

Every notebook has the same two model parameters:

    config = None        # a preset name ("mini", "k3-slice", "k3"); None: the backend's default
    checkpoint = None    # a Hugging Face checkpoint directory; overrides `config`

and calls `model_config(config, checkpoint)` when it only needs shapes (rooflines, the simulator,
the deviceless compiler) or `load_model(config, checkpoint)` when it runs the model. Defaults
follow the backend, so one notebook serves this CPU machine and a TPU VM unchanged:

    backend   config=None    weights when checkpoint is None
    cpu       "mini"         a synthetic checkpoint written on the fly (`mk.synth`) and loaded back
                             through `mk.checkpoint`: the notebook exercises the real loader
    tpu       "k3-slice"     `mk.params.init` (a k3-slice checkpoint would be several GB to write)
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from mk.config import K3Config, get_config

DEFAULT_CONFIG = {"cpu": "mini", "tpu": "k3-slice"}


def _backend() -> str:
    from mk.kernel import on_tpu

    return "tpu" if on_tpu() else "cpu"


def model_name(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None) -> str:
    """A short label for figure titles: the checkpoint folder's name, or the preset's."""
    if checkpoint is not None:
        return os.path.basename(os.path.normpath(os.fspath(checkpoint)))
    if config is None:
        return DEFAULT_CONFIG[_backend()]
    return config if isinstance(config, str) else "custom config"


def model_config(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None) -> K3Config:
    """The config a notebook analyses: the checkpoint's config.json, else `config`, else the default."""
    if checkpoint is not None:
        from mk.checkpoint import load_config

        return load_config(checkpoint)
    return get_config(DEFAULT_CONFIG[_backend()] if config is None else config)


@dataclass(frozen=True)
class Model:
    name: str             # label for titles (`model_name`)
    cfg: K3Config
    params: dict          # the `mk.params` tree (bf16 experts), jax arrays
    source: str           # where the weights came from, for the notebook's printout

    def __iter__(self):   # cfg, params = load_model(...)
        return iter((self.cfg, self.params))


def load_model(config: "str | K3Config | None" = None, checkpoint: "str | os.PathLike | None" = None,
               seed: int = 0, synthetic: bool | None = None) -> Model:
    """Config and weights for a notebook (see the module docstring for the defaults).

    `synthetic`: with no checkpoint, write a synthetic checkpoint and load it (default: on CPU) or
    use `mk.params.init(cfg, seed)` directly (default: on TPU).
    """
    from mk import checkpoint as ckpt

    if checkpoint is not None:
        cfg, params = ckpt.load_with_config(checkpoint, progress=False)
        return Model(model_name(None, checkpoint), cfg, params, f"checkpoint {os.fspath(checkpoint)}")
    cfg = model_config(config)
    if synthetic is None:
        synthetic = _backend() == "cpu"
    if not synthetic:
        from mk import params as pm

        return Model(model_name(config), cfg, pm.init(cfg, seed), f"random weights (mk.params.init, seed {seed})")
    from mk import synth

    with tempfile.TemporaryDirectory(prefix="mk-synth-") as tmp:
        synth.write_checkpoint(cfg, tmp, seed=seed)
        params = ckpt.load(tmp, progress=False)
    return Model(model_name(config), cfg, params, f"synthetic checkpoint (mk.synth, seed {seed}, MXFP4 experts), "
                              f"written and loaded back through mk.checkpoint")


def default_mesh(cfg: K3Config, mesh: "int | None" = None) -> int:
    """Devices the kernel runs on in a notebook: `mesh` if given, else every local device on a TPU
    backend (the largest count that divides the model: mk.sharding), else 1."""
    if mesh is not None:
        return int(mesh)
    if _backend() != "tpu":
        return 1
    import jax
    from mk.sharding import gcd_devices
    return gcd_devices(cfg, jax.local_device_count())
