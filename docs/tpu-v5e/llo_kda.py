"""Deviceless TPU v5e LLO of the KDA delta rule as the kernel runs it, per loop unroll.

The kernel's `kda_delta_rule` phase (`mk.kernel.kda`) runs `mk.model.layers.kda.kda_head` on one
(row, head) at a time: a [D, D] fp32 state in VMEM, elementwise ops, in a `fori_loop` over the heads
of each row. Its cost grows with B x heads x KDA layers, and on the v5e at 48 layers it is the phase
that grows most from B = 1 to B = 8 (docs/tpu-v5e/2026-12-06h: 0.147 -> 1.173 ms per step, 0.34 us
per (row, head)). The heads of a row are independent, so unrolling the loop lets the scheduler
interleave two heads' ops without changing either head's arithmetic (bit-exact).

This compiles the phase alone, B rows x H heads of k3-d48 (D 128), for `v5e:2x2` without a chip
(libtpu's deviceless compiler, as `llo_unpack.py`), once per unroll, and counts the bundles of the
heads loop's body (the scheduled VLIW bundles: one per cycle when nothing stalls), per head. Each
unroll is compiled twice: as the kernel runs it (beta broadcast across a head's lanes by an MXU
product with a one-hot matrix, per head), and with every head's sigmoid(beta) broadcast before the
loop ("beta_in_feat", a sixth feature row): what hoisting that broadcast would save.

    python3 docs/tpu-v5e/llo_kda.py [--unroll 1,2,3,4] [--heads 12] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llo_unpack import _set_dump, count, final_bundles, loop_body   # noqa: E402

D = 128


def _kernel(state_ref, feat_ref, beta_ref, o_norm_ref, out_ref, new_ref, *, heads, unroll, eps, beta_in_feat):
    import jax
    import jax.numpy as jnp
    from mk.model.layers.common import sigmoid
    from mk.model.layers.kda import kda_head

    lanes = jax.lax.broadcasted_iota(jnp.int32, (beta_ref.shape[1], D), 0)
    o_norm = o_norm_ref[0]

    def head(h, carry):
        off = pl_multiple(h * D)
        feat = lambda n: feat_ref[n, :, pl_ds(off, D)]                                  # [1, D]
        if beta_in_feat:                          # sigmoid(beta) of every head, broadcast before the loop
            beta = feat(5)
        else:                                     # the lane broadcast on the MXU, per head
            beta = sigmoid(jnp.dot(beta_ref[...], (lanes == h).astype(jnp.bfloat16),
                                   preferred_element_type=jnp.float32))                 # [1, D]
        out_ref[:, pl_ds(off, D)], new_ref[h] = kda_head(state_ref[h], *(feat(n) for n in range(4)), beta,
                                                         feat(4), o_norm, eps)
        return carry
    jax.lax.fori_loop(0, heads, head, 0, unroll=unroll)


def pl_multiple(x):
    from jax.experimental import pallas as pl
    return pl.multiple_of(x, D)


def pl_ds(start, size):
    from jax.experimental import pallas as pl
    return pl.ds(start, size)


def call(heads: int, unroll: int, beta_in_feat: bool = False):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    name = f"llo_kda_u{unroll}" + ("_bf" if beta_in_feat else "")
    f = pl.pallas_call(partial(_kernel, heads=heads, unroll=unroll, eps=1e-6, beta_in_feat=beta_in_feat),
                       out_shape=(jax.ShapeDtypeStruct((1, heads * D), jnp.bfloat16),
                                  jax.ShapeDtypeStruct((heads, D, D), jnp.float32)),
                       in_specs=[vmem] * 4, out_specs=(vmem, vmem), name=name)
    args = (jax.ShapeDtypeStruct((heads, D, D), jnp.float32), jax.ShapeDtypeStruct((6 if beta_in_feat else 5, 1, heads * D), jnp.float32),
            jax.ShapeDtypeStruct((1, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, D), jnp.float32))
    return f, args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unroll", default="1,2,3,4")
    ap.add_argument("--heads", type=int, default=12, help="heads of one row (k3-d48: 12)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    dump = Path(tempfile.mkdtemp(prefix="mk-llo-kda-"))
    _set_dump(dump)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mk.kernel.aot import _compile, _topology
    device = _topology("v5e:2x2").devices[0]
    res = {}
    for bf in (False, True):
        for u in (int(x) for x in a.unroll.split(",")):
            fn, args = call(a.heads, u, bf)
            r = _compile(fn, args, device)
            case = f"{u}" + (" beta_in_feat" if bf else "")
            if not r.compiled:
                res[case] = {"error": r.error}
                continue
            text = final_bundles(dump, f"llo_kda_u{u}" + ("_bf" if bf else "")).read_text()
            c = count(loop_body(text))
            c["heads_per_body"] = u
            c["bundles_per_head"] = round(c["bundles"] / u, 1)
            for k in ("weights", "bundles_per_kweight", "alu_ops_per_weight"):
                c.pop(k, None)
            res[case] = c
            print(f"unroll {case}: " + json.dumps({k: v for k, v in c.items() if k != "ops"}), file=sys.stderr)
    if a.json:
        from mk.perf.results import command_line, provenance
        per = ", ".join(f"{u} {c['bundles_per_head']}" for u, c in res.items() if "bundles_per_head" in c)
        record = provenance("llo", {"chip": "v5e", "phase": "kda_delta_rule", "heads": a.heads, "unroll": a.unroll},
                            f"KDA delta rule, bundles per head by unroll (deviceless v5e LLO, {a.heads} heads): {per}")
        record.update(chip="tpu-v5e", device_kind="deviceless compile (libtpu, v5e:2x2 topology) on a CPU host",
                      command=command_line("docs/tpu-v5e/llo_kda.py", argv))
        print(json.dumps({"record": record, "unroll": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
