"""The model layer: what a K3 decode step computes, with no kernel and no files.

`config` (the model contract), `params` (parameter shapes, random well-behaved weights), `layers`
(the sublayers as pure functions), `reference` (the pure-JAX decode step, the oracle),
`reference_sharded` (the same step split over a mesh), `layout` (how a step is split over devices:
`Layout`, `PlanError`), `sharding` (the rule that splits it), `drafter` (the DSpark block drafter).

May import `mk.errors` only; never `mk.io`, `mk.kernel`, `mk.perf`, `mk.notebooks` or `mk.cli`.
"""
