"""AttnRes inside the kernel: the mix reads a fixed number of snapshot slots, masking unused ones."""
from __future__ import annotations

import jax

from mk.model.layers.attn_res import mix_candidates
from mk.model.layers.common import f32


def mix(p: jax.Array, blocks_ref, n_blocks, w: jax.Array, eps: float) -> jax.Array:
    """p [R, d] bf16, blocks_ref [nb, R, d] f32 (slots >= n_blocks hold zeros), n_blocks: traced
    int, w [1, d] f32 -> [R, d] bf16. Bit-identical to the reference mix over the first n_blocks."""
    nb = blocks_ref.shape[0]
    cands = [blocks_ref[j] for j in range(nb)] + [f32(p)]
    valid = [n_blocks > j for j in range(nb)] + [True]
    return mix_candidates(cands, w, eps, valid)
