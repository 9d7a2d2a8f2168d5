"""`python -m mk results`: the current measured figures, from the JSON records under docs/.

Reads every JSON record (`mk.perf.results`: a top-level "record" with kind, key, summary, commit, date,
chip and command) under --root and prints the README's results block (`mk.perf.cases.readme_block`):
the depth family's sweep table (each case the newest bench row on the kernel's defaults) and one row
each for generation, prefill and the checks. `--all` prints the whole registry instead: the newest
record of every measurement, LLO counts, traces and tuning runs included. `--write README.md` rewrites
the README's block; `--check README.md` exits 1 where that block is not what the records give (the test
suite runs it, so the README cannot go stale).
"""
from __future__ import annotations

import sys
from pathlib import Path


def add_parser(subparsers):
    p = subparsers.add_parser("results", help="the current measured figures, from the JSON records in docs/",
                              description=__doc__.splitlines()[0])
    p.add_argument("--root", default=None, help="folder searched for records (default: the repository's docs/)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--all", action="store_true", help="every measurement's newest record, as one table")
    what.add_argument("--write", metavar="README", default=None, help="rewrite this file's results block")
    what.add_argument("--check", metavar="README", default=None,
                      help="exit 1 where this file's results block differs from the records")
    what.add_argument("--figure", metavar="PNG", default=None,
                      help="draw the bench records' tokens/s (device time) per impl to this PNG (needs the notebooks extra)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mk.perf import cases, results
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
    if args.all:
        print(results.results_table(records))
        return 0
    block = cases.readme_block(records)
    if args.write:
        changed = results.write_block(args.write, block)
        print(f"{args.write}: results block {'rewritten' if changed else 'already current'} "
              f"({len(results.current(records))} measurements from {len(records)} records)")
        return 0
    if args.check:
        try:
            found = results.read_block(args.check)
        except OSError as e:
            raise results.ResultsError(f"--check {args.check}: {e.strerror}") from None
        if found is None:
            raise results.ResultsError(f"--check {args.check}: no results block")
        if found != block:
            print(f"{args.check}: the results block is not what the records under {root} give; run "
                  f"`python -m mk results --write {args.check}`", file=sys.stderr)
            return 1
        print(f"{args.check}: results block current")
        return 0
    print(block)
    return 0
