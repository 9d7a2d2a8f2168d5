"""The CPU oracle's routing margins at the tokens a chip's verify check flagged (no TPU needed).

`mk check --speculative` on a TPU records each emitted token off the oracle's argmax (`greedy_flips`).
A flip whose logit gap is not a near tie can still be one rounding away: where the oracle's routing
margin (score + bias, k-th against k+1-th expert) is tiny in some MoE layer, the chip may route another
expert and move every logit. This script recomputes the oracle's margins at each flip, teacher-forced
along the emitted tokens (the record's `tokens`; a record without them, from before 2026-12-07c, is
followed along the oracle's own greedy tokens, which equal the emitted ones up to the first flip, so
only flips up to the first are read).

    python3 docs/tpu-v5e/verify_route_margins.py docs/tpu-v5e/2026-12-07c/check-mini-verify-b1.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", help="a check_speculative JSON record")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    from mk.kernel.check import ROUTE_NEAR_TIE, forced_logits, speculative_prompt
    from mk.kernel.plan import make_plan
    from mk.kernel.step import expert_k_chunk
    from mk.model import params as params_mod
    from mk.model import reference
    from mk.model.config import get_config
    import jax

    rec = json.load(open(args.record))
    cfg, batch, seed = get_config(rec["config"]), rec["batch"], rec.get("seed", 0)
    prompt_len = rec.get("prompt_len", rec["positions"][0])
    params = params_mod.init(cfg, seed)
    prompt = speculative_prompt(cfg, batch, prompt_len, seed)
    kc = expert_k_chunk(make_plan(cfg, batch * (1 + rec["k"]), ctx=256, check=False))
    if "tokens" in rec:
        emitted, upto = np.asarray(rec["tokens"], np.int32), None
    else:                                        # the oracle's greedy tokens: the emitted ones before the first flip
        emitted = np.asarray(reference.generate(params, cfg, prompt, rec["new_tokens"], ctx=256)["tokens"])
        upto = {b: min([f["position"] for f in rec["greedy_flips"] if f["sequence"] == b], default=-1)
                for b in range(batch)}
    rows = []
    for b in range(batch):
        logits, margins = forced_logits(cfg, params, prompt[b], emitted[b], ctx=256, device=jax.devices("cpu")[0],
                                        expert_k_chunk=kc, route_margins=True)
        for f in rec["greedy_flips"]:
            if f["sequence"] != b or (upto is not None and f["position"] > upto[b]):
                continue
            p = f["position"]
            top2 = np.sort(logits[p])[-2:]
            rows.append({"sequence": b, "position": p, "token": f["token"], "oracle_greedy": int(logits[p].argmax()),
                         "oracle_top_gap": float(top2[1] - top2[0]), "route_margin": float(margins[p].min()),
                         "moe_layer": int(margins[p].argmin()) + 1,
                         "routing_near_tie": bool(margins[p].min() < ROUTE_NEAR_TIE)})
    print(json.dumps({"source": args.record, "along": "emitted tokens" if upto is None else
                      "the oracle's greedy tokens (the emitted ones up to the first flip)",
                      "route_near_tie_below": ROUTE_NEAR_TIE, "flips": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
