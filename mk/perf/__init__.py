"""The perf layer: what a step costs, modelled and measured.

`hardware` (chips, systems and measured constants from data/*.csv), `routing` (distinct experts per
device), `roofline` (lower bounds read off a plan), `sim` (the discrete-event simulator replaying a
plan's schedule, and its what-ifs), `trace` (Chrome traces of a simulated step), `microbench`
(on-chip measurements), `baseline` (the fair XLA step), `bench` (timing kernel, XLA and reference)
`results` (measurement records: JSON with commit, date, chip and command), `cases` (the cases the
records measured, the races and the sweep table) and `sweep` (`mk sweep`'s cases, resume and estimates).

May import `mk.errors`, `mk.model`, `mk.io` and `mk.kernel`; never `mk.notebooks` or `mk.cli`.
"""
