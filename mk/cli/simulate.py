"""`python -m mk simulate`: predicted K3 decode throughput next to the published figures.

For each batch size: the step time and tokens/s of both schedules (megakernel, conventional)
simulated on one device's share of the system (`mk.sim`), the roofline floors (`mk.roofline`),
and the published figure with the ratio predicted / published for the schedule the published
system ran (TPU v7: megakernel; GB200: conventional, i.e. vLLM's one-kernel-per-op stack).
"""
from __future__ import annotations

import json
import sys

from mk.cli.common import positive_int
from mk.errors import UserError


def add_parser(subparsers):
    p = subparsers.add_parser("simulate", help="predict K3 decode step time / tokens/s with the schedule simulator",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", default="k3", help="preset name or checkpoint directory (default: k3)")
    p.add_argument("--system", default="tpu-v7x16",
                   help="tpu-v7x16 | gb200x16, or both comma-separated (default: tpu-v7x16)")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes (default: 1,2,4,8)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="mean attended tokens per sequence (default: 512, the benchmark's mean position)")
    p.add_argument("--mean-experts", action="store_true",
                   help="use the mean distinct experts per device instead of the slowest expert-parallel group")
    p.add_argument("--sensitivity", action="store_true",
                   help="also show predictions under alternative measured values (latency range, expert counts, ...)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--batch: expected comma-separated integers, found {text!r}") from None
    if not out or any(b < 1 or b > 64 for b in out):
        raise UserError(f"--batch: batch sizes must be in 1..64, found {text!r}")
    return out


def collect(config: str, systems: list[str], batches: list[int], context: int | None = None,
            straggler: bool = True) -> list[dict]:
    from mk.config import get_config
    from mk import hardware, sim

    cfg = get_config(config)
    ctx = sim.DEFAULT_CONTEXT if context is None else context
    out = []
    for name in systems:
        if name not in hardware.SYSTEMS:
            raise UserError(f"--system: unknown system {name!r}; expected one of {list(hardware.SYSTEMS)}")
        system = hardware.get_system(name)
        rows = []
        for b in batches:
            r = sim.predict(cfg, b, name, context=ctx, straggler=straggler)
            rows.append({k: v for k, v in r.items() if not k.startswith("_")})
        plan = sim.build_plan(cfg, batches[0], system=system, context=ctx, straggler=straggler)
        out.append({
            "config": config, "system": name, "schedule": system.schedule, "context": ctx,
            "straggler": straggler, "layout": getattr(plan.layout, "name", ""),
            "device": {"dma_bw": system.dma_bw, "hbm_bw": system.hbm_bw, "bf16_flops": system.peak_flops("bf16"),
                       "collective_latency": system.collective_latency, "launch_gap": system.launch_gap,
                       "step_overhead": system.step_overhead},
            "sources": dict(system.sources),
            "rows": rows,
        })
    return out


def format_table(report: list[dict]) -> str:
    lines = []
    for sysrep in report:
        lines.append(f"{sysrep['system']}  ({sysrep['layout']}); published figure ran the "
                     f"{sysrep['schedule']} schedule; context {sysrep['context']}; "
                     f"experts per device: {'slowest EP group' if sysrep['straggler'] else 'mean'}")
        hdr = (f"{'B':>3} | {'megakernel':>17} | {'conventional':>17} | {'floors ms: hbm / comp / coll':>29} | "
               f"{'ceiling':>8} | {'published':>9} | {'ratio':>5}")
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for r in sysrep["rows"]:
            mk, cv, rf = r["megakernel"], r["conventional"], r["roofline"]
            pub = r["published_tok_s"]
            lines.append(
                f"{r['batch']:>3} | {mk['step_time_s'] * 1e3:6.2f} ms {mk['tokens_per_s']:5.0f}/s | "
                f"{cv['step_time_s'] * 1e3:6.2f} ms {cv['tokens_per_s']:5.0f}/s | "
                f"{rf['t_hbm_s'] * 1e3:8.2f} / {rf['t_compute_s'] * 1e3:5.3f} / {rf['t_collective_s'] * 1e3:6.2f} | "
                f"{rf['ceiling_tok_s']:6.0f}/s | "
                + (f"{pub:7.0f}/s | {r['ratio']:5.2f}" if pub else f"{'-':>9} | {'-':>5}"))
        lines.append("tokens/s = batch / step time; ratio = predicted (published schedule) / published; "
                     "ceiling = batch / max(floor)")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def format_sensitivity(system: str, rows: list[dict], batches: list[int]) -> str:
    lines = [f"sensitivity ({system}): predicted tok/s (ratio to published)"]
    lines.append(f"{'variant':42s} " + " ".join(f"{'B=' + str(b):>15}" for b in batches))
    for r in rows:
        cells = []
        for b in batches:
            c = r[b]
            cells.append(f"{c['tokens_per_s']:7.0f} ({c['ratio']:.2f})" if c["ratio"] else f"{c['tokens_per_s']:15.0f}")
        lines.append(f"{r['variant']:42s} " + " ".join(f"{x:>15}" for x in cells))
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from mk.config import get_config
    from mk import sim

    systems = [s.strip() for s in args.system.split(",") if s.strip()]
    batches = _batches(args.batch)
    report = collect(args.config, systems, batches, args.context, not args.mean_experts)
    if args.sensitivity:
        ctx = sim.DEFAULT_CONTEXT if args.context is None else args.context
        for rep in report:
            rep["sensitivity"] = sim.sensitivity(get_config(args.config), rep["system"], batches, ctx)
    if args.json:
        for rep in report:
            for r in rep.get("sensitivity", ()):
                for b in batches:
                    r[str(b)] = r.pop(b)
        json.dump(report if len(report) > 1 else report[0], sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(report))
        for rep in report:
            if "sensitivity" in rep:
                sys.stdout.write("\n" + format_sensitivity(rep["system"], rep["sensitivity"], batches))
    return 0
