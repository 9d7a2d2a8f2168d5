"""Load a Kimi K3 checkpoint in Hugging Face format into the parameter tree of `mk.model.params`.

A checkpoint directory holds (spec 2.1):

    config.json                      the model config, validated by `K3Config.from_hf`
    model.safetensors.index.json     {"weight_map": {tensor name: shard file}}
    model-*.safetensors              the shards
    tiktoken.model, tokenizer_config.json, tokenization_kimi.py   (see `mk.io.tokenizer`)

`load(path)` returns exactly the tree of `mk.model.params.shapes(cfg)`: same keys, shapes and dtypes.
The mapping from checkpoint tensors (PyTorch `[out, in]`, names of spec 2.2) to that tree is one
table, `mk.io.schema.layout(cfg)`, that `mk.io.synth` also uses to write checkpoints:

    transposed matrices    W [out, in]            -> family[i] = W.T             ([in, out])
    KDA short convolutions {q,k,v}_conv1d [HD,1,C] -> kda.conv[i, 0/1/2] = W[:, 0, :].T  ([C, HD])
    AttnRes weights        norm [d] x proj [1, d] -> one fp32 vector norm * proj (folded, fp32)
    routed experts (MXFP4) packed [N, K/2] u8 + scale [N, K/32] u8 -> moe.w1/w3/w2[m, e] = W.T

Routed experts: `experts="bf16"` (default) dequantizes them to bf16 `[in, out]` like every other
matrix. `experts="mxfp4"` keeps the checkpoint bytes and replaces `moe.w1`, `moe.w3`, `moe.w2` by

    {"packed": u8 [n_moe, E, N, K/2], "scale": u8 [n_moe, E, N, K/32]}

in CHECKPOINT orientation (row n = one output feature; low nibble = even k; one E8M0 exponent per
32 consecutive k), with (N, K) = (expert_hidden, latent) for w1 (gate) and w3 (up), and
(latent, expert_hidden) for w2 (down). `mk.io.convert.dequantize_mxfp4(packed, scale)` turns either back into
the bf16 `[..., K, N]` array the bf16 mode returns, bit for bit.

Loading first validates everything it can without reading tensor data: the index, every shard it
references (existence, safetensors header, file size), and the name, shape and dtype of every
tensor the model needs. Only then are arrays allocated and filled, family by family, layer by
layer; E8M0 scale bytes are checked as they stream. Any bad input raises a subclass of
`CheckpointError` whose message names the file and the tensor or key at fault; no partially
filled tree is ever returned. Peak host memory is the output plus one tensor's working set (big
tensors are streamed in row chunks of at most `CHUNK_BYTES`): arrays are preallocated per family,
filled in place, and handed to JAX without a copy (CPU) at the end. Tensors stored as the tree
holds them (packed experts, norms) are read straight into their slots, back-to-back ones by one
scatter `preadv` (up to CHUNK_BYTES each). The tensors of a layer are filled by a small thread pool (`threads`, default 2; numpy copies and XLA release the GIL), big
bf16 transposes and MXFP4 dequantization run as small XLA programs (XLA's tiled transpose is
several times faster than numpy's strided copy), and a `ShardStreamer` thread reads the shards
into the page cache ahead of the conversion (cold loads overlap storage reads with conversion).
Benchmark: `python -m mk load DIR --bench [--cold] --json`.

Every read goes through `Checkpoint.read(name, rows=..., cols=...)` (or `read_into`), so a
tensor/expert-parallel loader can fetch only the byte ranges one rank needs: whole tensors and row
ranges by `preadv`, column ranges through safetensors' memory-mapped `get_slice`. Shards are not
kept mapped otherwise (safetensors checks each header, then the file is closed): a mapped file's
pages count in the process's resident set (in a gVisor sandbox, such as the lent TPU VM, all of
them from the start).
"""
from __future__ import annotations

import concurrent.futures
import gc
import dataclasses
import itertools
import json
import os
import threading
from typing import Iterable, Sequence

import ml_dtypes
import numpy as np

from mk.model.config import ConfigError, MX_GROUP, K3Config
from mk.io.convert import _dequant_into, _transpose_into, aligned_empty, bad_scale_position, dequantize_mxfp4
from mk.io.schema import (BF16, CHUNK_BYTES, CONFIG_FILE, F32, INDEX_FILE, U8, CheckpointConfigError, CheckpointError,
                          CorruptHeaderError, CorruptShardError, Entry, IndexFormatError, MissingFileError,
                          MissingShardError, MissingTensorError, ScaleByteError, Source, TensorDtypeError,
                          TensorShapeError, TruncatedShardError, _NP_DTYPES, _check_mx, layout)

# ---- reading ------------------------------------------------------------------------------------------
def load_config(path) -> K3Config:
    """The validated config of a checkpoint directory (CheckpointError subclasses on bad input)."""
    path = os.fspath(path)
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise MissingFileError(f"{file}: config.json not found")
    try:
        cfg = K3Config.from_hf(file)
    except ConfigError as e:
        msg = str(e)
        raise CheckpointConfigError(msg if file in msg else f"{file}: {msg}") from None
    _check_mx(cfg, file)
    return cfg


class Checkpoint:
    """An opened checkpoint directory: config, index and (lazily opened) shards.

    `read(name, rows=None, cols=None)` returns one tensor (or a row/column range of it) as numpy,
    read through the shard's memory map; `load(...)` builds the full parameter tree.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise MissingFileError(f"{self.path}: checkpoint directory not found")
        self.cfg = load_config(self.path)
        self.index_file = os.path.join(self.path, INDEX_FILE)
        self.weight_map = self._read_index()
        self._handles: dict[str, object] = {}
        self._span_cache: dict[str, dict] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- index and shards --
    def _read_index(self) -> dict[str, str]:
        f = self.index_file
        if not os.path.isfile(f):
            raise MissingFileError(f"{f}: index not found")
        try:
            with open(f, "rb") as fh:
                raw = json.loads(fh.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IndexFormatError(f"{f}: not valid JSON ({e})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
            raise IndexFormatError(f"{f}: key 'weight_map' missing or not an object")
        wm = raw["weight_map"]
        for name, shard in wm.items():
            if (not isinstance(shard, str) or not shard or os.path.isabs(shard)
                    or ".." in shard.replace("\\", "/").split("/")):
                raise IndexFormatError(f"{f}: weight_map['{name}'] = {shard!r} is not a shard file "
                                       f"name inside the checkpoint directory")
        for shard in sorted(set(wm.values())):
            if not os.path.isfile(os.path.join(self.path, shard)):
                name = next(n for n, s in wm.items() if s == shard)
                raise MissingShardError(f"{os.path.join(self.path, shard)}: shard file not found "
                                        f"(named by {INDEX_FILE} for tensor '{name}')")
        return wm

    @property
    def shard_files(self) -> list[str]:
        return [os.path.join(self.path, s) for s in sorted(set(self.weight_map.values()))]

    def _shard_of(self, name: str) -> str:
        shard = self.weight_map.get(name)
        if shard is None:
            raise MissingTensorError(f"{self.index_file}: tensor '{name}' is not in weight_map")
        return shard

    def _handle(self, shard: str):
        """safetensors' handle on a shard (a memory map of the whole file), opened on first use and
        kept open, for the reads that go through it: column ranges (`ShardedCheckpoint`) and dtypes
        numpy lacks. Validation and every other read leave the shards unmapped (`_spans`, `read`)."""
        h = self._handles.get(shard)
        if h is not None:
            return h
        with self._lock:
            h = self._handles.get(shard)
            if h is None:
                h = self._handles[shard] = self._open(shard)
        return h

    def _open(self, shard: str):
        from safetensors import SafetensorError, safe_open

        file = os.path.join(self.path, shard)
        names = [n for n, s in self.weight_map.items() if s == shard]
        held = f"'{names[0]}'" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        try:
            return safe_open(file, framework="np")
        except FileNotFoundError:
            raise MissingShardError(f"{file}: shard file not found (holds tensor {held})") from None
        except SafetensorError as e:
            msg = str(e)
            if "not fully covered" in msg or "incomplete" in msg:
                raise TruncatedShardError(f"{file}: truncated shard, its data is shorter than its "
                                          f"header says ({msg}; holds tensor {held})") from None
            raise CorruptHeaderError(f"{file}: corrupted safetensors header ({msg}; holds tensor {held})") from None
        except OSError as e:
            raise CorruptShardError(f"{file}: cannot read shard ({e}; holds tensor {held})") from None

    def tensor_info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) of a tensor, from its shard's header."""
        shard = self._shard_of(name)
        span = self._spans(shard).get(name)
        if span is None:
            raise MissingTensorError(f"{os.path.join(self.path, shard)}: tensor '{name}' is not in this "
                                     f"shard (though {INDEX_FILE} says it is)")
        return span[1], span[0]

    def check(self, src: Source):
        shape, dtype = self.tensor_info(src.name)
        file = os.path.join(self.path, self.weight_map[src.name])
        if dtype not in src.dtypes:
            raise TensorDtypeError(f"{file}: tensor '{src.name}' has dtype {dtype}, expected "
                                   f"{' or '.join(src.dtypes)}")
        if shape != src.shape:
            raise TensorShapeError(f"{file}: tensor '{src.name}' has shape {list(shape)}, expected "
                                   f"{list(src.shape)}")

    def read(self, name: str, rows: "slice | None" = None, cols: "slice | None" = None) -> np.ndarray:
        """A tensor, or `[rows]` / `[rows, cols]` of it, as numpy (only those bytes are copied).
        A whole tensor or a range of rows is one `preadv` into a fresh array: the shard is not mapped
        into this process, so its pages do not stay in the process's resident set (those of a memory
        map stay until it is closed; in a gVisor sandbox, as on the lent TPU VM, a mapped shard counts
        whole from the start: +1x the checkpoint). Column ranges go through safetensors (`_handle`)."""
        shard = self._shard_of(name)
        span = self._row_span(shard, name, rows) if cols is None else None
        if span is not None:
            dtype, shape, off = span
            out = aligned_empty(shape, dtype)
            self._pread(name, shard, off, memoryview(out.reshape(-1).view(np.uint8)))
            return out
        h = self._handle(shard)
        if rows is None and cols is None:
            return h.get_tensor(name)
        sl = h.get_slice(name)
        key = (rows if rows is not None else slice(None),) + ((cols,) if cols is not None else ())
        return sl[key]

    def _row_span(self, shard: str, name: str, rows: "slice | None"):
        """(numpy dtype, shape, absolute byte offset) of `name[rows]` (all of it for None) where one
        contiguous read gives it: a unit-step row range of a tensor of a known dtype; else None."""
        span = self._spans(shard).get(name)
        if span is None or _NP_DTYPES.get(span[0]) is None or not hasattr(os, "preadv"):
            return None                                   # (safetensors names what is wrong)
        dt, shape, off = _NP_DTYPES[span[0]], span[1], span[2]
        if rows is None:
            return dt, shape, off
        if not shape:
            return None
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            return None
        row = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
        return dt, (max(0, stop - start),) + shape[1:], off + start * row

    def _pread(self, name: str, shard: str, off: int, view: memoryview):
        """Fill `view` with the shard's bytes from `off` on (bytes of tensor `name`)."""
        fd, done, n = self._fd(shard), 0, len(view)
        while done < n:
            got = os.preadv(fd, [view[done:]], off + done)
            if got <= 0:
                raise TruncatedShardError(f"{self.file_of(name)}: truncated shard: tensor '{name}' "
                                          f"reaches byte {off + n}, the file ends before")
            done += got

    def file_of(self, name: str) -> str:
        return os.path.join(self.path, self.weight_map[name])

    def _spans(self, shard: str) -> dict:
        """{tensor: (dtype string, shape, absolute byte offset, byte count)} of a shard, from its
        header. The first call checks the shard: safetensors opens it (its header parses, its data
        covers what the header says; else a CheckpointError naming the file) and closes it again."""
        spans = self._span_cache.get(shard)
        if spans is None:
            if shard not in self._handles:
                self._open(shard).__exit__(None, None, None)
            with open(os.path.join(self.path, shard), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            spans = {k: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0],
                         v["data_offsets"][1] - v["data_offsets"][0])
                     for k, v in header.items() if k != "__metadata__"}
            with self._lock:
                self._span_cache[shard] = spans
        return spans

    def _fd(self, shard: str) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            with self._lock:
                fd = self._fds.get(shard)
                if fd is None:
                    fd = self._fds[shard] = os.open(os.path.join(self.path, shard), os.O_RDONLY)
        return fd

    def _direct_span(self, name: str, dst: np.ndarray):
        """(shard, byte offset, byte count) of tensor `name` when its stored bytes are `dst`'s
        bytes (same dtype and size, `dst` C-contiguous), so one read fills it; else None."""
        shard = self._shard_of(name)
        dtype, _, off, n = self._spans(shard)[name]
        if (_NP_DTYPES.get(dtype) != dst.dtype or n != dst.nbytes or not dst.flags.c_contiguous
                or not hasattr(os, "preadv")):
            return None
        return shard, off, n

    def read_into(self, name: str, dst: np.ndarray) -> bool:
        """Read tensor `name` from its shard straight into `dst` (one copy, file -> dst, as a raw
        read does; `preadv` releases the GIL). Only when the stored bytes are `dst`'s bytes: same
        dtype and size, `dst` C-contiguous; returns False otherwise (the caller converts)."""
        span = self._direct_span(name, dst)
        if span is None:
            return False
        shard, off, _ = span
        self._pread(name, shard, off, memoryview(dst.reshape(-1).view(np.uint8)))
        return True

    def _read_run(self, run: "Sequence[_Read]"):
        """Tensors stored back to back in one shard, read by one `preadv` into their slots (a
        scatter read: one syscall for up to IOV_MAX tensors). A short read (a truncated shard)
        falls back to tensor-by-tensor reads, which name the tensor at fault."""
        shard, off = run[0].shard, run[0].off
        got = os.preadv(self._fd(shard), [memoryview(r.dst.reshape(-1).view(np.uint8)) for r in run], off)
        for r in run:
            if r.off + r.n > off + max(got, 0):
                self.read_into(r.name, r.dst)
            if r.check is not None:
                self._check_scale_bytes(r.check, r.dst)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for h in self._handles.values():
            try:
                h.__exit__(None, None, None)
            except Exception:
                pass
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- validation and filling --
    def validate(self, entries: "Iterable[Entry] | None" = None):
        """Check every needed tensor exists with the right shape and dtype (reads headers only)."""
        for shard in sorted(set(self.weight_map.values())):
            self._spans(shard)  # header and file-size check of every referenced shard
        for entry in layout(self.cfg) if entries is None else entries:
            for src in entry.sources:
                self.check(src)

    def load(self, experts: str = "bf16", progress: bool = True, to_jax: bool = True,
             threads: int = 2) -> dict:
        """The parameter tree (see module docstring). `to_jax=False` returns numpy arrays."""
        if experts not in ("bf16", "mxfp4"):
            raise ValueError(f"experts must be 'bf16' or 'mxfp4', found {experts!r}")
        gc_was_on = gc.isenabled()
        gc.disable()   # a load makes no cyclic garbage; collections (JAX's gc callback) cost ~1 s
        try:
            return self._load(experts, progress, to_jax, threads)
        finally:
            if gc_was_on:
                gc.enable()

    def _load(self, experts: str, progress: bool, to_jax: bool, threads: int) -> dict:
        entries = layout(self.cfg)
        self.validate(entries)
        groups: dict[str, list[Entry]] = {}
        for e in entries:
            groups.setdefault(e.group, []).append(e)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(groups), desc=f"loading {os.path.basename(self.path.rstrip('/'))}",
                   unit="layer", disable=not progress, leave=False)
        pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
        order = list(groups.values())
        streamer = ShardStreamer(self.path, self._shard_order(order))   # reads ahead from here on
        try:
            tree = _allocate(self.cfg, experts)      # mapping the output overlaps the first reads
            for gi, items in enumerate(order):
                streamer.consumer_at(self._shards_of(items))
                reads, rest = self._direct_reads(tree, items, experts)
                jobs = [(self._read_run, run) for run in _runs(reads)] + [(self._fill, tree, e, experts) for e in rest]
                if pool is None:
                    for fn, *a in jobs:
                        fn(*a)
                else:
                    for fut in [pool.submit(*job) for job in jobs]:
                        fut.result()
                bar.update(1)
        finally:
            streamer.stop()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
        return as_jax(tree) if to_jax else tree

    def _direct_reads(self, tree: dict, entries: "Sequence[Entry]", experts: str):
        """Split a group's entries into tensors read as stored straight into their slot (`_Read`s,
        sorted by file position) and the entries that convert (for `_fill`)."""
        reads, rest = [], []
        for e in entries:
            fam = tree
            for k in e.dest:
                fam = fam[k]
            if e.kind == "mxfp4" and experts == "mxfp4":
                psrc, ssrc = e.sources
                pairs = [(ssrc, fam["scale"][e.index], ssrc), (psrc, fam["packed"][e.index], None)]
            elif e.kind == "copy":
                pairs = [(e.sources[0], fam[e.index] if e.index else fam, None)]
            else:
                rest.append(e)
                continue
            spans = [self._direct_span(src.name, dst) for src, dst, _ in pairs]
            if any(sp is None for sp in spans):
                rest.append(e)
                continue
            reads += [_Read(*sp, src.name, dst, check) for sp, (src, dst, check) in zip(spans, pairs)]
        reads.sort(key=lambda r: (r.shard, r.off))
        return reads, rest

    def _shards_of(self, entries: "Sequence[Entry]") -> list[str]:
        return [self.weight_map[src.name] for e in entries for src in e.sources]

    def _shard_order(self, groups: "Sequence[Sequence[Entry]]") -> list[str]:
        """Shard files in the order the groups first need them."""
        seen: dict[str, None] = {}
        for items in groups:
            for shard in self._shards_of(items):
                seen.setdefault(shard, None)
        return list(seen)

    def _valid_scale(self, ssrc: Source) -> np.ndarray:
        scale = self.read(ssrc.name)
        self._check_scale_bytes(ssrc, scale)
        return scale

    def _check_scale_bytes(self, ssrc: Source, scale: np.ndarray):
        pos = bad_scale_position(scale)
        if pos is not None:
            raise ScaleByteError(f"{self.file_of(ssrc.name)}: tensor '{ssrc.name}' has E8M0 scale byte "
                                 f"{int(scale[pos])} at [{pos[0]}, {pos[1]}] (0 and 255 are invalid)")

    def _fill(self, tree: dict, e: Entry, experts: str):
        fam = tree
        for k in e.dest:
            fam = fam[k]
        if e.kind == "mxfp4" and experts == "mxfp4":   # packed, as stored: scale (checked), then codes
            for sub in ("scale", "packed"):
                self._fill_slot(fam[sub][e.index], e, sub)
            return
        self._fill_slot(fam[e.index] if e.index else fam, e)

    def _fill_slot(self, dst: np.ndarray, e: Entry, sub: "str | None" = None):
        """Fill `dst`, the destination slot of entry `e` (for a packed MXFP4 entry, `sub` =
        "packed" or "scale" names which of its two tensors)."""
        src = e.sources[0]
        if e.kind == "mxfp4":
            psrc, ssrc = e.sources
            if sub is None:                              # dequantized to bf16 [K, N]
                _dequant_into(dst, self.read(psrc.name), self._valid_scale(ssrc))
                return
            s = psrc if sub == "packed" else ssrc     # bytes move file -> final array once
            if not self.read_into(s.name, dst):
                dst[...] = self.read(s.name)
            if sub == "scale":
                self._check_scale_bytes(ssrc, dst)
            return
        # fp32 targets may be stored F32/BF16/F16 (exact widening); bf16 targets only as BF16
        casting = "unsafe" if dst.dtype == F32 else "no"
        if e.kind == "copy":
            if self.read_into(src.name, dst):
                return
            rows = _row_chunks(src.shape, dst.dtype.itemsize)
            if len(rows) == 1:
                np.copyto(dst, self.read(src.name), casting=casting)
            for r in rows if len(rows) > 1 else ():
                np.copyto(dst[r], self.read(src.name, rows=r), casting=casting)
        elif e.kind == "T":
            rows = _row_chunks(src.shape, dst.dtype.itemsize)
            if len(rows) == 1:
                _transpose_into(dst, self.read(src.name))
            for r in rows if len(rows) > 1 else ():
                _transpose_into(dst[:, r], self.read(src.name, rows=r))
        elif e.kind == "conv":
            x = self.read(src.name)
            np.copyto(dst, x[:, 0, :].T, casting="unsafe")
        elif e.kind == "fold":
            norm = self.read(e.sources[0].name).astype(np.float32)
            proj = self.read(e.sources[1].name).astype(np.float32)
            np.multiply(norm, proj[0], out=dst)
        else:  # pragma: no cover
            raise AssertionError(e.kind)

    def lazy_params(self, experts: str = "mxfp4") -> dict:
        """The tree of `load(experts=...)` with `LazyLeaf`s for arrays: nothing is read until a
        leaf is indexed, and nothing read is kept. For consumers that walk the model once and keep
        their own layout (`mk.kernel.step.kernel_weights`): host memory then holds their output plus
        one slot, never the loaded tree. Everything is validated first, as by `load`; the
        checkpoint must stay open while the leaves are read."""
        import jax

        entries = layout(self.cfg)
        self.validate(entries)
        by_dest: dict[tuple, list[Entry]] = {}
        for e in entries:
            by_dest.setdefault(e.dest, []).append(e)

        def leaf(kpath, s):
            keys = tuple(getattr(k, "key", k) for k in kpath)
            sub = keys[2] if len(keys) == 3 else None           # packed MXFP4 leaf: "packed" / "scale"
            return LazyLeaf(self, by_dest[keys[:2] if sub else keys], s.shape, s.dtype, sub)
        return jax.tree_util.tree_map_with_path(leaf, abstract_params(self.cfg, experts))


class LazyLeaf:
    """One array of `Checkpoint.lazy_params`: `leaf[i]`, `leaf[i, j]`, `leaf[i, a:b]` (leading
    indices over the slots: integers, or unit-step slices) reads those slots now, as a fresh numpy
    array (`leaf[i, a:b]`: shape (b - a,) + shape[2:]); `np.asarray(leaf)` reads all of it. Same
    bits as `load`'s array (same fill code)."""

    def __init__(self, ck: Checkpoint, entries: "Sequence[Entry]", shape, dtype, sub: "str | None"):
        self.ck, self.entries, self.sub = ck, list(entries), sub
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim = len(self.shape)
        self.slots = {e.index: e for e in self.entries}     # slot index -> the entry that fills it

    def __getitem__(self, idx) -> np.ndarray:
        idx = idx if isinstance(idx, tuple) else (idx,)
        lead = len(self.entries[0].index)
        sel = []                                   # per slot axis: an int, or a range of slots
        for i, d in zip(idx, self.shape):
            if isinstance(i, slice):
                start, stop, step = i.indices(d)
                sel.append(range(start, max(start, stop)) if step == 1 else None)
            else:
                sel.append(int(i) if 0 <= int(i) < d else None)
        if len(idx) > lead or None in sel:
            raise IndexError(f"{self.entries[0].dest}: index {idx} of a lazy leaf of shape {self.shape}")
        sel += [range(d) for d in self.shape[len(idx):lead]]
        out = aligned_empty(tuple(len(r) for r in sel if isinstance(r, range)) + self.shape[lead:], self.dtype)
        for index in itertools.product(*(r if isinstance(r, range) else (r,) for r in sel)):
            at = tuple(j - r.start for j, r in zip(index, sel) if isinstance(r, range))
            self.ck._fill_slot(out[at] if at else out, self.slots[index], self.sub)
        return out

    def __array__(self, dtype=None, copy=None):
        x = self[()]
        return x if dtype is None else x.astype(dtype, copy=False)

    def __repr__(self):
        return f"LazyLeaf({'.'.join(self.entries[0].dest)}{'.' + self.sub if self.sub else ''}, {self.shape}, {self.dtype})"


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux: a read that fails rather than wait for storage


class ShardStreamer:
    """Reads shards ahead of the loader, in the order it needs them, so that a cold page cache
    fills at the storage's sequential read rate while earlier layers are converted.

    A background thread reads each shard front to back in `CHUNK_BYTES` pieces into one reused
    buffer (plain `readv`, which releases the GIL), staying at most `lookahead` shards ahead of the
    shard the loader is on, so a checkpoint bigger than RAM does not evict pages before they are
    used. Pieces already in the page cache are skipped: three 4 KiB probes with `RWF_NOWAIT`
    (which fails instead of waiting for storage) tell, so a warm load costs no extra copy.
    (Measured on this VM: posix_fadvise(WILLNEED) instead of reads overlapped I/O with conversion
    less well: cold load/raw ratio 0.47-0.50 vs 0.68-0.77.)
    """

    def __init__(self, directory: str, shards: "Sequence[str]", lookahead: int = 2):
        self.files = [os.path.join(directory, s) for s in shards]
        self._rank = {s: i for i, s in enumerate(shards)}
        self.lookahead = lookahead
        self._at = 0
        self._stopped = False
        self._cv = threading.Condition()
        self._thread = None
        self.streamed: list[str] = []   # files fully read ahead (or found cached), in order
        if self.files and hasattr(os, "preadv"):  # read-ahead is an optimisation: none without preadv
            self._thread = threading.Thread(target=self._run, name="mk-shard-streamer", daemon=True)
            self._thread.start()

    def consumer_at(self, shards: "Iterable[str]"):
        """The loader now reads these shards: let the streamer run `lookahead` past the last."""
        at = max((self._rank[s] for s in shards if s in self._rank), default=0)
        with self._cv:
            if at > self._at:
                self._at = at
                self._cv.notify()

    def stop(self):
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    @staticmethod
    def _cached(fd: int, off: int, n: int, probe: bytearray) -> bool:
        if _RWF_NOWAIT is None:
            return False
        try:
            return all(os.preadv(fd, [probe], p, _RWF_NOWAIT) > 0
                       for p in (off, off + n // 2, max(off, off + n - len(probe))))
        except OSError:  # EAGAIN: not in the page cache (or the flag is unsupported here)
            return False

    def _run(self):
        buf, probe = bytearray(CHUNK_BYTES), bytearray(4096)
        for i, file in enumerate(self.files):
            with self._cv:
                while not self._stopped and i > self._at + self.lookahead:
                    self._cv.wait()
                if self._stopped:
                    return
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, CHUNK_BYTES):
                    if self._stopped:
                        return
                    n = min(CHUNK_BYTES, size - off)
                    if not self._cached(fd, off, n, probe):
                        os.preadv(fd, [memoryview(buf)[:n]], off)
                self.streamed.append(file)
            except OSError:
                pass  # the loader itself reports unreadable shards
            finally:
                os.close(fd)


def _row_chunks(shape: Sequence[int], itemsize: int) -> list[slice]:
    """Row slices of at most CHUNK_BYTES (one slice covering everything for small tensors)."""
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) > 1 else itemsize
    n = shape[0]
    step = max(1, CHUNK_BYTES // max(row, 1))
    if step >= n:
        return [slice(0, n)]
    if step >= 8:
        step -= step % 8
    return [slice(r, min(r + step, n)) for r in range(0, n, step)]


def _allocate(cfg: K3Config, experts: str) -> dict:
    """Uninitialised numpy arrays with the structure of `abstract_params` (filled by `load`);
    only those (with packed experts, no bf16 expert arrays are mapped)."""
    import jax
    return jax.tree.map(lambda s: aligned_empty(s.shape, s.dtype), abstract_params(cfg, experts))


@dataclasses.dataclass(frozen=True)
class _Read:
    """One tensor read as stored into its slot: shard, byte offset and count in it, name, the
    slot, and (for an E8M0 scale tensor) its Source, checked after the read."""
    shard: str
    off: int
    n: int
    name: str
    dst: np.ndarray
    check: "Source | None"


_IOV_MAX = 1024


def _runs(reads: "Sequence[_Read]") -> list[list[_Read]]:
    """Reads (sorted by shard and offset) cut into runs of back-to-back tensors, each at most
    CHUNK_BYTES (or one tensor) and IOV_MAX tensors: one `preadv` each."""
    runs: list[list[_Read]] = []
    size = 0
    for r in reads:
        last = runs[-1][-1] if runs else None
        if (last is None or r.shard != last.shard or r.off != last.off + last.n
                or size + r.n > CHUNK_BYTES or len(runs[-1]) >= _IOV_MAX):
            runs.append([r])
            size = r.n
        else:
            runs[-1].append(r)
            size += r.n
    return runs


def as_jax(tree):
    """numpy tree -> jax arrays; zero-copy on CPU for `aligned_empty` arrays (a copy elsewhere)."""
    import jax
    return jax.tree.map(jax.device_put, tree)


def mxfp4_shapes(cfg: K3Config) -> dict:
    """Shapes of the packed expert families of `experts="mxfp4"` (checkpoint orientation)."""
    n, E, Lt, Fe = cfg.n_moe, cfg.experts, cfg.latent, cfg.expert_hidden
    gu = {"packed": (n, E, Fe, Lt // 2), "scale": (n, E, Fe, Lt // MX_GROUP)}
    down = {"packed": (n, E, Lt, Fe // 2), "scale": (n, E, Lt, Fe // MX_GROUP)}
    return {"w1": gu, "w3": dict(gu), "w2": down}


# ---- public entry points --------------------------------------------------------------------------------
def load(path, experts: str = "bf16", progress: bool = True, to_jax: bool = True, threads: int = 2) -> dict:
    """Load a checkpoint directory into the `mk.model.params` tree (see the module docstring)."""
    with Checkpoint(path) as ck:
        return ck.load(experts=experts, progress=progress, to_jax=to_jax, threads=threads)


def load_with_config(path, **kw) -> tuple[K3Config, dict]:
    with Checkpoint(path) as ck:
        return ck.cfg, ck.load(**kw)


def abstract_params(path_or_cfg, experts: str = "bf16") -> dict:
    """`jax.ShapeDtypeStruct`s of what `load(path, experts=...)` returns, from config.json only."""
    import jax
    from mk.model.params import shapes

    cfg = path_or_cfg if isinstance(path_or_cfg, K3Config) else load_config(path_or_cfg)
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', found {experts!r}")
    tree = shapes(cfg)
    if experts == "mxfp4":
        for w, s in mxfp4_shapes(cfg).items():
            tree["moe"][w] = {k: jax.ShapeDtypeStruct(v, U8) for k, v in s.items()}
    return tree


def checkpoint_bytes(path) -> int:
    """Total size of the shard files a checkpoint's index references."""
    with Checkpoint(path) as ck:
        return sum(os.path.getsize(f) for f in ck.shard_files)


# ---- sharded loading (multi-device / multi-process) ---------------------------------------------
def _process_tag() -> str:
    import jax
    return f"process {jax.process_index()} of {jax.process_count()}"


def load_sharded(path, mesh, experts: str = "bf16", progress: bool = False) -> dict:
    """The parameter tree of `load(path, experts=...)` as global arrays placed on `mesh` by
    `mk.model.sharding.param_spec`, each process reading only the blocks its addressable devices hold.

    Validation is the same as `load` (every shard's header, every tensor's name, shape and
    dtype, before any data is read); then every leaf is built with
    `jax.make_array_from_callback`, whose callback reads just that device's block through
    `Checkpoint.read(name, rows=..., cols=...)` (checkpoint `[out, in]` -> params `[in, out]`:
    a split of the params' column axis is a row range of the checkpoint tensor). MXFP4 experts
    are read in whole 32-element scale groups and dequantized per block. A block is read once
    per process, however many local devices hold it (replicated leaves). Errors are the
    `CheckpointError`s of `load`, their message prefixed with "process i of n:".
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mk.model.sharding import param_spec

    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', found {experts!r}")
    tag = _process_tag()
    try:
        ck = ShardedCheckpoint(path)
    except CheckpointError as e:
        raise type(e)(f"{tag}: {e}") from None
    with ck:
        entries = layout(ck.cfg)
        try:
            ck.validate(entries)
        except CheckpointError as e:
            raise type(e)(f"{tag}: {e}") from None
        by_dest: dict[tuple, list[Entry]] = {}
        for e in entries:
            by_dest.setdefault(e.dest, []).append(e)
        from tqdm.auto import tqdm

        abstract = abstract_params(ck.cfg, experts)
        leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
        bar = tqdm(total=len(leaves), desc=f"loading {os.path.basename(ck.path.rstrip('/'))} (sharded)",
                   unit="tensor", disable=not progress, leave=False)
        out = []
        try:
            for kpath, s in leaves:
                keys = tuple(getattr(k, "key", k) for k in kpath)
                sub = keys[2] if len(keys) == 3 else None          # mxfp4 leaf: "packed" / "scale"
                dest = keys[:2] if sub else keys
                sharding = NamedSharding(mesh, P(*param_spec(keys, len(s.shape))))
                blocks: dict = {}

                def cb(index, dest=dest, sub=sub, s=s, blocks=blocks):
                    idx = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, s.shape))
                    key = tuple((x.start, x.stop) for x in idx)
                    if key not in blocks:
                        blocks[key] = ck._read_block(by_dest[dest], idx, np.dtype(s.dtype), sub, tag)
                    return blocks[key]

                out.append(jax.make_array_from_callback(s.shape, sharding, cb))
                bar.update(1)
        finally:
            bar.close()
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), out)


class ShardedCheckpoint(Checkpoint):
    """A `Checkpoint` that reads one device's block of a parameter leaf (see `load_sharded`)."""

    def _read_block(self, entries: "Sequence[Entry]", idx: tuple, dtype, sub, tag: str) -> np.ndarray:
        """The block `idx` (tuple of unit-step slices) of the leaf that `entries` fill."""
        out = np.empty(tuple(x.stop - x.start for x in idx), dtype)
        lead = len(entries[0].index)
        for e in entries:
            if not all(x.start <= i < x.stop for i, x in zip(e.index, idx)):
                continue
            at = tuple(i - x.start for i, x in zip(e.index, idx[:lead]))
            try:
                out[at] = self._read_part(e, idx[lead:], dtype, sub)
            except CheckpointError as err:
                raise type(err)(f"{tag}: {err}") from None
            except (OSError, ValueError) as err:
                name = e.sources[0].name
                raise CorruptShardError(f"{tag}: {self.file_of(name)}: cannot read tensor '{name}' "
                                        f"({type(err).__name__}: {err})") from None
        return out


    def _read_part(self, e: Entry, rest: tuple, dtype, sub) -> np.ndarray:
        """One entry's part `rest` (slices of the destination's per-entry dims) as `dtype`."""
        src = e.sources[0]
        if e.kind == "copy":
            x = self.read(src.name, rows=rest[0], cols=rest[1] if len(rest) > 1 else None)
            return x.astype(dtype, copy=False)
        if e.kind == "T":                                          # dest [in, out] = W[out, in].T
            return self.read(src.name, rows=rest[1], cols=rest[0]).T
        if e.kind == "conv":                                       # dest [C, HD] = W[HD, 0, :].T
            return self.read(src.name, rows=rest[1])[:, 0, :].T[rest[0]].astype(dtype, copy=False)
        if e.kind == "fold":
            norm = self.read(e.sources[0].name, rows=rest[0]).astype(np.float32)
            proj = self.read(e.sources[1].name, rows=slice(0, 1), cols=rest[0]).astype(np.float32)
            return np.multiply(norm, proj[0])
        if e.kind == "mxfp4":
            psrc, ssrc = e.sources
            if sub is not None:                                    # checkpoint bytes, same orientation
                x = self.read((psrc if sub == "packed" else ssrc).name, rows=rest[0], cols=rest[1])
                if sub == "scale":
                    self._check_scale(ssrc, x, rest[0].start, rest[1].start)
                return x
            ks, ns = rest                                          # dest [K, N]; checkpoint [N, K/2]
            k0, k1 = ks.start // MX_GROUP * MX_GROUP, -(-ks.stop // MX_GROUP) * MX_GROUP
            scale = self.read(ssrc.name, rows=ns, cols=slice(k0 // MX_GROUP, k1 // MX_GROUP))
            self._check_scale(ssrc, scale, ns.start, k0 // MX_GROUP)
            packed = self.read(psrc.name, rows=ns, cols=slice(k0 // 2, k1 // 2))
            return dequantize_mxfp4(packed, scale)[ks.start - k0:ks.stop - k0]
        raise AssertionError(e.kind)  # pragma: no cover


    def _check_scale(self, ssrc: Source, scale: np.ndarray, row0: int, col0: int):
        pos = bad_scale_position(scale)
        if pos is not None:
            raise ScaleByteError(f"{self.file_of(ssrc.name)}: tensor '{ssrc.name}' has E8M0 scale byte "
                                 f"{int(scale[pos])} at [{pos[0] + row0}, {pos[1] + col0}] (0 and 255 are invalid)")
