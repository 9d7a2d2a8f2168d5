"""In-kernel collectives: one round of remote copies, every rank to every peer.

Every collective of the step (`Plan.collectives`: the embedding sum, the attention output
projection, layer 0's dense MLP, and the MoE's latent gather, routed sum and output sum) is
the same pattern, an *exchange*:

    rank r:  send[par] <- bf16(x)                      (the wire is bf16, spec 3.9)
             landing[par, r] <- bf16(x)                (own slot, local store)
             for each peer p != r: remote copy send[par] -> landing[par, r] on p
             wait for the N - 1 messages landing in landing[par, p], then for our N - 1 sends

    all_reduce: sum landing[par, 0..N-1] in fp32 in rank order   (same bits on every rank)
    all_gather: lay landing[par, 0..N-1] side by side in rank order

    rank 0   rank 1   rank 2   rank 3        landing[par] on every rank after the exchange:
      x0       x1       x2       x3     ->   [ x0 | x1 | x2 | x3 ]     (one slot per source)

Why this is safe without a barrier per collective: a rank sends collective i only after it has
finished reading collective i - 1, and nobody can finish collective i before hearing from every
rank. So a fast peer is at most one collective ahead, and alternating two buffer sets (`par` =
collective count mod 2) keeps its writes out of the slots a slow rank still reads. Each message
has its own send and receive semaphore. Landing buffers are kernel scratch, so the step opens
with a barrier (`barrier`): nobody sends into a peer that is still inside the previous step.

A message carries the step's B token rows only (`Plan.message_rows`), not the padding rows of
the 8-row matmul tile: a [B, width] bf16 buffer, which Mosaic pads to its row tile (2 rows at
B = 1, 4 at B = 3 or 4, 8 above), so a B = 1 message moves a quarter of the tile's bytes. The
receiver pads the result back to the matmul's rows with zeros.

One round (N - 1 messages of B rows) trades bandwidth for latency: decode messages are a few
KiB, where the fixed cost of a hop dominates (compare the seed's two-level exchange, spec 3.8).
Not handled: topologies where some peers are unreachable by direct remote copy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.layers.common import bf, f32

MESH = pl.DeviceIdType.MESH


def device_id(plan, rank: int) -> tuple[int, int]:
    """Mesh coordinates (ep, tp) of `rank` (row-major, see mk.sharding)."""
    return rank // plan.layout.tp_expert, rank % plan.layout.tp_expert


def barrier(plan, refs):
    """Entry barrier: signal every peer, wait until all N - 1 peers have entered this step."""
    me, N = refs.rank[0], plan.devices
    sem = pltpu.get_barrier_semaphore()
    for p in range(N):
        @pl.when(me != p)
        def _signal(p=p):
            pl.semaphore_signal(sem, 1, device_id=device_id(plan, p), device_id_type=MESH)
    pl.semaphore_wait(sem, N - 1)


class Exchange:
    """The remote copies of one collective: `start()` the N - 1 sends, `wait()` for everything."""

    def __init__(self, plan, refs, parity, width: int):
        self.plan, self.refs, self.par, self.width = plan, refs, parity, width
        self.me = refs.rank[0]

    def _copy(self, peer: int, source: object):
        """Copy of `source`'s message: our send buffer -> landing[par, source] on `peer`."""
        r, par, lanes = self.refs, self.par, pl.ds(0, self.width)
        return pltpu.make_async_remote_copy(
            r.send.at[par, :, lanes], r.landing.at[par, source, :, lanes],
            r.send_sems.at[par, peer], r.recv_sems.at[par, source],
            device_id=device_id(self.plan, peer), device_id_type=MESH)

    def start(self, wire):
        r, par, lanes = self.refs, self.par, pl.ds(0, self.width)
        r.send[par, :, lanes] = wire
        r.landing[par, self.me, :, lanes] = wire
        for p in range(self.plan.devices):
            @pl.when(self.me != p)
            def _send(p=p):
                self._copy(p, self.me).start()

    def wait(self):
        for p in range(self.plan.devices):
            @pl.when(self.me != p)
            def _receive(p=p):
                self._copy(p, p).wait_recv()          # message from rank p has landed
        for p in range(self.plan.devices):
            @pl.when(self.me != p)
            def _sent(p=p):
                self._copy(p, self.me).wait_send()    # our send buffer may be reused

    def messages(self) -> list[jax.Array]:
        """The N messages, in rank order: [M, width] bf16 each (M = `Plan.message_rows`)."""
        return [self.refs.landing[self.par, j, :, pl.ds(0, self.width)] for j in range(self.plan.devices)]


def _exchange(k, name: str, x: jax.Array) -> list[jax.Array]:
    """x [R, w] -> the N ranks' messages bf16(x[:M]), [M, w] bf16 each, in rank order."""
    coll = k.plan.collectives[name]
    if x.shape[-1] != coll.width:
        raise ValueError(f"collective {name}: message of {x.shape[-1]} lanes, plan says {coll.width}")
    ring = k.ring
    with jax.named_scope(f"collective_{name}"):
        ex = Exchange(k.plan, k.refs, ring.c["coll"] % 2, coll.width)
        ex.start(bf(x[:coll.rows]))
        ex.wait()
        ring.c = dict(ring.c, coll=ring.c["coll"] + 1)
        return ex.messages()


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """[M, w] -> [rows, w]: zero rows below the message's M token rows."""
    if x.shape[0] == rows:
        return x
    return jnp.concatenate([x, jnp.zeros((rows - x.shape[0], x.shape[1]), x.dtype)], axis=0)


def all_reduce(k, name: str, partial: jax.Array) -> jax.Array:
    """partial [R, w] f32 -> sum over ranks of bf16(partial), fp32 in rank order: [R, w] f32
    (rows past the message's token rows are zero).

    On one device this is f32(bf16(partial)): the same rounding point, no communication."""
    if k.plan.devices == 1:
        return f32(bf(partial))
    msgs = _exchange(k, name, partial)
    acc = f32(msgs[0])
    for m in msgs[1:]:
        acc = acc + f32(m)
    return _pad_rows(acc, partial.shape[0])


def all_gather(k, name: str, x: jax.Array) -> jax.Array:
    """x [R, w] bf16 (this rank's block) -> [R, N * w] bf16, blocks in rank order (rows past the
    message's token rows are zero)."""
    if k.plan.devices == 1:
        return x
    return _pad_rows(jnp.concatenate(_exchange(k, name, x), axis=-1), x.shape[0])
