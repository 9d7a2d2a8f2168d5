"""`mk microbench`'s dequant family alone, on the chip: the fused MXFP4 tile product
(`mk.kernel.ring.mxfp4_tile_product`) per unpack, as JSON. Run from the repo root on the TPU VM:
    python3 docs/tpu-v5e/dequant_rate.py > dequant.json"""
import json

import jax
import numpy as np

from mk.perf import microbench as mb

out = {"device": jax.devices()[0].device_kind}
for unpack, r in mb.dequant_rates(np.random.default_rng(0)).items():
    out[unpack] = dict(r, dequant_op_rate=r["weights_per_s"] * r["ops_per_weight"])
print(json.dumps(out))
