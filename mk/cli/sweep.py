"""`python -m mk sweep`: measure a family of cases on this TPU, one process a case, and print the sweep table.

    python -m mk sweep --family depth --impl kernel,xla,peer --experts bf16 --batch 1,8 --max-minutes 9.5
    python -m mk sweep --configs data/configs/k3-w1792-d48 --batch 1,8      # a config of your own
    python -m mk sweep --family depth --plan      # the cases and their estimated time; runs nothing

Each case, one (config, experts, impl) with its batches (`mk.perf.sweep`), runs in its own process, one
program at a time on the chip, and writes one record per batch under --out (default
docs/<chip>/<date>/). A batch whose record holds this commit and these options is skipped, so the same
command run again after a time limit goes on where it stopped; `--max-minutes` starts no case that its
estimate says would not fit and stops a running one at the limit, keeping its finished batches. A
program that cannot run a case (the peer at a latent width its kernel refuses, the XLA strawman with
MXFP4 experts) is named with the reason and left out. At the end: the sweep table of --out's records
(`mk.perf.cases.sweep_table`: device ms, edge over the better rival, share of the stream) and its figure,
OUT/sweep.png (or .html). Off a TPU it refuses in one line (exit 2); `--plan` runs anywhere.
"""
from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

from mk.cli.common import at_least, int_list, positive_float, positive_int, progress

MARGIN_S = 15.0     # kept free before --max-minutes: the table, the figure, the exit


def add_parser(subparsers):
    p = subparsers.add_parser("sweep", help="measure a family of cases on a TPU, resumable, and print the sweep table",
                              description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--configs", default=None,
                       help="comma-separated presets or config directories (default: the depth family)")
    which.add_argument("--family", default=None, help="a family of presets: depth (k3-chip, k3-d12, k3-d24, k3-d48)")
    p.add_argument("--experts", default="bf16,mxfp4", help="comma-separated expert formats (default bf16,mxfp4)")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes (default 1,2,4,8)")
    p.add_argument("--impl", default="kernel,xla,peer", help="comma-separated programs, of kernel, xla, peer "
                   "(default all three; peer needs tpu-inference 0.26.0)")
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per batch (default 8)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps first, compile included (default 3)")
    p.add_argument("--seed", type=at_least(0), default=0, help="weights and tokens seed")
    p.add_argument("--out", default=None, help="the records' folder (default docs/<chip>/<date>/)")
    p.add_argument("--max-minutes", type=positive_float, default=None,
                   help="stop cleanly before this many minutes (run the same command again to go on)")
    p.add_argument("--plan", action="store_true", help="list the cases and their estimated time; run nothing")
    p.add_argument("--no-figure", action="store_true", help="print the table only")
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)   # the process of one case
    p.set_defaults(func=run)


class Runner:
    """How the sweep reaches the chip: every program in a process of its own, so that this one never
    holds the chip (two processes cannot). Tests put a fake in `RUNNER`."""

    pause_s = 2.0          # after a program, before the next opens the chip

    def probe(self) -> tuple[str, str]:
        """(jax's backend, the first device's kind), asked of a fresh process."""
        code = "import jax; print(jax.default_backend()); print(jax.devices()[0].device_kind)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        lines = out.stdout.strip().splitlines()
        if out.returncode or len(lines) < 2:
            from mk.perf.sweep import SweepError
            why = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise SweepError(f"mk sweep: jax could not start on this machine: {why}")
        return lines[-2], lines[-1]

    def run(self, argv: list[str], log: Path, timeout_s: float | None) -> int | None:
        """`python -m mk ARGV` with its output appended to `log`; its exit status, or None where it was
        stopped at `timeout_s`."""
        with open(log, "a") as f:
            proc = subprocess.Popen([sys.executable, "-m", "mk", *argv], stdout=f, stderr=subprocess.STDOUT)
            try:
                return proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return None
            finally:
                time.sleep(self.pause_s)


RUNNER = Runner()


def run(args) -> int:
    from mk.kernel.plan import MAX_ROWS
    from mk.perf import sweep
    configs = sweep.resolve_configs(args.configs, args.family)
    experts = sweep.choices(args.experts, "experts", sweep.EXPERT_FORMATS)
    impls = sweep.choices(args.impl, "impl", sweep.IMPLS)
    batches = int_list(args.batch, "--batch")
    if max(batches) > MAX_ROWS:
        raise sweep.SweepError(f"--batch: each batch must lie in 1..{MAX_ROWS}, found {max(batches)}")
    opts = sweep.options(args.steps, args.warmup, args.seed)
    if args.case:
        return _one_case(args, configs, experts, impls, batches, opts)
    todo, left_out = sweep.plan(configs, experts, impls, batches, installed=not args.plan)
    if args.plan:
        return _print_plan(args, todo, left_out, opts)
    backend, kind = RUNNER.probe()
    if backend != "tpu":
        raise sweep.SweepError(f"mk sweep times cases on a TPU; this machine's jax backend is {backend!r} (interpret "
                               f"mode is no speed claim; `--plan` lists the cases anywhere)")
    from mk.perf.bench import chip_of_device
    from mk.perf.results import REPO, commit
    head = commit()[0]
    if head is None:
        raise sweep.SweepError("mk sweep: no commit known for this tree (no git here): set MK_COMMIT=<hash> where the "
                               "tree was copied, so that records say what they measured and a rerun can resume")
    chip = (chip_of_device(kind) or (None, kind.lower().replace(" ", "-")))[1]
    out = Path(args.out or REPO / "docs" / chip / datetime.date.today().isoformat())
    out.mkdir(parents=True, exist_ok=True)
    for case, why in left_out:
        _say(f"{case.impl} left out at {case.config} {case.experts}: {why}")
    _run_cases(todo, out, head, opts, args.max_minutes)
    _print_table(out, configs, experts, batches, figure=not args.no_figure)
    return 0


def _one_case(args, configs, experts, impls, batches, opts) -> int:
    """`--case`: measure one (config, experts, impl) here, into --out (what `_run_cases` spawns)."""
    from mk.perf import sweep
    if len(configs) * len(experts) * len(impls) != 1 or not args.out:
        raise sweep.SweepError("--case measures one config, one expert format and one impl into --out")
    sweep.measure_case(sweep.Case(configs[0], experts[0], impls[0], tuple(batches)), args.out, opts)
    return 0


def _case_argv(case, out: Path, opts: dict) -> list[str]:
    return ["sweep", "--case", "--configs", case.config, "--experts", case.experts, "--impl", case.impl,
            "--batch", ",".join(map(str, case.batches)), "--steps", str(opts["steps"]),
            "--warmup", str(opts["warmup"]), "--seed", str(opts["seed"]), "--out", str(out)]


def _estimates(cases, first_batch: bool = False) -> list[float]:
    """Each case's modelled seconds (`mk.perf.sweep.estimate_s`, from the records under docs/); with
    first_batch, of its start and first batch only."""
    import dataclasses
    from mk.perf.cases import newest_cases
    from mk.perf.results import REPO, find_records
    from mk.perf.sweep import estimate_s
    known = newest_cases(find_records(REPO / "docs"))
    return [estimate_s(dataclasses.replace(c, batches=c.batches[:1]) if first_batch else c, known) for c in cases]


def _run_cases(todo, out: Path, head: str, opts: dict, max_minutes: float | None) -> bool:
    """Run each case's missing batches, one process at a time; False where --max-minutes stopped it."""
    from mk.perf.sweep import log_path, pending
    t0 = time.monotonic()
    deadline = None if max_minutes is None else t0 + 60 * max_minutes - MARGIN_S
    left = [c for c in (pending(out, case, head, opts) for case in todo) if c.batches]
    skipped = len(todo) - len(left)
    if skipped:
        _say(f"{skipped} of {len(todo)} cases already measured at this commit with these options in {out}")
    est, first = _estimates(left), _estimates(left, first_batch=True)
    bar = progress(desc="sweep", total=round(sum(est)), unit="s", enabled=True,
                   bar_format="{desc} |{bar}| {elapsed} elapsed, ~{remaining} left")
    done_est = 0.0
    for i, (case, s) in enumerate(zip(left, est)):
        now = time.monotonic()
        if deadline is not None and now + first[i] > deadline:
            rest = sum(est[i:])
            _say(f"stopped before {case.label}: ~{rest / 60:.0f} min of {len(left) - i} cases left, "
                 f"{max(deadline - now, 0):.0f} s before --max-minutes; run the same command again to go on")
            bar.close()
            return False
        bar.set_description_str(f"{case.label} B={','.join(map(str, case.batches))}")
        _say(f"[{i + 1}/{len(left)}] {case.label} B={','.join(map(str, case.batches))} (~{s:.0f} s estimated)")
        log = log_path(out, case)
        rc = RUNNER.run(_case_argv(case, out, opts), log, None if deadline is None else deadline - now)
        done_est += s
        bar.update(round(s))
        elapsed = time.monotonic() - t0
        rate = elapsed / done_est if done_est else 1.0
        if rc is None:
            _say(f"{case.label}: stopped at the time limit, its finished batches kept; {len(left) - i} case(s) "
                 f"left; run the same command again to go on")
            bar.close()
            return False
        status = "done" if rc == 0 else f"failed (exit {rc}): {_last_line(log)}"
        _say(f"{case.label}: {status}; {elapsed / 60:.1f} min elapsed, ~{rate * sum(est[i + 1:]) / 60:.1f} min left")
    bar.close()
    return True


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def _print_plan(args, todo, left_out, opts) -> int:
    from mk.perf.results import commit
    from mk.perf.sweep import pending
    head = commit()[0]
    shown = [pending(args.out, case, head, opts) for case in todo]
    est = _estimates([c for c in shown if c.batches])
    print(f"{'case':40s} {'batches':>10s} {'estimated':>10s}")
    it = iter(est)
    for case, asked in zip(shown, todo):
        if not case.batches:
            print(f"{case.label:40s} {','.join(map(str, asked.batches)):>10s} {'done':>10s}")
            continue
        print(f"{case.label:40s} {','.join(map(str, case.batches)):>10s} {next(it):9.0f}s")
    for case, why in left_out:
        print(f"{case.label:40s} {'left out':>10s}  {why}")
    total = f"total ~{sum(est) / 60:.1f} min (modelled from the records' wall times, `mk.perf.sweep.estimate_s`)"
    if args.max_minutes:
        from mk.perf.sweep import commands_needed
        total += (f"; {commands_needed(est, 60 * args.max_minutes - MARGIN_S)} command(s) of --max-minutes "
                  f"{args.max_minutes:g}")
    print(total)
    return 0


def _print_table(out: Path, configs, experts, batches, figure: bool):
    from mk.perf.cases import sweep_table
    from mk.perf.results import find_records
    records = find_records(out)
    print(sweep_table(records, configs, experts, batches))
    if not figure:
        return
    try:
        from mk.notebooks.helpers import records_figure
        from mk.notebooks.runner import save_figure
        print(f"figure: {save_figure(records_figure(records), 'sweep', out)}")
    except Exception as e:           # no plotly, no race measured yet: the table stands
        print(f"figure not written: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def _say(msg: str):
    print(f"sweep: {msg}", file=sys.stderr, flush=True)
