"""`python -m mk results`: the current figure of every measurement recorded under docs/, as a table.

Reads every JSON record (`mk.perf.results`: a top-level "record" with kind, key, summary, commit, date,
chip and command) under --root, keeps the newest of each measurement and prints the markdown table
the README shows, then the detail records (LLO counts, phase traces). `--write README.md` rewrites the
README's results block (`mk.perf.results.headline`: the detail kinds left out); `--check README.md`
exits 1 where that block is not what the records give (the test suite runs it, so the README cannot
go stale).
"""
from __future__ import annotations

import sys
from pathlib import Path


def add_parser(subparsers):
    p = subparsers.add_parser("results", help="the current measured figures, from the JSON records in docs/",
                              description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="folder searched for records (default: the repository's docs/)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", metavar="README", default=None, help="rewrite this file's results block")
    what.add_argument("--check", metavar="README", default=None,
                      help="exit 1 where this file's results block differs from the records")
    what.add_argument("--figure", metavar="PNG", default=None,
                      help="draw the bench records' tokens/s (device time) per impl to this PNG (needs the notebooks extra)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mk.perf import results
    root = args.root or results.REPO / "docs"
    records = results.find_records(root)
    if args.figure:
        from mk.errors import writable_path
        from mk.notebooks.helpers import records_figure
        from mk.notebooks.runner import save_figure
        path = Path(writable_path(args.figure, "--figure"))
        written = save_figure(records_figure(records), path.stem, path.parent)
        print(f"wrote {written}")
        return 0
    shown = results.headline(records)
    table = results.results_table(shown)
    if args.write:
        changed = results.write_block(args.write, table)
        print(f"{args.write}: results block {'rewritten' if changed else 'already current'} "
              f"({len(results.current(records))} measurements from {len(records)} records)")
        return 0
    if args.check:
        try:
            block = results.read_block(args.check)
        except OSError as e:
            raise results.ResultsError(f"--check {args.check}: {e.strerror}") from None
        if block is None:
            raise results.ResultsError(f"--check {args.check}: no results block")
        if block != table:
            print(f"{args.check}: the results block is not what the records under {root} give; run "
                  f"`python -m mk results --write {args.check}`", file=sys.stderr)
            return 1
        print(f"{args.check}: results block current")
        return 0
    detail = [pr for pr in records if pr not in shown]
    print(table)
    if detail:
        print("\nDetail records (LLO counts, phase traces, cases read from the log of a stopped call, tuning runs: "
              "a prefetch depth, tile or MXFP4 unpack set by hand; not in the README):\n")
        print(results.results_table(detail))
    return 0
