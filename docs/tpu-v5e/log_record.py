"""A record from the log of an `mk bench` call that its time limit stopped before it printed its JSON.

`mk bench` logs one line per (batch, program) as soon as it is timed,

    bench: B=8 kernel: median 8.948 ms (min 8.832, max 9.201), device 7.949 ms: 10 ops, 0.000 ms idle ...

so a call stopped by `timeout` still holds every case it finished. This turns those lines into a
record of kind "bench_log" (a detail kind: `mk results` lists it, the README's block does not), with
the commit, date, chip and command of the call, which the log itself cannot say:

    python3 docs/tpu-v5e/log_record.py LOG --commit HASH --date 2026-12-07T00:14 --chip tpu-v5e \
        --command "python -m mk bench ..." --key config=k3-d48 --key experts=mxfp4 > RECORD.json
"""
import argparse
import json
import re
import sys

LINE = re.compile(r"bench: B=(\d+) ([\w-]+): median ([\d.]+) ms \(min ([\d.]+), max ([\d.]+)\), "
                  r"device ([\d.]+) ms: (\d+) ops, ([\d.]+) ms idle between them, ([\d.]+) s")


def rows_of(text: str) -> list[dict]:
    """One row per timed case: {impl, batch, median_ms, min_ms, max_ms, device_median_ms, ops, idle_ms, case_s}."""
    return [{"impl": m[2], "batch": int(m[1]), "median_ms": float(m[3]), "min_ms": float(m[4]),
             "max_ms": float(m[5]), "device_median_ms": float(m[6]), "ops": int(m[7]),
             "idle_ms": float(m[8]), "case_s": float(m[9])} for m in LINE.finditer(text)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log")
    p.add_argument("--commit", required=True)
    p.add_argument("--date", required=True, help="when the call ran (the log's last timestamp)")
    p.add_argument("--chip", required=True)
    p.add_argument("--command", required=True, help="the mk command the log is of")
    p.add_argument("--key", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    with open(args.log) as f:
        rows = rows_of(f.read())
    if not rows:
        sys.exit(f"{args.log}: no 'bench: B=N IMPL: median ...' line")
    key = dict(kv.split("=", 1) for kv in args.key)
    summary = "; ".join(f"B={r['batch']} {r['impl']} device {r['device_median_ms']:.2f} ms (wall {r['median_ms']:.2f})"
                        for r in rows) + " (from the log: the call was stopped by its limit before its JSON)"
    record = {"kind": "bench_log", "key": key, "summary": summary, "commit": args.commit, "dirty": False,
              "date": args.date, "chip": args.chip, "command": args.command,
              "log": args.log.rsplit("/", 1)[-1]}
    json.dump({"record": record, "rows": rows}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
