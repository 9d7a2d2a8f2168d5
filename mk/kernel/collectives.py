"""In-kernel collectives: rounds of remote copies, every rank to every peer.

Every collective of the step (`Plan.collectives`: the embedding sum, the attention output
projection, layer 0's dense MLP, and the MoE's latent gather, routed sum and output sum) is
the same pattern, an *exchange*:

    rank r:  send[par] <- bf16(x)                      (the wire is bf16, spec 3.9)
             landing[par, r] <- bf16(x)                (own slot, local store)
             for each peer p != r: remote copy send[par] -> landing[par, r] on p
             wait for the N - 1 messages landing in landing[par, p], then for our N - 1 sends

    all_reduce: sum landing[par, 0..N-1] in fp32 in rank order, round to bf16 (same bits on
                every rank; every consumer rounds the sum to bf16, spec 3.9)
    all_gather: lay landing[par, 0..N-1] side by side in rank order

    rank 0   rank 1   rank 2   rank 3        landing[par] on every rank after the exchange:
      x0       x1       x2       x3     ->   [ x0 | x1 | x2 | x3 ]     (one slot per source)

Why this is safe without a barrier per collective: a rank sends round i only after it has
finished reading round i - 1, and nobody can finish round i before hearing from every rank. So a
fast peer is at most one round ahead, and alternating two buffer sets (`par` = round count mod 2)
keeps its writes out of the slots a slow rank still reads. Each message
has its own send and receive semaphore. Landing buffers are kernel scratch, so the step opens
with a barrier (`barrier`): nobody sends into a peer that is still inside the previous step.

A message carries the step's B token rows only (`Plan.message_rows`), not the padding rows of
the 8-row matmul tile: a [B, width] bf16 buffer, which Mosaic pads to its row tile (2 rows at
B = 1, 4 at B = 3 or 4, 8 above), so a B = 1 message moves a quarter of the tile's bytes. The
receiver pads the result back to the matmul's rows with zeros.

An all-reduce takes one round or two (`Collective.rounds`, chosen by the plan): one round sends
N - 1 whole messages and pays one hop's latency; two rounds, a reduce-scatter (rank p sums
everyone's lanes p * chunk .. (p + 1) * chunk) then an all-gather of the rounded chunks, send
2 (N - 1) chunks of width / N lanes and pay two hops. Both give every rank the same bits. Decode
messages are KiB at B = 1, where a hop's fixed cost weighs most; at B = 8 on 32 cores the N - 1
copies of one round cost more than a second hop (compare the seed's two-level exchange, 3.8).
Not handled: topologies where some peers are unreachable by direct remote copy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mk.model.layers.common import bf, f32

MESH = pl.DeviceIdType.MESH


def device_id(plan, rank: int) -> tuple[int, int]:
    """Mesh coordinates (ep, tp) of `rank` (row-major, see mk.model.sharding)."""
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
    """The remote copies of one exchange round: `start()` the N - 1 sends, `wait()` for everything.

    `chunk` = 0: every peer gets our whole message (lanes 0..width). `chunk` > 0 (the scatter round
    of a two-round all-reduce): peer p gets lanes p * chunk .. (p + 1) * chunk of it."""

    def __init__(self, plan, refs, parity, width: int, chunk: int = 0):
        self.plan, self.refs, self.par, self.width, self.chunk = plan, refs, parity, width, chunk
        self.me = refs.rank[0]

    def _copy(self, peer: int, source: object):
        """Copy of `source`'s message (the part for `peer`): our send buffer -> landing[par, source]
        on `peer`."""
        r, par, c = self.refs, self.par, self.chunk
        src = pl.ds(peer * c, c) if c else pl.ds(0, self.width)
        return pltpu.make_async_remote_copy(
            r.send.at[par, :, src], r.landing.at[par, source, :, pl.ds(0, c or self.width)],
            r.send_sems.at[par, peer], r.recv_sems.at[par, source],
            device_id=device_id(self.plan, peer), device_id_type=MESH)

    def start(self, wire):
        r, par, c = self.refs, self.par, self.chunk
        r.send[par, :, pl.ds(0, wire.shape[-1])] = wire
        if c:                                                   # our own part, from lane me * chunk
            r.landing[par, self.me, :, pl.ds(0, c)] = r.send[par, :, pl.ds(pl.multiple_of(self.me * c, 128), c)]
        else:
            r.landing[par, self.me, :, pl.ds(0, self.width)] = wire
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
        """The N messages, in rank order: [M, chunk or width] bf16 each (M = `Plan.message_rows`)."""
        lanes = pl.ds(0, self.chunk or self.width)
        return [self.refs.landing[self.par, j, :, lanes] for j in range(self.plan.devices)]


def _start_exchange(k, wire: jax.Array, width: int, chunk: int = 0) -> Exchange:
    """Start one exchange round (wire [M, width] bf16 out) on the next collective parity; the caller
    `wait()`s for it before it starts another."""
    ring = k.ring
    ex = Exchange(k.plan, k.refs, ring.c["coll"] % 2, width, chunk)
    ex.start(wire)
    ring.c = dict(ring.c, coll=ring.c["coll"] + 1)
    return ex


def _exchange(k, name: str, wire: jax.Array, width: int, chunk: int = 0) -> list[jax.Array]:
    """One exchange round of collective `name`: wire [M, width] bf16 out, the N ranks' messages in."""
    ex = _start_exchange(k, wire, width, chunk)
    ex.wait()
    return ex.messages()


def _collective(k, name: str, x: jax.Array):
    coll = k.plan.collectives[name]
    if x.shape[-1] != coll.width:
        raise ValueError(f"collective {name}: message of {x.shape[-1]} lanes, plan says {coll.width}")
    return coll, bf(x[:coll.rows])


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """[M, w] -> [rows, w]: zero rows below the message's M token rows."""
    if x.shape[0] == rows:
        return x
    return jnp.concatenate([x, jnp.zeros((rows - x.shape[0], x.shape[1]), x.dtype)], axis=0)


def _rank_sum(msgs: list[jax.Array]) -> jax.Array:
    """bf16 messages summed in fp32 in rank order, rounded to bf16 (the same bits on every rank)."""
    acc = f32(msgs[0])
    for m in msgs[1:]:
        acc = acc + f32(m)
    return bf(acc)


def all_reduce(k, name: str, partial: jax.Array) -> jax.Array:
    """partial [R, w] f32 -> bf16(sum over ranks of bf16(partial)), the sum fp32 in rank order:
    [R, w] bf16 (rows past the message's token rows are zero).

    One round (`Collective.rounds` = 1): every rank sends its whole message to every peer and sums
    all N. Two rounds: a reduce-scatter (rank p receives everyone's lanes p * chunk ..
    (p + 1) * chunk and sums them) then an all-gather of the rounded chunks: the same bits, 2 (N-1)
    chunks sent instead of N - 1 whole messages. On one device: bf16(partial), no communication."""
    if k.plan.devices == 1:
        return bf(partial)
    coll, wire = _collective(k, name, partial)
    with jax.named_scope(f"collective_{name}"):
        if coll.rounds == 1:
            out = _rank_sum(_exchange(k, name, wire, coll.width))
        else:
            mine = _rank_sum(_exchange(k, name, wire, coll.width, coll.chunk))          # [M, chunk]
            out = jnp.concatenate(_exchange(k, name, mine, coll.chunk), axis=-1)[:, :coll.width]
    return _pad_rows(out, partial.shape[0])


def start_all_gather(k, name: str, x: jax.Array):
    """The all-gather of x [R, w] bf16 (this rank's block), in two halves: the sends start now; the
    returned `finish()` waits for the messages and returns [R, N * w] bf16, blocks in rank order
    (rows past the message's token rows are zero). Work between the two runs while the messages fly
    (`Phase.overlap` in the plan); it must not start another collective."""
    if k.plan.devices == 1:
        return lambda: x
    coll, wire = _collective(k, name, x)
    with jax.named_scope(f"collective_{name}_start"):
        ex = _start_exchange(k, wire, coll.width)

    def finish():
        with jax.named_scope(f"collective_{name}_wait"):
            ex.wait()
            out = jnp.concatenate(ex.messages(), axis=-1)
        return _pad_rows(out, x.shape[0])
    return finish
