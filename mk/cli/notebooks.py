"""`python -m mk notebooks --out DIR [-p name value ...]`: run the research notebooks headless;
`python -m mk notebooks --render-figures DIR`: PNGs of an earlier run's figures (kaleido)."""
from __future__ import annotations

import ast
import sys

from mk.cli.common import add_cache_option
from mk.errors import UserError, creatable_dir


def add_parser(subparsers):
    p = subparsers.add_parser("notebooks", help="execute notebooks/*.ipynb (papermill) and export HTML + figures")
    p.add_argument("--out", help="output folder for executed notebooks, HTML and figures")
    p.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="override a notebook parameter (VALUE parsed as a Python literal when possible)")
    p.add_argument("--only", action="append", default=None, help="run only notebooks whose name contains this")
    p.add_argument("--no-html", action="store_true", help="no HTML exports (figures are still written)")
    p.add_argument("--no-export", action="store_true",
                   help="executed notebooks only: no HTML, no figure files (automatic where nbconvert is not "
                        "installed); render the PNGs later with --render-figures")
    p.add_argument("--transport", choices=("ipc", "tcp"), default="ipc",
                   help="kernel <-> runner sockets: ipc (unix sockets, default; the only choice on a TPU VM "
                        "where no TCP socket opens) or tcp")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds between notebooks (a TPU is free again only a moment after a kernel process exits)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    p.add_argument("--render-figures", metavar="DIR",
                   help="instead of running: write DIR/figures/<name>.png for every plotly figure in the "
                        "executed notebooks DIR/*.ipynb (kaleido + a headless browser)")
    add_cache_option(p)
    p.set_defaults(func=run)


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _summarize_outputs(out):
    from pathlib import Path
    from mk.notebooks.runner import _browser
    out = Path(out)
    figs = out / "figures"
    png = sorted(figs.glob("*.png")) if figs.is_dir() else []
    html = sorted(figs.glob("*.html")) if figs.is_dir() else []
    browser = _browser()
    how = f"PNG via kaleido + {browser}" if browser else "no headless browser found: HTML figures"
    print(f"figures: {len(png)} PNG, {len(html)} HTML in {figs} ({how})")
    print(f"executed notebooks + HTML exports: {out}")


def render(directory) -> int:
    from mk.notebooks.runner import render_figures
    try:
        paths = render_figures(directory)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    print(f"{len(paths)} PNG figure(s) from the executed notebooks in {directory}")
    return 0 if paths else 1


def run(args) -> int:
    if args.render_figures:
        if args.out or args.parameter or args.only:
            print("error: --render-figures DIR renders an earlier run; it takes no --out, -p or --only",
                  file=sys.stderr)
            return 2
        return render(args.render_figures)
    if not args.out:
        print("error: the following arguments are required: --out (or --render-figures DIR)", file=sys.stderr)
        return 2
    from mk.notebooks.runner import NOTEBOOK_DIR, export_available, notebooks, run_all
    names = [nb.name for nb in notebooks()]
    for o in args.only or ():
        if not any(o in n for n in names):
            raise UserError(f"--only {o!r} matches no notebook in {NOTEBOOK_DIR}: expected part of one of {names}")
    creatable_dir(args.out, "--out")
    params = {k: _literal(v) for k, v in args.parameter}
    results = run_all(args.out, params, only=args.only, html=not args.no_html, timeout=args.timeout,
                      transport=args.transport, pause=args.pause, export=False if args.no_export else None,
                      cache=not args.no_cache)
    for r in results:
        print(f"{r['notebook']:<32} {r['seconds']:7.1f} s  {'ok' if r['ok'] else 'FAILED'}")
    if args.no_export or not export_available():
        print(f"executed notebooks: {args.out} (no export: `python -m mk notebooks --render-figures {args.out}` "
              f"makes the PNGs where a headless browser is)")
    else:
        _summarize_outputs(args.out)
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print(f"error: {r['error']}", file=sys.stderr)
    if not results:
        print("error: no notebooks found", file=sys.stderr)
        return 1
    return 1 if failed else 0
