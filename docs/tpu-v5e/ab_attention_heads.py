"""The MLA head loop on the chip: the kernel's step at B = 8 with 1 and 2048 attended tokens per
row, for each `ScheduleOptions.attention_heads` G given (heads attended per loop step), k3-chip,
bf16 experts (`mk.notebooks.helpers.kernel_sweep`: median, min and max of 20 steps, wall clock).

    python3 docs/tpu-v5e/ab_attention_heads.py 1 4 8 32 > $OUT/ab-attention-heads.json
    AB_CONFIG=mini AB_CONTEXTS=1,130 AB_STEPS=1 python3 docs/tpu-v5e/ab_attention_heads.py 1 2   # CPU smoke run
"""
import os
import json
import sys

import numpy as np

from mk.model.config import get_config
from mk.notebooks.helpers import init_params, kernel_sweep

cfg = get_config(os.environ.get("AB_CONFIG", "k3-chip"))
params, _ = init_params(cfg)
heads = [int(a) for a in sys.argv[1:]] or [1, 8]
points = [dict(batch=8, context=c, attention_heads=g) for g in heads for c in map(int, os.environ.get("AB_CONTEXTS", "1,2048").split(","))]
rows = kernel_sweep(params, cfg, points, steps=int(os.environ.get("AB_STEPS", 20)), warmup=int(os.environ.get("AB_STEPS", 3)))
for r in rows:
    print(f"G={r['attention_heads']} B={r['batch']} context={r['context']}: {r['median_ms']:.3f} ms "
          f"(min {r['min_ms']:.3f}, max {r['max_ms']:.3f}) {r['error'] or ''}", file=sys.stderr, flush=True)
print(json.dumps([{k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in r.items()}
                  for r in rows], indent=1, default=str))
