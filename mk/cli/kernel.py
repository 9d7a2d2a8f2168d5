"""`check` (kernel vs reference in interpret mode), `aot` (deviceless TPU compile of the sharded
step for a topology) and `compile-time` (compile time vs depth, megakernel and XLA reference).

`check` exits 0 when the kernel agrees with the reference within the tolerances of `mk.kernel.check`
(printed with the result, and in its JSON with `verdict` and `reasons`), 1 when it does not, and 2
for bad input.
"""
from __future__ import annotations

import json
import math

from mk.cli.common import (add_cache_option, add_step_options, ctx_int, int_list, nonnegative_int, positive_float,
                           positive_int, progress, step_options, use_cache)
from mk.errors import UserError


def add_parser(sub):
    p = sub.add_parser("check", help="run kernel and reference side by side; print their differences",
                       description="Kernel vs reference (TPU interpret mode on CPU). Exit 0: within the "
                                   "tolerances of mk.kernel.check; 1: outside them; 2: bad input.")
    p.add_argument("--config", default="mini")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--steps", type=positive_int, default=8)
    p.add_argument("--prefetch-depth", type=nonnegative_int, default=None)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--ctx", type=ctx_int, default=256, help="cache capacity, a multiple of 128")
    p.add_argument("--no-races", action="store_true", help="disable the race detector (faster)")
    p.add_argument("--dma-mode", choices=["on_wait", "eager"], default="on_wait")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="the kernel's routed experts: MXFP4 (the random weights quantized as `mk synth` "
                        "writes them, packed in HBM, dequantized in VMEM; the reference runs on their "
                        "dequantization) or bf16 tiles")
    p.add_argument("--speculative", type=positive_int, default=None, metavar="K",
                   help="instead: greedy speculative decoding through the kernel's verify step (K drafts "
                        "per step, a test drafter agreeing with probability --agree) against plain greedy "
                        "decoding, --batch sequences of --new-tokens tokens after --prompt-len token prompts "
                        "(on a TPU: each token against the CPU oracle teacher-forced along them)")
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--prompt-len", type=positive_int, default=100)
    p.add_argument("--agree", type=float, default=0.6)
    p.add_argument("--exact", action="store_true",
                   help="pass only if every logit and cache element is bit-identical to the reference "
                        "(what mk claims in interpret mode on CPU)")
    p.add_argument("--fault", choices=("moe_combine_sign",), default=None,
                   help="check a deliberately broken kernel (routed experts combined with negated weights): "
                        "shows the check fails a wrong kernel; exit 1 expected")
    p.add_argument("--json", action="store_true")
    add_step_options(p)
    add_cache_option(p)
    p.set_defaults(func=run_check)

    p = sub.add_parser("aot", help="compile one decode step for a TPU topology on this machine")
    p.add_argument("--config", default="mini")
    p.add_argument("--topology", default="tpu7x:2x2x1")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--prefetch-depth", type=nonnegative_int, default=None)
    p.add_argument("--num-slots", type=positive_int, default=None)
    p.add_argument("--tile", type=str, default=None, help="TKxTN, e.g. 512x512")
    p.add_argument("--ctx", type=ctx_int, default=256, help="cache capacity, a multiple of 128")
    p.add_argument("--layers", type=positive_int, default=None, help="override the config's layer count")
    p.add_argument("--num-experts", type=positive_int, default=None, help="override the config's routed experts")
    p.add_argument("--reference", action="store_true",
                   help="compile the XLA reference (mk.model.reference_sharded over the same mesh) instead")
    p.add_argument("--force", action="store_true", help="compile even if the plan refuses (VMEM)")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="routed experts' storage: packed MXFP4 (the checkpoint's format, dequantized in "
                        "VMEM) or bf16 tiles")
    p.add_argument("--no-vmem-probe", action="store_true",
                   help="skip the second compile, under a VMEM limit of the plan's budget (vmem_compiler_fits)")
    p.add_argument("--json", action="store_true")
    add_step_options(p)
    p.set_defaults(func=run_aot)

    p = sub.add_parser("compile-time", help="lower + deviceless-compile stacks of several depths",
                       description="Megakernel (and XLA reference) compile time vs depth, each compile in "
                                   "its own process, killed after --timeout minutes. Exit 0 when every "
                                   "megakernel compile succeeded.")
    p.add_argument("--config", default="k3")
    p.add_argument("--layers", default="4,24,93", help="comma-separated layer counts")
    p.add_argument("--num-experts", type=positive_int, default=None, help="override the routed experts")
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="routed experts' storage: packed MXFP4 (the checkpoint's format) or bf16 tiles")
    p.add_argument("--topology", default="tpu7x:4x4x1")
    p.add_argument("--mesh", type=positive_int, default=None, metavar="N",
                   help="cores of --topology to compile for (default: the most that the config divides)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--reference", action="store_true", help="also compile the XLA reference (slow)")
    p.add_argument("--reference-layers", default=None,
                   help="depths for the XLA reference (default: the deepest of --layers)")
    p.add_argument("--timeout", type=positive_float, default=10.0, metavar="MIN",
                   help="minutes per compile before it is killed and reported as 'more than MIN min'")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_compile_time)


def _chip(topology: str) -> str:
    from mk.kernel.aot import chip_of
    try:
        return chip_of(topology)
    except ValueError as e:
        raise UserError(f"--topology: {e}") from None


def _tile(text: str | None):
    if not text:
        return None
    parts = text.lower().split("x")
    try:
        tile = tuple(int(x) for x in parts)
    except ValueError:
        tile = ()
    if len(tile) != 2 or min(tile) < 1:
        raise UserError(f"--tile: expected TKxTN with positive integers, e.g. 512x512, found {text!r}")
    return tile


def _config(name, layers=None):
    from mk.model.config import get_config
    cfg = get_config(name)
    if layers and layers != cfg.layers:
        cfg = stacked(cfg, layers)
    return cfg


def stacked(cfg, layers: int):
    """cfg with `layers` layers, MLA every 4th (l % 4 == 3) and at the last layer, as in K3."""
    full = tuple(sorted(set(range(3, layers, 4)) | {layers - 1}))
    return cfg.replace(layers=layers, full_attention=full)


def run_check(args) -> int:
    cfg = _config(args.config)
    use_cache(args)
    from mk.kernel.check import check
    from mk.kernel.plan import make_plan

    if args.speculative:
        return _run_check_speculative(cfg, args)
    if args.steps > args.ctx:
        raise UserError(f"--steps ({args.steps}) exceed --ctx {args.ctx}")
    kw = {} if args.prefetch_depth is None else {"prefetch_depth": args.prefetch_depth}
    layout = _layout(cfg, args.mesh)
    from mk.kernel.step import attached_chip
    from mk.kernel.decode import on_tpu
    make_plan(cfg, args.batch, ctx=args.ctx, check=False, layout=layout, experts=args.experts or "mxfp4",
              chip=attached_chip(), **step_options(args), **kw)   # bad input: before any work
    _enough_devices(args.mesh)
    from mk.kernel.step import fits_attached_chip
    if args.exact and on_tpu():
        raise UserError("--exact: bit-identity is the CPU claim (interpret mode); on a TPU the check compares "
                        "the kernel with XLA on the chip")
    fits_attached_chip(cfg, args.experts or "mxfp4", batch=args.batch, ctx=args.ctx)
    res = check(cfg, args.batch, args.steps, args.prefetch_depth, seed=args.seed,
                ctx=args.ctx, detect_races=not args.no_races, dma_execution_mode=args.dma_mode,
                progress=not args.json, mesh=args.mesh or 1, experts=args.experts, all_reduce=args.all_reduce,
                mxfp4_matmul=args.mxfp4_matmul, mxfp4_unpack=args.mxfp4_unpack, exact=args.exact,
                fault=args.fault)
    if args.json:
        from mk.perf.results import provenance
        key = {"config": args.config, "experts": res.get("experts"), "batch": args.batch, "mesh": args.mesh or 1}
        if args.fault:
            key["fault"] = args.fault
        err = lambda k: "-" if res.get(k) is None else format(res[k], ".4g")
        summary = (f"{res['verdict']}; max logit error kernel {err('max_abs_logit_err')}"
                   + (f" / XLA {err('xla_max_abs_logit_err')}" if "xla_max_abs_logit_err" in res else "")
                   + f" over {args.steps} steps ({res.get('mode', '')})")
        rec = {"record": provenance("check", key, summary)}
        print(json.dumps(_finite(rec | res), indent=1, allow_nan=False))
    else:
        for k, v in res.items():
            if k not in ("per_step", "reasons", "verdict"):
                print(f"{k:>26}: {v}")
        print(f"{'verdict':>26}: {res['verdict']}" + "".join(f"\n{'':>28}{r}" for r in res["reasons"]))
    return 0 if res["verdict"] == "pass" else 1


def _run_check_speculative(cfg, args) -> int:
    from mk.kernel.check import check_speculative
    from mk.kernel.plan import make_plan

    k = args.speculative
    if args.prompt_len + args.new_tokens + k + 1 > args.ctx:
        raise UserError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} + k + 1 exceed --ctx {args.ctx}")
    if not 0.0 <= args.agree <= 1.0:
        raise UserError(f"--agree must lie in [0, 1], found {args.agree}")
    make_plan(cfg, args.batch, ctx=args.ctx, check=False, layout=_layout(cfg, args.mesh), k=k)   # bad k: first
    _enough_devices(args.mesh)
    res = check_speculative(cfg, k, args.new_tokens, batch=args.batch, mesh=args.mesh or 1,
                            prompt_len=args.prompt_len, agree=args.agree, seed=args.seed, ctx=args.ctx,
                            detect_races=not args.no_races)
    res["config"] = args.config
    if args.json:
        from mk.kernel.check import far_from_tie
        from mk.perf.results import provenance
        far = len(far_from_tie(res.get("greedy_flips", [])))
        summary = (f"{res['verdict']}; {args.batch} x {res['new_tokens']} tokens, k = {k}, {res['full']} / "
                   f"{res['partial']} / {res['zero']} steps of full / partial / no acceptance; "
                   + (f"{len(res['greedy_flips'])} token(s) off the oracle's argmax, {far} away from a near tie; "
                      f"max logit error kernel {res['max_abs_logit_err']:.4g} / XLA {res['xla_max_abs_logit_err']:.4g} "
                      f"over the positions not at a routing near tie ({len(res.get('route_near_ties', []))})"
                      if res["policy"] == "chip" and "greedy_flips" in res else
                      "tokens equal to plain greedy" if res["tokens_equal"] else
                      f"tokens differ from plain greedy (first difference per sequence {res['first_difference']})"))
        key = {"config": args.config, "batch": args.batch, "k": k, "mesh": args.mesh or 1}
        print(json.dumps(_finite({"record": provenance("check_speculative", key, summary)} | res), indent=1,
                         allow_nan=False))
    else:
        for key, v in res.items():
            if key not in ("reasons", "verdict"):
                print(f"{key:>18}: {v}")
        print(f"{'verdict':>18}: {res['verdict']}" + "".join(f"\n{'':>20}{r}" for r in res["reasons"]))
    return 0 if res["verdict"] == "pass" else 1


def _layout(cfg, mesh):
    """The plan layout of `--mesh N` (one device without it); a mesh that does not divide the
    config is a PlanError naming the width at fault."""
    from mk.model.layout import Layout
    from mk.model.sharding import default_layout
    return default_layout(cfg, mesh) if mesh and mesh > 1 else Layout()


def _enough_devices(mesh):
    if mesh and mesh > 1:
        import jax
        if jax.device_count() < mesh:
            raise UserError(f"--mesh {mesh}: only {jax.device_count()} devices available")


def _finite(x):
    """JSON has no NaN / Infinity: such floats become null (the result says why, e.g. `nan_arrays`)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def aot_devices(cfg, topology: str, mesh: int | None) -> int:
    """Cores to compile for: `--mesh`, or the most of `topology`'s that the config divides
    (`mk.model.sharding.gcd_devices`: all 32 of tpu7x:4x4x1 for K3)."""
    if mesh:
        return mesh
    from mk.kernel.aot import topology_devices
    from mk.model.sharding import gcd_devices
    return gcd_devices(cfg, topology_devices(topology))


def _weights_table(plan) -> dict:
    from mk.kernel.aot import kernel_weight_shapes
    return {k: {"shape_per_device": list(s), "dtype": str(d), "bytes_per_device": int(math.prod(s)) * d.itemsize}
            for k, (s, d) in kernel_weight_shapes(plan).items()}


def run_aot(args) -> int:
    from mk.kernel.aot import compile_kernel, compile_reference
    from mk.perf.hardware import hbm_per_core
    from mk.kernel.plan import COMPILER_ALLOWANCE, make_plan
    from mk.kernel.schedule import collectives_per_step, remote_bytes_per_step, routed_expert_bytes_per_step
    from mk.model.layout import PlanError
    cfg = _config(args.config, args.layers)
    if args.num_experts:
        cfg = cfg.replace(experts=args.num_experts, top_k=min(cfg.top_k, args.num_experts))
    chip = _chip(args.topology)
    devices = aot_devices(cfg, args.topology, args.mesh)
    hbm_chip = hbm_per_core(chip)
    out = {"config": args.config, "layers": cfg.layers, "experts": cfg.experts, "topology": args.topology,
           "batch": args.batch, "devices": devices}
    if args.reference:
        _layout(cfg, devices)                      # a mesh that does not divide the config: error first
        r = compile_reference(cfg, args.batch, args.topology, args.ctx, devices=devices)
        out.update(program="xla_reference")
    else:
        kw = {}
        if args.prefetch_depth is not None:
            kw["prefetch_depth"] = args.prefetch_depth
        if args.num_slots is not None:
            kw["num_slots"] = args.num_slots
        if args.tile:
            kw["tile"] = _tile(args.tile)
        plan = make_plan(cfg, args.batch, chip=chip, ctx=args.ctx, check=False, layout=_layout(cfg, devices),
                         experts=args.experts, **step_options(args), **kw)
        out.update(program="megakernel", expert_format=plan.experts, expert_bytes=plan.expert_bytes,
                   routed_expert_bytes_per_step=routed_expert_bytes_per_step(plan),
                   collectives_per_step=collectives_per_step(plan),
                   remote_bytes_per_step=remote_bytes_per_step(plan),
                   vmem_planned_bytes=plan.vmem_planned_bytes,
                   vmem_planned_buffers_bytes=plan.vmem_planned_bytes - COMPILER_ALLOWANCE,
                   vmem_limit_bytes=plan.vmem_limit, prefetch_depth=plan.prefetch_depth,
                   num_slots=plan.num_slots, tile=[plan.tile_k, plan.tile_n], weights=_weights_table(plan))
        try:
            plan.check_vmem()
            out["plan_fits"] = True
        except PlanError as e:
            out["plan_fits"] = False
            out["plan_error"] = str(e)
            if not args.force:
                out.update(compiled=False, compile_s=0.0, error=str(e))
                _print(out, args.json)
                return 2
        r = compile_kernel(plan, args.topology, probe_vmem=not args.no_vmem_probe)
        if r.vmem_check is not None:
            out.update(vmem_compiler_limit_bytes=r.vmem_check["limit_bytes"], vmem_compiler_fits=r.vmem_check["fits"],
                       vmem_compiler_error=r.vmem_check["error"])
    hbm = r.hbm_bytes if r.compiled else r.hbm_required_bytes
    out.update(compiled=r.compiled, compile_s=round(r.compile_s, 3), lower_s=round(r.lower_s, 3),
               total_s=round(r.total_s, 3), error=r.error, pallas_calls_per_step=r.pallas_calls,
               mosaic_ops_per_step=r.mosaic_ops,
               hbm_chip_bytes_per_device=int(hbm_chip),
               hbm_argument_bytes_per_device=r.argument_bytes,
               hbm_bytes_per_device=hbm,
               hbm_source=("compiled.memory_analysis(): arguments + outputs - aliased + temporaries" if r.compiled
                           else "the compiler's out-of-HBM message (required)" if hbm is not None else None),
               hbm_compiler_available_bytes=r.hbm_available_bytes,
               hbm_within_budget=(hbm <= hbm_chip if hbm is not None and r.hbm_available_bytes is None
                                  else False if hbm is not None else None),
               memory=r.memory)
    _print(out, args.json)
    return 0 if r.compiled else 1


def _print(out, as_json):
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            if k == "weights":
                for name, w in v.items():
                    print(f"{'weights.' + name:>28}: {w['dtype']}{w['shape_per_device']} per device, "
                          f"{w['bytes_per_device'] / 2**30:.2f} GiB")
                continue
            if isinstance(v, int) and ("bytes" in k):
                v = f"{v} ({v / 2**30:.2f} GiB)" if v >= 2**30 else f"{v} ({v / 2**20:.2f} MiB)"
            print(f"{k:>28}: {v}")


def _compile_row_in_process(cfg, program, topology, batch, devices, chip, expert_format="mxfp4"):
    from mk.kernel.aot import compile_kernel, compile_reference
    from mk.kernel.plan import make_plan
    if program == "xla_reference":
        r = compile_reference(cfg, batch, topology, devices=devices)
    else:
        r = compile_kernel(make_plan(cfg, batch, chip=chip, layout=_layout(cfg, devices), experts=expert_format), topology)
    return {"compiled": r.compiled, "timed_out": False, "lower_s": round(r.lower_s, 3),
            "compile_s": round(r.compile_s, 3), "total_s": round(r.total_s, 3), "error": r.error,
            "pallas_calls": r.pallas_calls, "mosaic_ops": r.mosaic_ops}


def _compile_row_subprocess(config: str, layers: int, experts, program, topology, batch, devices, timeout_s,
                            expert_format: str = "mxfp4"):
    """One `mk aot --json` in its own process group, killed after timeout_s (a compile that
    does not finish is a result: `timed_out`, `more_than_s`)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    cmd = [sys.executable, "-m", "mk", "aot", "--config", config, "--layers", str(layers), "--topology", topology,
           "--batch", str(batch), "--mesh", str(devices), "--json", "--no-vmem-probe"]
    if experts:
        cmd += ["--num-experts", str(experts)]
    cmd += ["--experts", expert_format]
    if program == "xla_reference":
        cmd.append("--reference")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"compiled": None, "timed_out": True, "lower_s": None, "compile_s": None, "total_s": None,
                "more_than_s": timeout_s, "error": f"killed after {timeout_s / 60:g} min", "pallas_calls": None,
                "wall_s": round(time.perf_counter() - t, 1)}
    try:
        r = json.loads(stdout)
    except ValueError:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return {"compiled": False, "timed_out": False, "lower_s": None, "compile_s": None, "total_s": None,
                "error": f"mk aot exited {proc.returncode}: {tail}", "pallas_calls": None,
                "wall_s": round(time.perf_counter() - t, 1)}
    return {"compiled": r["compiled"], "timed_out": False, "lower_s": r["lower_s"], "compile_s": r["compile_s"],
            "total_s": r["total_s"], "error": r["error"], "pallas_calls": r["pallas_calls_per_step"],
            "mosaic_ops": r.get("mosaic_ops_per_step"), "hbm_bytes_per_device": r["hbm_bytes_per_device"], "hbm_within_budget": r["hbm_within_budget"],
            "wall_s": round(time.perf_counter() - t, 1)}


def compile_times(config, layers, *, experts=None, expert_format="mxfp4", topology="tpu7x:2x2x1", batch=1, reference=False,
                  reference_layers=None, mesh: int | None = None, timeout_s: float | None = None,
                  show_progress: bool = False):
    """[{layers, program, devices, lower_s, compile_s, total_s, compiled, timed_out, ...}] for
    each depth (measured here, deviceless: the TPU compiler running on this CPU).

    config: a preset name or checkpoint directory (or a K3Config, in process only). mesh: cores of
    `topology` (default: the most the config divides). reference: also the XLA reference, at
    `reference_layers` (default: every depth). timeout_s: run each compile in its own process and
    kill it after that long (its row then says `timed_out`, `more_than_s`); None: in this process.
    A compile the compiler refuses (e.g. out of HBM) still has its time: the time to the verdict.
    """
    from mk.model.config import K3Config
    chip = _chip(topology)
    base = _config(config)
    if experts:
        base = base.replace(experts=experts, top_k=min(base.top_k, experts))
    devices = aot_devices(base, topology, mesh)
    if timeout_s is not None and isinstance(config, K3Config):
        raise UserError("compile_times: a timeout runs each compile in its own process, which needs the "
                        "config by name or checkpoint directory")
    ref_layers = list(layers) if reference_layers is None else list(reference_layers)
    cfgs = []
    for L in sorted(set(layers) | (set(ref_layers) if reference else set())):   # every config first
        cfg = _config(base, L)
        _layout(cfg, devices)
        cfgs.append((L, cfg))
    jobs = [(L, "megakernel", cfg) for L, cfg in cfgs if L in layers]
    if reference:
        jobs += [(L, "xla_reference", cfg) for L, cfg in cfgs if L in ref_layers]
    rows = []
    bar = progress(jobs, desc="compile", unit="program", enabled=show_progress)
    for L, name, cfg in bar:
        bar.set_postfix_str(f"{name} layers={L}")
        if timeout_s is None:
            r = _compile_row_in_process(cfg, name, topology, batch, devices, chip, expert_format)
        else:
            r = _compile_row_subprocess(config, L, experts, name, topology, batch, devices, timeout_s, expert_format)
        rows.append({"layers": L, "program": name, "devices": devices, **r})
    return rows


def compile_time_summary(rows) -> dict:
    """Per program: deepest / shallowest total time (None unless both compiled: a compile that
    timed out or that the compiler refused, e.g. out of HBM before Mosaic ran, has no comparable time)."""
    by = {}
    for r in rows:
        by.setdefault(r["program"], []).append(r)
    out = {}
    for p, rs in by.items():
        rs = sorted(rs, key=lambda r: r["layers"])
        a, b = rs[0]["total_s"], rs[-1]["total_s"]
        both = rs[0]["compiled"] and rs[-1]["compiled"] and len(rs) > 1   # a refusal's time is no compile time
        out[p] = {"shallowest": rs[0]["layers"], "deepest": rs[-1]["layers"],
                  "ratio_deepest_vs_shallowest": b / a if both else None,
                  "max_total_s": max((r["total_s"] for r in rs if r["total_s"] is not None), default=None),
                  "all_finished": all(not r["timed_out"] for r in rs)}
    return out


def _seconds(r) -> str:
    if r["timed_out"]:
        return f"more than {r['more_than_s'] / 60:g} min"
    return "-" if r["total_s"] is None else f"{r['total_s']:.1f} s"


def run_compile_time(args) -> int:
    layers = int_list(args.layers, "--layers", low=1)
    ref_layers = int_list(args.reference_layers, "--reference-layers", low=1) if args.reference_layers else [max(layers)]
    rows = compile_times(args.config, layers, experts=args.num_experts, expert_format=args.experts,
                         topology=args.topology, batch=args.batch,
                         reference=args.reference, reference_layers=ref_layers, mesh=args.mesh,
                         timeout_s=args.timeout * 60, show_progress=True)
    summary = compile_time_summary(rows)
    out = {"config": args.config, "topology": args.topology, "devices": rows[0]["devices"], "batch": args.batch,
           "timeout_s": args.timeout * 60, "measured": "deviceless TPU compile on this CPU, one process per compile",
           "runs": rows, "summary": summary}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{args.config} on {args.topology} ({rows[0]['devices']} cores), batch {args.batch}; "
              f"lower + compile, deviceless on this CPU")
        print(f"{'program':>14} {'layers':>6} {'lower':>9} {'compile':>9} {'total':>18} {'Mosaic ops':>10}  verdict")
        for r in rows:
            lo = "-" if r["lower_s"] is None else f"{r['lower_s']:.1f} s"
            co = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f} s"
            ops = "-" if not r.get("mosaic_ops") else str(r["mosaic_ops"])
            verdict = ("timed out" if r["timed_out"] else "compiled" if r["compiled"]
                       else f"refused: {(r['error'] or '')[:90]}")
            print(f"{r['program']:>14} {r['layers']:>6} {lo:>9} {co:>9} {_seconds(r):>18} {ops:>10}  {verdict}")
        for p, s in summary.items():
            if s["ratio_deepest_vs_shallowest"] is not None:
                print(f"{p}: {s['deepest']} layers / {s['shallowest']} layers = {s['ratio_deepest_vs_shallowest']:.2f}x")
    return 0 if all(r["compiled"] for r in rows if r["program"] == "megakernel") else 1
