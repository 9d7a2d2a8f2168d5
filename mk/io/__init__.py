"""The io layer: the model's files on disk.

`schema` (a checkpoint's files, its errors and the tensor <-> parameter-tree table), `convert` (MXFP4
dequantization, fast transposes, aligned host buffers), `checkpoint` (reading: validation, streaming,
lazy and sharded parameters), `synth` (writing synthetic checkpoints), `tokenizer` (the checkpoint's tokenizer).

May import `mk.errors` and `mk.model`; never `mk.kernel`, `mk.perf`, `mk.notebooks` or `mk.cli`.
"""
