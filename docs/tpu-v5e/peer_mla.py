"""Try tpu-inference's MLA decode kernel (kernels/mla/v1, `mla_ragged_paged_attention`: absorbed MLA
over a paged latent cache) at a K3 config's MLA decode shapes on the chip; a probe, not `mk bench`.

    JAX_PLATFORMS=tpu,cpu python3 docs/tpu-v5e/peer_mla.py [CONFIG] [--deviceless]   # JSON on stdout

K3's MLA has no RoPE (its qk_extra key part is raw and shared by the heads), so it maps onto the
absorbed form: ql_nope [B, H, kv_rank] = each head's nope query through its W_UK, q_pe [B, H, qk_extra]
= the query's extra part, new_kv_c = c_kv [B, kv_rank], new_k_pe = k_r [B, qk_extra], sm_scale =
1/sqrt(qk_head_dim); the output [B, H, kv_rank] then goes through W_UV, the output gate and o in XLA
(not timed here). Random inputs; each case: one decode token per row (distribution (B, B, B): all
rows decode-only) attending to CTX cached tokens in pages of 64, checked against the wheel's own
`ref_mla_ragged_paged_attention`, then timed (median wall clock of 50 calls, each to
block_until_ready). The cache it reads: B x CTX x (kv_rank + 128-padded qk_extra) bf16 values,
printed as `cache_bytes`, against mk's per-head K and V caches (`mk_cache_bytes`).
--deviceless compiles every case for one v5e core instead (no chip; `mk.kernel.aot`'s topology).
"""
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mk.model.config import get_config
from mk.perf import peer

PAGE = 64
MODULES = ("tpu_inference.kernels.ragged_paged_attention.v3.util", "tpu_inference.kernels.mla.v1.kernel")


def inputs(mod, cfg, B: int, ctx: int, abstract: bool):
    """The kernel's arguments for B decode rows at ctx cached tokens (the new one included); an odd B
    is padded with an empty sequence (no query, no cached token: the kernel asserts on one row)."""
    H, L, R = cfg.heads, cfg.kv_rank, cfg.qk_extra
    T = B + B % 2
    pages = -(-ctx // PAGE)
    shapes = {"ql_nope": ((T, H, L), jnp.bfloat16), "q_pe": ((T, H, R), jnp.bfloat16),
              "new_kv_c": ((T, L), jnp.bfloat16), "new_k_pe": ((T, R), jnp.bfloat16),
              "cache_kv": (mod.get_kv_cache_shape(T * pages, PAGE, L + R, jnp.bfloat16), jnp.bfloat16)}
    kv_lens = np.zeros(T, np.int32)
    kv_lens[:B] = ctx
    cu_q_lens = np.minimum(np.arange(T + 1), B).astype(np.int32)
    ints = {"kv_lens": kv_lens, "page_indices": np.arange(T * pages, dtype=np.int32),
            "cu_q_lens": cu_q_lens, "distribution": np.array([B, B, B], np.int32)}
    if abstract:
        return ({k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
                | {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in ints.items()})
    keys = jax.random.split(jax.random.key(B * 7919 + ctx), len(shapes))
    out = {k: (jax.random.normal(key, s, jnp.float32) * 0.5).astype(d) for key, (k, (s, d)) in zip(keys, shapes.items())}
    return out | {k: jnp.asarray(v) for k, v in ints.items()}


def main(argv) -> int:
    deviceless = "--deviceless" in argv
    names = [a for a in argv if not a.startswith("--")]
    cfg = get_config(names[0] if names else "k3-chip")
    mod = peer.load_modules(*MODULES)[-1]
    rows = []
    for ctx in (256, 2048):
        pages = -(-ctx // PAGE)
        tune = {"sm_scale": cfg.mla_scale, "num_kv_pages_per_block": min(pages, 8), "num_queries_per_block": 1}
        fn = jax.jit(lambda a: mod.mla_ragged_paged_attention(**a, **tune))
        for B in (1, 2, 4, 8):
            row = {"batch": B, "ctx": ctx, "heads": cfg.heads,
                   "cache_bytes": B * ctx * (cfg.kv_rank + 128) * 2,
                   "mk_cache_bytes": B * cfg.heads * ctx * (cfg.k_cache_dim + cfg.head_dim) * 2}
            try:
                if deviceless:
                    from jax.sharding import SingleDeviceSharding
                    from mk.kernel.aot import _topology
                    dev = _topology("v5e:2x2").devices[0]
                    args = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=SingleDeviceSharding(dev))
                            for k, s in inputs(mod, cfg, B, ctx, True).items()}
                    t0 = time.perf_counter()
                    with jax.default_device(dev):
                        fn.lower(args).compile()
                    row["compile_s"] = time.perf_counter() - t0
                else:
                    a = inputs(mod, cfg, B, ctx, False)
                    out = jax.block_until_ready(fn(a))
                    ref = mod.ref_mla_ragged_paged_attention(**a, sm_scale=cfg.mla_scale)
                    o, r = (np.asarray(x[0][:B], np.float32) for x in (out, ref))
                    row["max_abs_err_vs_ref"] = float(np.max(np.abs(o - r)))
                    row["ref_max_abs"] = float(np.max(np.abs(r)))
                    times = []
                    for _ in range(50):
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(a))
                        times.append(time.perf_counter() - t0)
                    row["median_ms"] = statistics.median(times) * 1e3
            except Exception as e:                       # say why and go on
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            rows.append(row)
            print(f"peer_mla: {row}", file=sys.stderr, flush=True)
    json.dump({"config": names[0] if names else "k3-chip", "device": None if deviceless else jax.devices()[0].device_kind,
               "page_size": PAGE, "rows": rows}, sys.stdout, indent=2)
    print()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
