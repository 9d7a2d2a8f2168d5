"""A workaround for TPU interpret mode on a multi-device CPU backend (jax 0.10.2).

The interpreter drives each device's kernel through `io_callback`s. JAX's callback runner first
`device_put`s every operand onto CPU device 0. On a mesh of virtual CPU devices, device 1's
callback then waits for a copy onto device 0, whose own execution is parked inside *its*
callback (at the interpreter's barrier, or a semaphore wait for device 1): for operands above
a few hundred KiB the copy is queued behind it and both devices wait forever. Small operands
are copied inline, which is why toy kernels run and a megakernel's weights hang.

`install()` replaces the callback runner by one that reads operands in place (`np.asarray`,
no transfer). It changes nothing else: results are still returned as numpy arrays, and compiled
TPU runs never go through it. Installed only when a kernel is interpreted on more than one device.
"""
from __future__ import annotations

import numpy as np

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from jax._src import callback, config, tree_util
    from jax._src import xla_bridge as xb

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        cpu_device, *_ = xb.local_devices(backend="cpu")
        args = tuple(np.asarray(a) for a in args)            # read in place, no device_put
        with config.default_device(cpu_device):
            return tree_util.tree_map(np.asarray, callback(*args))

    callback.io_callback_impl = io_callback_impl
    _installed = True
