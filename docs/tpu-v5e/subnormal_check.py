"""Does the TPU keep subnormal operands where an unpack would feed them? Three Pallas kernels, on the
attached chip (or in interpret mode without one), print JSON:
  vpu_mul        f32 subnormals (2^-127, 2^-149, 3 * 2^-128) times 2^126 on the VPU: kept if the
                 products are 0.5, 2^-23, 0.75
  mxu_f32_latch  a bf16 LHS of ones times an f32 weight column holding a subnormal (the int4 dot's
                 f32 weight latch, `docs/tpu-v5e/llo_unpack.py`): kept if the sum is not 0
  mxu_bf16       the same with a bf16 subnormal weight (2^-127 is a bf16 subnormal)
An E2M1 unpack that embeds the code's bits as value x 2^-126 (0.5's codes subnormal) is exact only
where these keep them. Run from the repo root:  python3 docs/tpu-v5e/subnormal_check.py"""
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

TINY = np.array([2.0 ** -127, 2.0 ** -149, 3 * 2.0 ** -128], np.float32)     # subnormal f32


def _call(kernel, out, *args):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    on_tpu = jax.devices()[0].platform == "tpu"
    return np.asarray(pl.pallas_call(kernel, out_shape=out, in_specs=[vmem] * len(args), out_specs=vmem,
                                     interpret=not on_tpu)(*args))


def vpu_mul():
    a = np.zeros((8, 128), np.float32)
    a[0, :3] = TINY

    def k(a_ref, o_ref):
        o_ref[...] = a_ref[...] * jnp.float32(2.0 ** 126)
    got = _call(k, jax.ShapeDtypeStruct((8, 128), jnp.float32), jnp.asarray(a))[0, :3]
    return {"products": got.tolist(), "want": (TINY * np.float32(2.0 ** 126)).tolist(),
            "kept": bool(np.array_equal(got, TINY * np.float32(2.0 ** 126)))}


def mxu(weight_dtype):
    w = np.zeros((128, 128), np.float32)
    w[0, 0] = 2.0 ** -127                                     # one subnormal weight in column 0
    w[1, 1] = 2.0 ** -126                                     # the smallest normal, in column 1
    x = np.ones((8, 128), jnp.bfloat16)

    def k(x_ref, w_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)
    got = _call(k, jax.ShapeDtypeStruct((8, 128), jnp.float32), jnp.asarray(x),
                jnp.asarray(w).astype(weight_dtype))[0, :2]
    return {"sums": got.tolist(), "want": [2.0 ** -127, 2.0 ** -126], "kept": bool(got[0] == np.float32(2.0 ** -127))}


if __name__ == "__main__":
    res = {"device": jax.devices()[0].device_kind}
    for name, fn in (("vpu_mul", vpu_mul), ("mxu_f32_latch", lambda: mxu(jnp.float32)),
                     ("mxu_bf16", lambda: mxu(jnp.bfloat16))):
        try:
            res[name] = fn()
        except Exception as e:          # a lowering refusal is an answer too
            res[name] = {"error": str(e).splitlines()[0][:300]}
    print(json.dumps(res))
