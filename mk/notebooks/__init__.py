"""The notebooks layer: what the research notebooks (notebooks/*.ipynb) call.

`helpers` (loading a model, chip roofs, kernel sweeps and profiles for the notebooks' cells) and
`runner` (executing every notebook headless and exporting its figures, `mk notebooks`).

May import every layer below: `mk.errors`, `mk.model`, `mk.io`, `mk.kernel`, `mk.perf`; never `mk.cli`.
"""
