"""The kernel layer: the megakernel, the plan it runs, and what checks it.

`plan` (the step's schedule as data: matrices, tiles, buffers, options) and its walkers `schedule`
and `conventional` (the DMA and phase lists a megakernel or a one-kernel-per-op program runs);
`packing` (the weights laid out in stream order); the Pallas kernel itself (`decode`, `ring`,
`refs`, `collectives` and one file per sublayer: `attn_res`, `kda`, `mla`, `dense_mlp`, `moe`);
`step` (the kernel as a decode step: `make_step_fn`, `kernel_weights`, `KernelVerifier`); `aot`
(deviceless TPU compilation); `check` (kernel vs reference); `speculative` (draft-and-verify
generation, bounded by the plan's rows).

May import `mk.errors`, `mk.model` and `mk.io`; never `mk.perf`, `mk.notebooks` or `mk.cli`.
"""
