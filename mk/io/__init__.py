"""The io layer: the model's files on disk.

`checkpoint` (reading Hugging Face-style checkpoints: format, sources, MXFP4 dequantization, lazy
parameters), `synth` (writing synthetic checkpoints), `tokenizer` (the checkpoint's tokenizer).

May import `mk.errors` and `mk.model`; never `mk.kernel`, `mk.perf`, `mk.notebooks` or `mk.cli`.
"""
