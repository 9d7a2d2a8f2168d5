"""On the chip: the peer step (mk.perf.peer, tpu-inference's fused MoE kernel compiled by Mosaic) against
the CPU oracle, on mini-tp8 (mini's widths are below the kernel's 256-wide bf16 token packing).

    JAX_PLATFORMS=tpu,cpu python3 docs/tpu-v5e/peer_check.py      # prints JSON; exit 1 if a case fails

For each peer format (bf16, int8, int4) and B = 1, 3 (one padded row): 4 decode steps from empty
caches on the oracle's greedy tokens; the oracle is `mk.model.reference.decode_step` on JAX's CPU
backend given the experts the format stores (`peer.as_stored`), the peer step runs on the TPU. A case
passes within mk check's tolerances (max |logit error| <= LOGIT_TOL, every cache <= CACHE_TOL). The
fair XLA step on the chip against the bf16 oracle is printed beside it: what two correct programs
differ by on this chip. On CPU the same harness with the wheel's `ref_moe` in place of the kernel gave
0.03 (bf16) against the XLA step's 0.02 (tests/test_peer.py).
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mk.kernel.check import CACHE_TOL, LOGIT_TOL
from mk.model import reference
from mk.model.config import get_config
from mk.model.params import init
from mk.perf import baseline, peer

CFG = get_config("mini-tp8")


def main() -> int:
    cpu, chip = jax.devices("cpu")[0], jax.devices()[0]
    host = init(CFG, 0)
    oracle = jax.jit(lambda p, c, t: reference.decode_step(p, c, t, cfg=CFG))     # runs where its inputs live
    xla = baseline.make_baseline_step(CFG)
    on_chip = jax.device_put(host, chip)
    out, ok = [], True
    for fmt in peer.PEER_FORMATS:
        with jax.default_device(cpu):
            ref_params = jax.device_put(peer.as_stored(jax.device_put(host, cpu), CFG, fmt), cpu)
        step = peer.make_peer_step(CFG, fmt)
        pparams = peer.peer_params(on_chip, CFG, fmt)
        for batch in (1, 3):
            tok = np.random.default_rng(batch).integers(0, CFG.vocab, batch).astype(np.int32)
            with jax.default_device(cpu):
                rc = reference.init_cache(CFG, batch)
            pc, xc = jax.device_put(reference.init_cache(CFG, batch), chip), jax.device_put(reference.init_cache(CFG, batch), chip)
            row = {"format": fmt, "batch": batch, "logit_err": 0.0, "cache_err": 0.0, "xla_logit_err": None}
            for _ in range(4):
                with jax.default_device(cpu):
                    r_logits, rc = oracle(ref_params, rc, jnp.asarray(tok))
                p_logits, pc = step(pparams, pc, jax.device_put(tok, chip))
                r = np.asarray(r_logits)
                row["logit_err"] = max(row["logit_err"], float(np.max(np.abs(r - np.asarray(p_logits)))))
                row["cache_err"] = max(row["cache_err"], max(
                    float(np.max(np.abs(np.asarray(rc[n], np.float32) - np.asarray(pc[n], np.float32)))) for n in rc))
                if fmt == "bf16":
                    x_logits, xc = xla(on_chip, xc, jax.device_put(tok, chip))
                    row["xla_logit_err"] = max(row["xla_logit_err"] or 0.0, float(np.max(np.abs(r - np.asarray(x_logits)))))
                tok = r.argmax(-1).astype(np.int32)
            row["pass"] = row["logit_err"] <= LOGIT_TOL and row["cache_err"] <= CACHE_TOL
            ok &= row["pass"]
            out.append(row)
            print(f"peer_check: {row}", file=sys.stderr, flush=True)
    json.dump({"device": chip.device_kind, "config": "mini-tp8", "logit_tol": LOGIT_TOL, "cache_tol": CACHE_TOL,
               "cases": out, "pass": ok}, sys.stdout, indent=2)
    print()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
