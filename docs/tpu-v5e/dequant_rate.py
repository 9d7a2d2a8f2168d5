"""`mk microbench`'s dequant family alone, on the chip: the fused MXFP4 tile product
(`mk.kernel.ring.mxfp4_tile_product`) per unpack, as JSON. Run from the repo root on the TPU VM:
    python3 docs/tpu-v5e/dequant_rate.py > dequant.json"""
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from mk.kernel.schedule import dequant_ops
from mk.perf import microbench as mb

rng = np.random.default_rng(0)
out = {"device": jax.devices()[0].device_kind}
for unpack in mb.DEQUANT_UNPACKS:
    args = tuple(jnp.asarray(x) for x in mb.dequant_args(rng, unpack))
    t = mb.per_repeat(partial(mb.dequant_call, unpack=unpack), args, *mb.TIMED_REPS["dequant"], 5)
    w = mb.DEQ_K * mb.DEQ_N / t
    out[unpack] = {"s_per_tile": t, "weights_per_s": w, "ops_per_weight": dequant_ops("bf16", unpack),
                   "dequant_op_rate": w * dequant_ops("bf16", unpack)}
print(json.dumps(out))
