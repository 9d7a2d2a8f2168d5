"""Execute the research notebooks headless (papermill) and export them (nbconvert, kaleido).

    python -m mk notebooks --out DIR [-p name value ...] [--transport ipc|tcp] [--no-export]
    python -m mk notebooks --render-figures DIR       # PNGs from executed notebooks, later, elsewhere

For every `notebooks/NN_*.ipynb`: DIR/<name>.ipynb (executed), DIR/<name>.html, and the figures the
notebook saved with `save_figure` under DIR/figures/ (PNG through kaleido when a headless browser
is available: env BROWSER_PATH, else Debian's /usr/bin/chromium-headless-shell or chromium; otherwise
standalone HTML that loads plotly.min.js from the same folder). A failing
notebook makes the run exit non-zero, naming the notebook and the failing cell. Every notebook
asserts the claims it prints, so "failing" includes "a verdict did not hold".

The HTML exports work offline: figures are rendered by plotly's `notebook` renderer, which embeds
plotly.js once per notebook (no CDN). Kernels talk to the runner over IPC (unix) sockets by default
(`transport="ipc"`: works wherever TCP does, and on a TPU VM that opens no TCP socket at all;
ipykernel then has no unencrypted-TCP warning to print); `transport="tcp"` is jupyter's usual.

Without export (`export=False`, `--no-export`; automatic where nbconvert is not installed, e.g. a
TPU VM carrying only the wheels the notebooks import) the runner writes only the executed
notebooks: no HTML, no figure files, and each figure's plotly JSON in the notebook carries the name
`save_figure` gave it (`layout.meta.mk_figure`). `render_figures(DIR)` turns those into
DIR/figures/<name>.png later, on a machine with a headless browser.

Notebooks find the figure folder through the env var `MK_NOTEBOOK_FIGURES` (unset: figures are only
shown inline, nothing is written).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

FIGURES_ENV = "MK_NOTEBOOK_FIGURES"
EXPORT_ENV = "MK_NOTEBOOK_EXPORT"      # "0": save_figure writes no file (the runner's --no-export)
TRANSPORTS = ("ipc", "tcp")
IPC_KERNEL = "mk.notebooks.ipc_kernel"   # `python -m` module of the ipc kernel (no TCP socket)
PLOTLY_MIME = "application/vnd.plotly.v1+json"
FIGURE_META = "mk_figure"              # layout.meta key naming a figure (save_figure)
NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"


BROWSER_CANDIDATES = ("/usr/bin/chromium-headless-shell", "/usr/bin/chromium")


def _browser() -> str | None:
    """The headless browser kaleido should drive (exported as BROWSER_PATH), or None."""
    path = os.environ.get("BROWSER_PATH")
    if path and os.path.exists(path):
        return path
    for path in BROWSER_CANDIDATES:
        if os.path.exists(path):
            os.environ["BROWSER_PATH"] = path
            return path
    return None


class _DropIgnoredJSONError:
    """choreographer (kaleido's browser driver) logs a full traceback for a browser message it cannot
    parse and then, by design, ignores; Debian's headless shell sends such messages. Drop exactly that
    record (every other choreographer error still shows)."""
    MESSAGE = "JSONError decoding message. Ignoring"

    def filter(self, record) -> bool:
        return record.getMessage() != self.MESSAGE


def _quiet_choreographer():
    import logging

    import kaleido  # noqa: F401  (first: choreographer's logger class, with its extra levels, must exist
    #                 before the logger below is made, or that logger lacks `debug2` and the export fails)
    log = logging.getLogger("choreographer.channels.pipe")
    if not any(isinstance(f, _DropIgnoredJSONError) for f in log.filters):
        log.addFilter(_DropIgnoredJSONError())


def _name_figure(fig, name: str):
    """Record `name` in the figure's layout.meta, so that its plotly JSON in an executed notebook
    says which figure it is (`render_figures`). meta is free-form and draws nothing."""
    meta = fig.layout.meta
    if meta is None or isinstance(meta, dict):
        fig.update_layout(meta={**(meta or {}), FIGURE_META: name})


# A figure's size when written as PNG, where its layout names none (kaleido's own default, 700 x 500,
# cuts long titles and crowds legends), and the characters of a title line at that width.
EXPORT_WIDTH, EXPORT_HEIGHT = 1100, 560
TITLE_CHARS_PER_PX = 1 / 9.5


def _wrap(text: str, limit: int) -> str:
    """`text` with '<br>' at word boundaries so that no line is longer than `limit` characters
    (a line that already holds a '<br>' is kept as it is)."""
    if "<br>" in text or len(text) <= limit:
        return text
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > limit:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "<br>".join(lines + [line])


def fit_title(fig, width: int | None = None):
    """Wrap the figure's title to its width (`EXPORT_WIDTH` where the layout sets none) and make
    room above the plot for its lines; returns `fig`."""
    title = fig.layout.title.text
    if not title:
        return fig
    width = width or fig.layout.width or EXPORT_WIDTH
    text = _wrap(title, int(width * TITLE_CHARS_PER_PX))
    lines = text.count("<br>") + 1
    fig.update_layout(title_text=text, margin_t=max(fig.layout.margin.t or 0, 40 + 24 * lines))
    return fig


def _write_png(fig, path) -> None:
    """PNG through kaleido at the figure's own size, else `EXPORT_WIDTH` x `EXPORT_HEIGHT`."""
    fit_title(fig)
    fig.write_image(str(path), width=fig.layout.width or EXPORT_WIDTH, height=fig.layout.height or EXPORT_HEIGHT)


def save_figure(fig, name: str, out_dir: str | os.PathLike | None = None) -> str | None:
    """Write a plotly figure as DIR/name.png (kaleido + headless browser) or DIR/name.html.
    DIR = out_dir or $MK_NOTEBOOK_FIGURES; returns the path written, or None if no folder is set or
    the runner runs without export ($MK_NOTEBOOK_EXPORT=0: `render_figures` writes the PNG later).
    Either way the figure is named in its layout.meta and its title wrapped to its width
    (`fit_title`; call before `fig.show()`). A PNG has the layout's size, else EXPORT_WIDTH x EXPORT_HEIGHT."""
    _name_figure(fig, name)
    fit_title(fig)
    d = out_dir or os.environ.get(FIGURES_ENV)
    if not d or (out_dir is None and os.environ.get(EXPORT_ENV) == "0"):
        return None
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    if _browser():
        try:
            path = d / f"{name}.png"
            _quiet_choreographer()
            _write_png(fig, path)
            return str(path)
        except Exception as e:  # kaleido / browser trouble: fall back to HTML
            print(f"save_figure: PNG export failed ({type(e).__name__}: {e}); writing HTML", file=sys.stderr)
    path = d / f"{name}.html"
    fig.write_html(str(path), include_plotlyjs="directory")   # one plotly.min.js beside them: works offline
    return str(path)


def _kernel_manager(transport: str = "ipc"):
    """An nbclient kernel manager whose kernel listens on `transport`: "ipc", local unix sockets
    beside the connection file (nothing to eavesdrop on, so ipykernel does not warn about
    unencrypted TCP; the only choice where no TCP socket opens, as on the TPU VM), or "tcp"."""
    from jupyter_client.manager import AsyncKernelManager

    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, found {transport!r}")

    class KernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            kw.setdefault("transport", transport)
            super().__init__(**kw)

        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            if self.transport == "ipc":     # ipykernel's launcher, with its own TCP sockets off
                cmd = [IPC_KERNEL if a == "ipykernel_launcher" else a for a in cmd]
            return cmd

    KernelManager.__name__ = f"{transport.upper()}KernelManager"
    return KernelManager


def export_available() -> bool:
    """Whether this environment can export HTML (nbconvert installed)."""
    import importlib.util
    return importlib.util.find_spec("nbconvert") is not None


def notebooks(directory: str | os.PathLike | None = None) -> list[Path]:
    d = Path(directory) if directory else NOTEBOOK_DIR
    return sorted(p for p in d.glob("[0-9][0-9]_*.ipynb"))


def _kernel_name() -> str:
    """A Jupyter kernel running this very interpreter, registered for the current user (under a name
    unique to its path) if there is none yet.

    Interpreters are compared by path, not by resolved symlink: every virtual environment's
    `bin/python` links to the same base interpreter, so resolving would pick another checkout's
    environment (with its own installed `mk`) and run the notebooks on its code."""
    import hashlib
    from jupyter_client.kernelspec import KernelSpecManager
    exe = os.path.abspath(sys.executable)
    for name, spec in sorted(KernelSpecManager().get_all_specs().items()):
        argv = spec.get("spec", {}).get("argv", [])
        if argv and os.path.abspath(argv[0]) == exe:
            return name
    from ipykernel.kernelspec import install
    name = "mk-" + hashlib.sha1(exe.encode()).hexdigest()[:10]
    install(user=True, kernel_name=name, display_name=f"mk ({exe})")
    return name


def _failing_cell(nb_path: Path) -> str | None:
    """'cell i (first line): error' of the executed notebook's first error output; None if it has
    none or cannot be read."""
    import nbformat
    try:
        nb = nbformat.read(str(nb_path), as_version=4)
    except Exception:
        return None
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                first = cell.source.splitlines()[0] if cell.source else ""
                return f"cell {i} ({first[:60]!r}): {out.get('ename')}: {str(out.get('evalue'))[:200]}"
    return None


def export_html(nb_path: Path, html_path: Path):
    import nbformat
    from nbconvert import HTMLExporter
    body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(nb_path), as_version=4))
    html_path.write_text(body, encoding="utf-8")


def run_all(out: str | os.PathLike, parameters: dict | None = None, only: list[str] | None = None,
            html: bool = True, timeout: int = 900, directory: str | os.PathLike | None = None,
            root: str | os.PathLike | None = None, transport: str = "ipc",
            export: bool | None = None, pause: float = 0.0, cache: bool = True) -> list[dict]:
    """Execute every notebook (of `directory`, default notebooks/) into `out`, each in its own
    kernel process; returns [{notebook, seconds, ok, error}].

    `root`: the folder holding the `mk` package (and `data/`) the notebooks import, first on the
    kernel's PYTHONPATH and its working directory (default: this repository).
    `transport`: how the kernel talks to the runner, "ipc" (unix sockets) or "tcp".
    `export`: HTML exports (if `html`) and figure files; None: where nbconvert is installed. Without
    it only the executed notebooks are written (figures named inside them: `render_figures`).
    `pause`: seconds to wait between notebooks (on a TPU VM the chip is free again only a moment
    after the previous kernel process exited). `cache`: the kernels share mk's persistent compile
    cache (`mk.model.compile_cache.environment`: JAX's own variables, which the kernel processes read)."""
    import papermill as pm
    manager = _kernel_manager(transport)
    if export is None:
        export = export_available()
        if not export:
            print("nbconvert is not installed: executed notebooks only (no HTML, no figure files; "
                  "`python -m mk notebooks --render-figures DIR` makes the PNGs later)", file=sys.stderr)
    html = html and export
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = out / "figures"
    kernel = _kernel_name()
    repo = str(Path(root).resolve() if root else NOTEBOOK_DIR.parent)
    from mk.model import compile_cache
    cache_env = compile_cache.environment() if cache else {}
    saved = {k: os.environ.get(k) for k in (FIGURES_ENV, EXPORT_ENV, "PLOTLY_RENDERER", "PYTHONPATH", *cache_env)}
    os.environ.update(cache_env)
    os.environ[FIGURES_ENV] = str(figs.resolve())
    os.environ[EXPORT_ENV] = "1" if export else "0"
    # plotly's default renderer in a papermill kernel emits only its own mimetype, which the HTML
    # export cannot show; add an HTML rendering beside it. `notebook` (not `notebook_connected`)
    # embeds plotly.js once, in the first figure's output, so the export renders offline. Without
    # export the figure's JSON is all that is kept.
    os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype+notebook" if export else "plotly_mimetype")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    results = []
    try:
        for nb in notebooks(directory):
            if only and not any(o in nb.name for o in only):
                continue
            target = out / nb.name
            if results and pause:
                time.sleep(pause)
            print(f"[{len(results) + 1}] {nb.name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            err = None
            try:
                pm.execute_notebook(str(nb), str(target), parameters=parameters or {}, kernel_name=kernel,
                                    cwd=repo, progress_bar=False, execution_timeout=timeout,
                                    kernel_manager_class=manager,
                                    # the kernel is done when its last cell is: stop it at once (a
                                    # graceful shutdown that times out ends in SIGTERM, which libtpu's
                                    # failure-signal handler prints as a stack trace)
                                    shutdown_kernel="immediate")
            except Exception as e:  # papermill raises PapermillExecutionError with the cell
                cell = _failing_cell(target) if target.exists() else None
                err = f"{nb.name}: {cell or f'{type(e).__name__}: {e}'}"
            secs = time.perf_counter() - t0
            if html and target.exists():
                try:
                    export_html(target, target.with_suffix(".html"))
                except Exception as e:
                    err = err or f"{nb.name}: HTML export failed: {e}"
            results.append({"notebook": nb.name, "seconds": round(secs, 1), "ok": err is None, "error": err})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


def plotly_figures(nb_path: str | os.PathLike) -> list[tuple[str, dict]]:
    """(name, plotly figure JSON) of every plotly output of an executed notebook, in order. name:
    the one `save_figure` recorded (layout.meta.mk_figure), else <notebook>_cell<i>_<j>; a name
    shown twice gets _2, _3, ..."""
    import nbformat
    nb = nbformat.read(str(nb_path), as_version=4)
    stem = Path(nb_path).stem
    out, seen = [], {}
    for i, cell in enumerate(nb.cells):
        for j, o in enumerate(cell.get("outputs", [])):
            fig = o.get("data", {}).get(PLOTLY_MIME)
            if not fig:
                continue
            meta = fig.get("layout", {}).get("meta")
            name = meta.get(FIGURE_META) if isinstance(meta, dict) and meta.get(FIGURE_META) else f"{stem}_cell{i}_{j}"
            seen[name] = seen.get(name, 0) + 1
            out.append((name if seen[name] == 1 else f"{name}_{seen[name]}", fig))
    return out


def render_figures(directory: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[str]:
    """PNG (kaleido + a headless browser) of every plotly figure in the executed notebooks of
    `directory` (`plotly_figures`), into `out_dir` (default DIR/figures); returns the paths written.
    For runs made without export (e.g. on a TPU VM), rendered afterwards on a machine with a browser."""
    import plotly.io as pio
    d = Path(directory)
    nbs = sorted(d.glob("*.ipynb"))
    if not nbs:
        raise FileNotFoundError(f"no executed notebooks (*.ipynb) in {d}")
    browser = _browser()
    if browser is None:
        raise RuntimeError("no headless browser for kaleido: set BROWSER_PATH or install Debian's "
                           "chromium-headless-shell (`make browser`), then run --render-figures again")
    _quiet_choreographer()
    figs = Path(out_dir) if out_dir else d / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    written = []
    for nb in nbs:
        for name, fig in plotly_figures(nb):
            path = figs / f"{name}.png"
            _write_png(pio.from_json(json.dumps(fig), skip_invalid=True), path)
            written.append(str(path))
    return written
