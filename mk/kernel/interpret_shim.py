"""Two workarounds for TPU interpret mode on a CPU backend (jax 0.10.2), installed whenever a kernel
is interpreted; compiled TPU runs never go through them.

1. Multi-device deadlock. The interpreter drives each device's kernel through `io_callback`s.
   JAX's callback runner first `device_put`s every operand onto CPU device 0. On a mesh of virtual
   CPU devices, device 1's callback then waits for a copy onto device 0, whose own execution is
   parked inside *its* callback (at the interpreter's barrier, or a semaphore wait for device 1):
   for operands above a few hundred KiB the copy is queued behind it and both devices wait
   forever. Small operands are copied inline, which is why toy kernels run and a megakernel's
   weights hang. `install()` replaces the callback runner by one that reads operands in place
   (`np.asarray`, no transfer); results are still returned as numpy arrays.

2. Host memory. jaxlib hands a host callback a fresh numpy copy of each operand (it owns its
   data; nothing else refers to it). The default runner then `device_put`s it (a second copy) and
   the interpreter's `_allocate_buffer` copies it again into its simulated HBM (`np.array(val)`,
   a third). So every interpreted step held the kernel's weights up to three more times (measured
   on the 1.36 GB K3 byte-mix checkpoint: +3.4 GB per step). With the in-place runner above and
   `_allocate_buffer` given the operand itself when it owns its data, the simulated HBM *is*
   jaxlib's copy: one copy of each input per step, which a compiled TPU run does not make.
   (numpy 2 takes `__array__(copy=True)` at its word, so `np.array` keeps the handed-over array.)
"""
from __future__ import annotations

import numpy as np

_installed = False


class _HandOver:
    """An operand array that `np.array(...)` must take as it is (see 2. above)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        return self.array if dtype is None else self.array.astype(dtype)


def owned_operand(val):
    """`val` wrapped for hand-over when it is a numpy array that owns its data (a callback
    operand's private copy), made writeable (the simulated memory is written in place); else
    `val` unchanged (the interpreter copies it, as without the shim)."""
    if isinstance(val, np.ndarray) and val.base is None and val.flags.owndata:
        val.flags.writeable = True
        return _HandOver(val)
    return val


def install() -> None:
    global _installed
    if _installed:
        return
    from jax._src import callback, config, tree_util
    from jax._src import xla_bridge as xb
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        cpu_device, *_ = xb.local_devices(backend="cpu")
        args = tuple(np.asarray(a) for a in args)            # read in place, no device_put
        with config.default_device(cpu_device):
            return tree_util.tree_map(np.asarray, callback(*args))

    allocate = ipc._allocate_buffer

    def allocate_buffer(token, device_id, local_core_id, memory_space, val, source_info=None):
        return allocate(token, device_id, local_core_id, memory_space, owned_operand(val),
                        source_info=source_info)

    callback.io_callback_impl = io_callback_impl
    ipc._allocate_buffer = allocate_buffer
    _installed = True
