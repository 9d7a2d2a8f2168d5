"""The runner's HTML exports render offline, and a run is quiet (no TCP-kernel warning).

A tiny notebook with one plotly figure goes through `run_all` (papermill + nbconvert, as `make run`
does). Its HTML must embed plotly.js itself, not only load it from a CDN; with a headless browser
whose every host name fails to resolve (no network), the figure must actually be drawn.
"""
import os
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from mk.notebooks import runner as notebook_runner
from mk.notebooks.runner import run_all

import plotly  # noqa: E402,F401  (a declared dependency: a missing one fails)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIGURE = """import plotly.graph_objects as go
fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2], name="offline-trace"))
fig.show()
fig.show()"""


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    p = nbformat.v4.new_code_cell("x = 1")
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(FIGURE)]
    nbformat.write(nb, str(src / "01_fig.ipynb"))
    out = tmp_path_factory.mktemp("out")
    env = {k: os.environ.pop(k) for k in ("PLOTLY_RENDERER",) if k in os.environ}   # the runner's default
    try:
        res = run_all(out, directory=src)
    finally:
        os.environ.update(env)
    assert res[0]["ok"], res
    return out / "01_fig.html"


def _plotlyjs_head() -> str:
    from plotly.offline import get_plotlyjs
    return get_plotlyjs()[:2000]


def test_export_embeds_plotlyjs_once(export):
    html = export.read_text(encoding="utf-8")
    head = _plotlyjs_head()
    assert html.count(head) == 1, "the HTML export must carry plotly.js itself, exactly once"
    assert not re.search(r'import\s*\\?"https://cdn\.plot\.ly', html), "plotly.js still imported from its CDN"
    assert html.count("Plotly.newPlot") >= 2      # both figures drawn by the embedded library


def test_save_figure_html_fallback_is_offline(tmp_path, monkeypatch):
    import plotly.graph_objects as go
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-browser"))
    monkeypatch.setattr(notebook_runner, "BROWSER_CANDIDATES", ())
    path = notebook_runner.save_figure(go.Figure(go.Bar(x=[1], y=[2])), "f", tmp_path)
    assert path.endswith("f.html") and (tmp_path / "plotly.min.js").stat().st_size > 1_000_000
    assert 'src="plotly.min.js"' in open(path).read()


def _headless_browser():
    for p in (os.environ.get("BROWSER_PATH"), *notebook_runner.BROWSER_CANDIDATES, shutil.which("chromium")):
        if p and os.path.exists(p):
            return p
    return None


def test_export_renders_without_network(export):
    browser = _headless_browser()
    if browser is None:
        pytest.skip("no headless browser binary (/usr/bin/chromium-headless-shell or chromium; `make browser` "
                    "installs one): cannot check that the figures render offline")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--host-resolver-rules=MAP * ~NOTFOUND",          # every host name fails: no network
           "--virtual-time-budget=20000", "--dump-dom", export.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert "<body" in dom, "the browser dumped no DOM"
    svgs = dom.count('class="main-svg"')
    assert svgs >= 2, f"figures not rendered offline: {svgs} plotly svg roots in the DOM"
    assert "offline-trace" in dom or 'class="scatterlayer' in dom


def test_kernel_talks_ipc_not_tcp(tmp_path, capfd):
    """ipykernel warns 'Kernel is running over TCP without encryption' on stderr for TCP kernels."""
    src = tmp_path / "src"
    src.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import os; print('pid', os.getpid())")]
    nbformat.write(nb, str(src / "01_q.ipynb"))
    res = run_all(tmp_path / "out", directory=src, html=False)
    assert res[0]["ok"], res
    err = capfd.readouterr().err
    assert "TCP" not in err and "WARNING" not in err, err


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to watch the kernel's sockets")
def test_ipc_kernel_opens_no_tcp_socket(tmp_path):
    """The TPU v5e VM refuses socket(AF_INET) and libzmq then aborts the kernel: over ipc neither
    the runner nor the kernel (ipykernel's IOPub fork pipe, its debugger) may open one. With
    ipykernel's own launcher the kernel opens one (the IOPub pipe), which this test catches."""
    src = tmp_path / "src"
    src.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(1 + 1)")]
    nbformat.write(nb, str(src / "01_q.ipynb"))
    script = (f"from mk.notebooks.runner import run_all; "
              f"r = run_all({str(tmp_path / 'out')!r}, directory={str(src)!r}, html=False); assert r[0]['ok'], r")
    log = tmp_path / "strace.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    subprocess.run(["strace", "-f", "-e", "trace=socket", "-o", str(log), sys.executable, "-c", script],
                   check=True, env=env, timeout=300, capture_output=True)
    lines = log.read_text().splitlines()
    runner = lines[0].split()[0]        # the runner's main thread (Python-level probes such as urllib3's
    kernel = [ln for ln in lines if ln.split()[0] != runner]   # IPv6 check are harmless there)
    assert any("AF_UNIX" in ln for ln in kernel)
    assert not [ln for ln in kernel if "AF_INET" in ln], [ln for ln in kernel if "AF_INET" in ln]


def test_save_figure_writes_png_in_a_fresh_process(tmp_path):
    """With a browser, a figure is a PNG, in a process where nothing else has imported kaleido first
    (as in a notebook's kernel: a fresh clone's `make run` once wrote HTML only, because the logger
    filter was set up before choreographer's logger class existed)."""
    if _headless_browser() is None:
        pytest.skip("no headless browser binary (/usr/bin/chromium-headless-shell or chromium; `make browser` "
                    "installs one): kaleido cannot write PNG")
    code = ("import plotly.graph_objects as go; from mk.notebooks.runner import save_figure; "
            f"print(save_figure(go.Figure(go.Bar(x=[1], y=[2])), 'f', {str(tmp_path)!r}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("f.png"), run.stdout + run.stderr
    assert "PNG export failed" not in run.stderr, run.stderr
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kernel_is_this_environments_interpreter(tmp_path, monkeypatch):
    """Another virtual environment's python links to the same base interpreter; its kernel spec
    must not be taken for ours (the notebooks would run on that checkout's installed `mk`)."""
    import sys
    from jupyter_client import kernelspec
    other = tmp_path / "other-venv" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.symlink_to(os.path.realpath(sys.executable))
    specs = {"mk": {"spec": {"argv": [str(other), "-m", "ipykernel_launcher"]}}}
    installed = []
    monkeypatch.setattr(kernelspec.KernelSpecManager, "get_all_specs", lambda self: specs)
    import ipykernel.kernelspec
    monkeypatch.setattr(ipykernel.kernelspec, "install", lambda **kw: installed.append(kw))
    name = notebook_runner._kernel_name()
    assert name != "mk" and name.startswith("mk-") and installed[0]["kernel_name"] == name
    specs[name] = {"spec": {"argv": [sys.executable, "-m", "ipykernel_launcher"]}}
    assert notebook_runner._kernel_name() == name and len(installed) == 1      # found, not installed again


NAMED_FIGURE = """import plotly.graph_objects as go
from mk.notebooks.runner import save_figure
fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
print("saved:", save_figure(fig, "bars"))
fig.show()
go.Figure(go.Scatter(x=[1], y=[1])).show()"""


def _one_cell_notebook(src, body, name="01_n.ipynb"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    p = nbformat.v4.new_code_cell("x = 1")
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(body)]
    src.mkdir(exist_ok=True)
    nbformat.write(nb, str(src / name))


def test_no_export_keeps_named_figures_in_the_notebook_for_later_rendering(tmp_path, monkeypatch):
    """--no-export (the TPU VM: no browser, maybe no nbconvert): executed notebook only, over TCP
    here to cover the other transport; each figure's JSON names itself for `render_figures`."""
    _one_cell_notebook(tmp_path / "src", NAMED_FIGURE)
    out = tmp_path / "out"
    monkeypatch.delenv("PLOTLY_RENDERER", raising=False)
    res = run_all(out, directory=tmp_path / "src", export=False, transport="tcp")
    assert res[0]["ok"], res
    assert not (out / "01_n.html").exists() and not (out / "figures").exists()
    ran = nbformat.read(str(out / "01_n.ipynb"), as_version=4)
    printed = "".join(o.get("text", "") for c in ran.cells for o in c.get("outputs", []))
    assert "saved: None" in printed
    figs = notebook_runner.plotly_figures(out / "01_n.ipynb")
    assert [n for n, _ in figs] == ["bars", "01_n_cell1_2"]
    assert figs[0][1]["data"][0]["type"] == "bar"
    html_outputs = [o for c in ran.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})]
    assert not html_outputs, "without export the notebook should not embed plotly.js"
    if _headless_browser() is None:
        monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-browser"))
        monkeypatch.setattr(notebook_runner, "BROWSER_CANDIDATES", ())
        with pytest.raises(RuntimeError, match="no headless browser"):
            notebook_runner.render_figures(out)
        return
    paths = notebook_runner.render_figures(out)
    assert [os.path.basename(p) for p in paths] == ["bars.png", "01_n_cell1_2.png"]
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_cli_render_figures_needs_executed_notebooks(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mk", "notebooks", "--render-figures", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "no executed notebooks" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, "-m", "mk", "notebooks"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "required: --out" in run.stderr, run.stderr


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="transport must be one of"):
        notebook_runner._kernel_manager("udp")
