"""Deviceless TPU v5e LLO of one weight tile times an 8-row bf16 LHS, per way of feeding the MXU.

Each case is a Pallas kernel that multiplies x [8, 512] bf16 by one of two alternating [512, 512]
weight tiles in VMEM, `REPS` times in a `fori_loop` (the tile index is loop-carried, so nothing is
hoisted): one loop iteration is one tile. The script compiles every case for `v5e:2x2` without a
chip (libtpu's deviceless compiler, `LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR
--xla_jf_dump_llo_text=true`), reads each kernel's `final_bundles` (the scheduled VLIW bundles) and
counts the loop body: its bundles, its vector ALU ops (every `v*` op but loads, stores, MXU pushes,
matmuls and result pops), its MXU weight pushes, and the histogram of its vector ops. Cases:

  bf16            bf16 weights, `jnp.dot` (the MXU alone: no unpack)
  int4.dot        int4 weights, `jnp.dot(x, w_int4)` (what vLLM TPU's fused MoE kernel writes)
  int4.astype     the same with `w.astype(bf16)` written out
  mxfp4.UNPACK    mk's fused MXFP4 product (`mk.perf.microbench.dequant_call`), every unpack v5e lowers
  cand.NAME       candidate unpacks of E2M1 codes from the native int4 unpack (`CANDIDATES`);
                  cand.native_scale_only is a floor: the native unpack and the scale's one multiply
  floor.bf16_exponent  the other floor: int4 -> bf16 natively and one integer add of the scale's
                  exponent per pair of weights (no zero mask, no E2M1 mapping)

Run from the repo root, on any machine (no TPU needed):
    python3 docs/tpu-v5e/llo_unpack.py [--json] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from functools import partial
from pathlib import Path

REPS = 64                         # loop trips: enough that the loop is not unrolled
ROWS, K, N = 8, 512, 512


def _set_dump(dump: Path):
    """Ask libtpu for the scheduled bundles; must run before JAX initialises its TPU backend."""
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                      f" --xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---- the kernels --------------------------------------------------------------------------------
def _loop(o_ref, tile_product):
    import jax
    import jax.numpy as jnp
    o_ref[...] = jax.lax.fori_loop(0, REPS, lambda i, acc: acc + tile_product(i % 2),
                                   jnp.zeros(o_ref.shape, jnp.float32))


def _plain_kernel(x_ref, w_ref, o_ref, *, astype: bool):
    import jax.numpy as jnp

    def product(t):
        w = w_ref[t]
        w = w.astype(jnp.bfloat16) if astype else w
        return jnp.dot(x_ref[...], w, preferred_element_type=jnp.float32)
    _loop(o_ref, product)


def _candidate_kernel(x_ref, w_ref, s_ref, o_ref, *, name: str):
    """w_ref [2, K, N] int4 (re-encoded codes), s_ref [2, K / 128, N] int32 (mk's scale words)."""
    import jax
    import jax.numpy as jnp
    from mk.kernel.ring import group_exponents, _rows
    from mk.model.config import MX_GROUP

    def product(t):
        x = w_ref[t].astype(jnp.int32)                          # native unpack: sign-extended nibble
        e = _rows((group_exponents(s_ref.at[t]) - 1) << 23, MX_GROUP)   # [K, N] (s - 1) << 23
        w = CANDIDATES[name](x, e)                              # [K, N] f32 bit patterns
        w = jax.lax.bitcast_convert_type(w, jnp.float32)
        return jax.lax.dot_general(x_ref[...], w, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    _loop(o_ref, product)


def _native_select(x, e):
    """x: sign | k as a two's complement nibble (k: `pairs_nibble`'s magnitude index, zero at k = 1)
    -> f32 bits of value * 2^(s - 127): (e + k << 22) for k != 1, 0 for k = 1, sign from bit 31."""
    import jax.numpy as jnp
    k22 = (x << 22) & 0x01C00000
    mag = jnp.where(k22 == 1 << 22, 0, e + k22)
    return mag | (x & jnp.int32(-(1 << 31)))


def _native_denormal(x, e):
    """x: the E2M1 code itself as a two's complement nibble (sign | e | m) -> sign at bit 31, e, m at
    bits 23-24, 22: the f32 value(code) * 2^-126 (0.5's codes subnormal), then times 2^126 and
    2^(s - 127) in f32. Exact only where the VPU keeps subnormal inputs (a chip question)."""
    import jax
    import jax.numpy as jnp
    f = jax.lax.bitcast_convert_type((x << 22) & jnp.int32(-(1 << 31) | 0x01C00000), jnp.float32)
    scale = jax.lax.bitcast_convert_type(e + (1 << 23), jnp.float32)              # 2^(s - 127)
    return jax.lax.bitcast_convert_type(f * jnp.float32(2.0 ** 126) * scale, jnp.int32)


def _native_denormal_one_multiply(x, e):
    """As `_native_denormal` with one multiply, by 2^(s - 1): a bound only (2^(s - 1) is no f32 for
    s > 128)."""
    import jax
    import jax.numpy as jnp
    f = jax.lax.bitcast_convert_type((x << 22) & jnp.int32(-(1 << 31) | 0x01C00000), jnp.float32)
    scale = jax.lax.bitcast_convert_type(e + (127 << 23), jnp.float32)
    return jax.lax.bitcast_convert_type(f * scale, jnp.int32)


def _native_scale_only(x, e):
    """A floor, not an unpack: the native int4 -> f32 conversion and the one multiply by the group's
    2^(s - 127) that any exact scale in f32 costs, with no E2M1 mapping at all."""
    import jax
    import jax.numpy as jnp
    scale = jax.lax.bitcast_convert_type(e + (1 << 23), jnp.float32)
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32) * scale, jnp.int32)


CANDIDATES = {"native_select": _native_select, "native_denormal": _native_denormal,
              "native_denormal_one_multiply": _native_denormal_one_multiply,
              "native_scale_only": _native_scale_only}


def _bf16_exponent_kernel(x_ref, w_ref, s_ref, o_ref):
    """A floor in bf16: int4 -> bf16 natively (`w.astype(bf16)`), then one integer add per pair of
    weights (the group's exponent in both 16-bit halves, as 'pairs' lays it), no zero mask, no E2M1
    mapping. w_ref [2, K, N] int4, s_ref [2, K / 128, N] int32 (mk's scale words)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from mk.kernel.ring import group_exponents, _rows
    from mk.model.config import MX_GROUP

    def product(t):
        w = pltpu.bitcast(w_ref[t].astype(jnp.bfloat16), jnp.int32)                  # [K / 2, N] pairs
        e = (group_exponents(s_ref.at[t]) - 1) << 7
        w = w + _rows(e | (e << 16), MX_GROUP // 2)
        return jnp.dot(x_ref[...], pltpu.bitcast(w, jnp.bfloat16), preferred_element_type=jnp.float32)
    _loop(o_ref, product)


def cases():
    """[(name, pallas_call, abstract args)]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from mk.perf import microbench as mb

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    out = jax.ShapeDtypeStruct((ROWS, N), jnp.float32)
    x = jax.ShapeDtypeStruct((ROWS, K), jnp.bfloat16)

    def plain(name, dtype, astype=False):
        f = pl.pallas_call(partial(_plain_kernel, astype=astype), out_shape=out, in_specs=[vmem, vmem],
                           out_specs=vmem, name=f"llo_{name.replace('.', '_')}")
        return name, f, (x, jax.ShapeDtypeStruct((2, K, N), dtype))

    rows = [plain("bf16", jnp.bfloat16), plain("int4.dot", jnp.int4), plain("int4.astype", jnp.int4, True)]
    for unpack in mb.DEQUANT_UNPACKS:
        args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in mb.dequant_args(_rng(), unpack))
        rows.append((f"mxfp4.{unpack}", mb.dequant_call(REPS, unpack=unpack), args))
    for cand in CANDIDATES:
        f = pl.pallas_call(partial(_candidate_kernel, name=cand), out_shape=out, in_specs=[vmem] * 3,
                           out_specs=vmem, name=f"llo_cand_{cand}")
        rows.append((f"cand.{cand}", f, (x, jax.ShapeDtypeStruct((2, K, N), jnp.int4),
                                         jax.ShapeDtypeStruct((2, K // 128, N), jnp.int32))))
    f = pl.pallas_call(_bf16_exponent_kernel, out_shape=out, in_specs=[vmem] * 3, out_specs=vmem,
                       name="llo_floor_bf16_exponent")
    rows.append(("floor.bf16_exponent", f, (x, jax.ShapeDtypeStruct((2, K, N), jnp.int4),
                                            jax.ShapeDtypeStruct((2, K // 128, N), jnp.int32))))
    return rows


def _rng():
    import numpy as np
    return np.random.default_rng(0)


# ---- reading the bundles ------------------------------------------------------------------------
_OP = re.compile(r"= ([a-z][a-z0-9_.]*)|\{ ?([a-z][a-z0-9_.]*) ")
NOT_ALU = ("vld", "vst", "vmatpush", "vmatmul", "vpop", "vsyncpa", "vsyncadd", "vdelay", "vmov", "vphi")


def _ops(bundle: str) -> list[str]:
    """The opcodes of one bundle line ('%v1 = vadd.f32 ...;; %2 = vst ...')."""
    body = bundle.split("{", 1)[1] if "{" in bundle else ""
    ops = []
    for part in body.split(";;"):
        m = re.match(r"\s*(?:%[\w]+ = )?([a-z][a-z0-9_.]*)", part)
        if m:
            ops.append(m.group(1))
    return ops


def loop_bodies(text: str):
    """final_bundles text -> each loop's bundles (from an 'LB:' bundle to the next backward branch
    `sbr.rel`, delay slots excluded), each bundle as its list of opcodes, in program order."""
    lines = [l for l in text.splitlines() if re.match(r"\s*0x[0-9a-f]+|\s*\d+\s", l)]
    for start in (i for i, l in enumerate(lines) if " LB:" in l):
        end = next((i for i in range(start, len(lines)) if "sbr.rel" in lines[i]), None)
        if end is not None:
            yield [_ops(l) for l in lines[start:end + 1]]


def loop_body(text: str) -> list[list[str]]:
    """final_bundles text -> the first loop's bundles (`loop_bodies`): a one-loop kernel's tile."""
    return next(loop_bodies(text))


def count(bundles: list[list[str]]) -> dict:
    """Bundles, vector ALU ops, MXU pushes and the vector-op histogram of one loop body."""
    hist: dict[str, int] = {}
    for b in bundles:
        for op in b:
            if op.startswith("v"):
                hist[op] = hist.get(op, 0) + 1
    alu = sum(n for op, n in hist.items() if not op.startswith(NOT_ALU))
    pushes = sum(n for op, n in hist.items() if op.startswith("vmatpush"))
    full = sum(1 for b in bundles if sum(1 for op in b if op.startswith("v") and not op.startswith(NOT_ALU)) >= 4)
    return {"bundles": len(bundles), "vector_alu_ops": alu, "mxu_pushes": pushes,
            "bundles_with_4_alu_ops": full, "weights": K * N,
            "bundles_per_kweight": round(1000 * len(bundles) / (K * N), 4),
            "alu_ops_per_weight": round(alu / (K * N), 5),
            "ops": dict(sorted(hist.items(), key=lambda kv: -kv[1]))}


def final_bundles(dump: Path, kernel: str) -> Path:
    """The `final_bundles` dump of the custom call named `kernel`."""
    hits = sorted(p for p in dump.iterdir() if f"-{kernel}." in p.name and p.name.endswith("-final_bundles.txt")
                  and "schedule-analysis" not in p.name)
    if not hits:
        raise FileNotFoundError(f"no final_bundles for {kernel} under {dump}")
    return hits[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--keep", type=Path, help="dump directory to keep (default: a temporary one)")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--tile", default="512x512", help="the weight tile KxN (default 512x512, k3-chip's; the "
                    "depth family's plan takes 256x256)")
    a = ap.parse_args(argv)
    global K, N
    K, N = (int(v) for v in a.tile.lower().split("x"))
    dump = a.keep or Path(tempfile.mkdtemp(prefix="mk-llo-"))
    dump.mkdir(parents=True, exist_ok=True)
    _set_dump(dump)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax
    from mk.kernel.aot import _compile, _topology
    from mk.perf import microbench
    microbench.DEQ_K, microbench.DEQ_N = K, N                  # mk's cases at the same tile

    device = _topology("v5e:2x2").devices[0]
    res = {}
    for name, fn, args in cases():
        if a.only and name not in a.only.split(","):
            continue
        r = _compile(fn, args, device)
        if not r.compiled:
            res[name] = {"error": r.error}
            continue
        kernel = getattr(fn, "__name__", None) or name
        res[name] = count(loop_body(final_bundles(dump, _kernel_name(name)).read_text()))
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{'case':22} {'bundles':>8} {'ALU ops':>8} {'pushes':>7} {'4-ALU':>6}  per weight: bundles / ALU ops")
        for name, r in res.items():
            if "error" in r:
                print(f"{name:22} {r['error']}")
                continue
            print(f"{name:22} {r['bundles']:8d} {r['vector_alu_ops']:8d} {r['mxu_pushes']:7d} "
                  f"{r['bundles_with_4_alu_ops']:6d}  {r['bundles'] / r['weights']:.5f} / {r['alu_ops_per_weight']:.4f}")
    return 0


def _kernel_name(case: str) -> str:
    if case.startswith("mxfp4."):
        return f"mk_microbench_dequant_{case.split('.', 1)[1]}"
    return f"llo_{case.replace('.', '_')}"


if __name__ == "__main__":
    sys.exit(main())
