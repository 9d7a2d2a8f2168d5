"""`python -m mk notebooks --out DIR [-p name value ...]`: run the research notebooks headless."""
from __future__ import annotations

import ast
import sys


def add_parser(subparsers):
    p = subparsers.add_parser("notebooks", help="execute notebooks/*.ipynb (papermill) and export HTML + figures")
    p.add_argument("--out", required=True, help="output folder for executed notebooks, HTML and figures")
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="override a notebook parameter (VALUE parsed as a Python literal when possible)")
    p.add_argument("--only", action="append", default=None, help="run only notebooks whose name contains this")
    p.add_argument("--no-html", action="store_true")
    p.set_defaults(func=run)


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _summarize_outputs(out):
    from pathlib import Path
    from mk.notebook_runner import _browser
    out = Path(out)
    figs = out / "figures"
    png = sorted(figs.glob("*.png")) if figs.is_dir() else []
    html = sorted(figs.glob("*.html")) if figs.is_dir() else []
    browser = _browser()
    how = f"PNG via kaleido + {browser}" if browser else "no headless browser found: HTML figures"
    print(f"figures: {len(png)} PNG, {len(html)} HTML in {figs} ({how})")
    print(f"executed notebooks + HTML exports: {out}")


def run(args) -> int:
    from mk.notebook_runner import run_all
    params = {k: _literal(v) for k, v in args.parameter}
    results = run_all(args.out, params, only=args.only, html=not args.no_html)
    for r in results:
        print(f"{r['notebook']:<32} {r['seconds']:7.1f} s  {'ok' if r['ok'] else 'FAILED'}")
    _summarize_outputs(args.out)
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print(f"error: {r['error']}", file=sys.stderr)
    if not results:
        print("error: no notebooks found", file=sys.stderr)
        return 1
    return 1 if failed else 0
