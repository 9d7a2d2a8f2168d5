"""How one decode step is split over a mesh of devices: the rule, written once.

The mesh has two axes, `("ep", "tp")`, of sizes `(ep, tp_expert)`; its `N = ep * tp_expert`
devices are numbered row-major (rank `r = ep_index * tp_expert + tp_index`, the order of
`jax.devices()`). Every dimension that is split "over all devices" uses both axes together
(`ALL`), so rank r owns its r-th block. The rule:

| what | split | per rank |
|---|---|---|
| attention (KDA and MLA) | heads over ALL | H/N whole heads: q/k/v/g/b, f_b, conv taps, decay, MLA q_b/kv_b/g columns, o_proj rows |
| MLA q_a, kv_a (+ their norms), KDA f_a | replicated | small outputs: every rank computes them |
| layer-0 dense MLP | width over ALL | gate/up columns, down rows |
| shared experts | width over ALL | gate/up columns, down rows |
| latent down / up projection, latent norm | latent width over ALL | down columns, up rows |
| routed experts | experts over `ep`, each expert's FFN width over `tp` | E/ep experts x Fe/tp_expert |
| router, norms, AttnRes queries, router bias | replicated | |
| embedding / LM head | vocabulary over ALL | V/N rows / columns |
| KDA states, conv states, MLA caches | heads over ALL | as their weights |

Outputs that must agree everywhere (the residual stream p, routing decisions) are computed
redundantly on every rank from bit-identical inputs; everything that is split produces partial
sums that the step reduces (see `mk.kernel.plan`'s collectives). The seed's TPU v7 system (spec 3.2) is
the instance N = 32, ep = 8, tp_expert = 4 of this rule (`default_layout`).
"""
from __future__ import annotations

import numpy as np

from mk.model.config import K3Config
from mk.model.layout import Layout, PlanError

AXES = ("ep", "tp")
ALL = AXES            # a dimension split over every device


def default_layout(cfg: K3Config, devices: int, ep: int | None = None) -> Layout:
    """The layout for `devices` devices: attention over all of them, experts ep x tp_expert.

    ep (unless given): the largest divisor of `devices` that is at most max(1, top_k // 2) and
    divides the experts, whose complement divides the expert FFN width. With top_k / 2 expert
    groups, a single token's top_k experts land on every group on average, so no group idles at
    batch 1 (K3 on 32 devices: ep 8, tp_expert 4, the seed's split).
    """
    if devices < 1:
        raise PlanError(f"mesh: the number of devices must be >= 1, found {devices}")
    if ep is None:
        cands = [e for e in range(1, devices + 1) if devices % e == 0 and e <= max(1, cfg.top_k // 2)
                 and cfg.experts % e == 0 and cfg.expert_hidden % (devices // e) == 0]
        ep = max(cands) if cands else 1
    if devices % ep:
        raise PlanError(f"mesh: ep={ep} does not divide the {devices} devices")
    lay = Layout(chips=devices, cores_per_chip=1, tp_attn=devices, ep=ep, tp_expert=devices // ep)
    check_layout(cfg, lay)
    return lay


def check_layout(cfg: K3Config, lay: Layout) -> None:
    """Raise PlanError naming the config width that the mesh does not divide."""
    n = lay.devices
    if lay.tp_attn != n or lay.ep * lay.tp_expert != n:
        raise PlanError(f"mesh of {n} devices: need tp_attn == ep * tp_expert == {n}, found "
                        f"tp_attn={lay.tp_attn}, ep={lay.ep}, tp_expert={lay.tp_expert}")
    rules = [("heads", cfg.heads, n), ("dense_hidden", cfg.dense_hidden, n),
             ("shared experts' width", cfg.shared_hidden, n), ("latent", cfg.latent, n),
             ("vocab", cfg.vocab, n), ("experts", cfg.experts, lay.ep),
             ("expert_hidden", cfg.expert_hidden, lay.tp_expert)]
    for name, width, parts in rules:
        if width % parts:
            raise PlanError(f"mesh of {n} devices (ep={lay.ep} x tp_expert={lay.tp_expert}) does not "
                            f"divide the config: {name} = {width} is not a multiple of {parts}")
    if (cfg.vocab // n) % 16:
        raise PlanError(f"mesh of {n} devices: vocab / devices = {cfg.vocab // n} must be a multiple "
                        f"of 16 (embedding rows move in aligned 16-row groups)")


# --------------------------------------------------------------------------------------------
# Which axis of every array is split (PartitionSpec entries, as tuples)
# --------------------------------------------------------------------------------------------
# key path -> spec tuple (one entry per array dim; None = not split). Absent = replicated.
_PARAM_SPECS = {
    ("embed",): (ALL, None),
    ("lm_head",): (None, ALL),
    ("kda", "f_b"): (None, None, ALL),
    ("kda", "q"): (None, None, ALL), ("kda", "k"): (None, None, ALL), ("kda", "v"): (None, None, ALL),
    ("kda", "g"): (None, None, ALL), ("kda", "b"): (None, None, ALL),
    ("kda", "o"): (None, ALL, None),
    ("kda", "conv"): (None, None, None, ALL),
    ("kda", "a_log"): (None, ALL), ("kda", "dt_bias"): (None, ALL),
    ("mla", "q_b"): (None, None, ALL), ("mla", "kv_b"): (None, None, ALL), ("mla", "g"): (None, None, ALL),
    ("mla", "o"): (None, ALL, None),
    ("dense", "gate"): (None, ALL), ("dense", "up"): (None, ALL), ("dense", "down"): (ALL, None),
    ("moe", "latent_down"): (None, None, ALL), ("moe", "latent_up"): (None, ALL, None),
    ("moe", "latent_norm"): (None, ALL),
    ("moe", "shared_gate"): (None, None, ALL), ("moe", "shared_up"): (None, None, ALL),
    ("moe", "shared_down"): (None, ALL, None),
    ("moe", "w1"): (None, "ep", None, "tp"), ("moe", "w3"): (None, "ep", None, "tp"),
    ("moe", "w2"): (None, "ep", "tp", None),
}

CACHE_SPECS = {
    "pos": (None,),
    "state_row": (None,),                          # [B] the kernel's verify cache (mk.kernel.decode.commit)
    "kda_state": (None, None, ALL, None, None),    # [B, n_kda, H, D, D]
    "conv_state": (None, None, None, None, ALL),   # [B, n_kda, 3, C-1, HD]
    "mla_k": (None, None, ALL, None, None),        # [B, n_mla, H, ctx, Kc]
    "mla_v": (None, None, ALL, None, None),        # [B, n_mla, H, ctx, D]
}


def param_spec(path: tuple[str, ...], ndim: int) -> tuple:
    """The split of the params leaf at `path` (e.g. ("moe", "w1")); replicated if not listed.

    MXFP4 expert leaves (`moe.w1.packed` etc., checkpoint orientation [n, E, N, K/2]) split E
    over ep and their FFN axis over tp, like the bf16 ones.
    """
    if len(path) == 3 and path[:2] in {("moe", "w1"), ("moe", "w3"), ("moe", "w2")}:
        ffn_axis = 2 if path[1] in ("w1", "w3") else 3       # w1/w3: N = Fe; w2: K = Fe
        spec = [None] * ndim
        spec[1], spec[ffn_axis] = "ep", "tp"
        return tuple(spec)
    spec = _PARAM_SPECS.get(tuple(path), ())
    return tuple(spec) + (None,) * (ndim - len(spec))


def _path_keys(path) -> tuple[str, ...]:
    return tuple(getattr(p, "key", getattr(p, "name", p)) for p in path)


def param_specs(tree) -> dict:
    """A tree of `jax.sharding.PartitionSpec` matching `tree` (params or `mk.model.params.shapes`)."""
    import jax
    from jax.sharding import PartitionSpec as P
    return jax.tree_util.tree_map_with_path(
        lambda path, x: P(*param_spec(_path_keys(path), len(x.shape))), tree)


def cache_specs(cache) -> dict:
    from jax.sharding import PartitionSpec as P
    return {k: P(*CACHE_SPECS[k]) for k in cache}


def make_mesh(lay: Layout, devices=None):
    """A `Mesh` of shape (ep, tp_expert) over the first N devices (default: `jax.devices()`)."""
    import jax
    from jax.sharding import Mesh
    devices = list(jax.devices() if devices is None else devices)
    n = lay.devices
    if len(devices) < n:
        raise PlanError(f"mesh of {n} devices requested but only {len(devices)} are available "
                        f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    return Mesh(np.array(devices[:n]).reshape(lay.ep, lay.tp_expert), AXES)


# --------------------------------------------------------------------------------------------
# One rank's share, on the host
# --------------------------------------------------------------------------------------------
def coords(lay: Layout, rank: int) -> dict[str, int]:
    return {"ep": rank // lay.tp_expert, "tp": rank % lay.tp_expert}


def block_index(entry, lay: Layout, rank: int) -> tuple[int, int]:
    """(block, blocks) of a spec entry for `rank`: which of how many equal blocks it owns."""
    if entry is None:
        return 0, 1
    c = coords(lay, rank)
    names = entry if isinstance(entry, tuple) else (entry,)
    sizes = {"ep": lay.ep, "tp": lay.tp_expert}
    block, blocks = 0, 1
    for n in names:                                  # row-major over the named axes
        block, blocks = block * sizes[n] + c[n], blocks * sizes[n]
    return block, blocks


def local_index(spec: tuple, shape: tuple[int, ...], lay: Layout, rank: int) -> tuple[slice, ...]:
    """The index (tuple of slices) of `rank`'s block of an array of `shape` split by `spec`."""
    out = []
    for entry, size in zip(spec, shape):
        block, blocks = block_index(entry, lay, rank)
        if size % blocks:
            raise PlanError(f"cannot split a dimension of {size} into {blocks} equal blocks")
        step = size // blocks
        out.append(slice(block * step, (block + 1) * step))
    return tuple(out) + (slice(None),) * (len(shape) - len(out))


def local_params(params: dict, lay: Layout, rank: int) -> dict:
    """Rank `rank`'s share of a params tree (numpy arrays, no copy where slicing allows; jax arrays,
    traced ones too, are sliced where they are)."""
    import jax

    def take(path, x):
        keys = _path_keys(path)
        spec = param_spec(keys, np.ndim(x))
        return (x if isinstance(x, jax.Array) else np.asarray(x))[local_index(spec, np.shape(x), lay, rank)]
    return jax.tree_util.tree_map_with_path(take, params)


def latent_block(cfg: K3Config, lay: Layout) -> int:
    """Lanes each rank's slice of the latent width occupies in the kernel (128-aligned)."""
    return -(-(cfg.latent // lay.devices) // 128) * 128


def gcd_devices(cfg: K3Config, devices: int) -> int:
    """Largest mesh size <= devices that divides the config (for notebooks on a big host)."""
    for n in range(devices, 0, -1):
        try:
            default_layout(cfg, n)
            return n
        except PlanError:
            continue
    return 1


__all__ = ["AXES", "ALL", "CACHE_SPECS", "default_layout", "check_layout", "param_spec", "param_specs",
           "cache_specs", "make_mesh", "coords", "local_index", "local_params", "latent_block",
           "gcd_devices"]
