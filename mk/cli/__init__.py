"""The cli layer, the top of the house: `python -m mk COMMAND` (mk/__main__.py), one module a command.

`common` (shared options and progress bars), `distributed` (multi-process options and meshes),
`checkpoint`, `generate`, `kernel`, `simulate`, `bench`, `microbench`, `notebooks`, `results`, `sweep`.

May import every layer: `mk.errors`, `mk.model`, `mk.io`, `mk.kernel`, `mk.perf`, `mk.notebooks`.
"""
