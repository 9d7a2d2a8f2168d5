"""Hardware facts for the performance model, loaded from the CSV tables in `data/`.

Three tables, every value with its source (none of them is fitted to the K3 throughput table,
which is the validation set):

- `data/hardware.csv` — datasheet facts per chip (TPU v5e, v5p, v6e, v7; H100, H200, B200, GB200),
  long format `chip,quantity,value,unit,scope,source,use`. Several sources may give the same
  quantity (the seed article, the vendor page, JAX's `get_tpu_info_for_chip`); exactly one row per
  (chip, quantity) has `use=1` and is the one the model reads. `scope` says whether the value is for
  the whole chip or one TensorCore.
- `data/microbench.csv` — measured per-core / per-device microbenchmarks (DMA streaming rate,
  collective phase latency, link bandwidths, kernel launch gap, ...) `system,quantity,value,...`.
- `data/published.csv` — the published figures we compare against (`role=validation` for the
  K3 throughput table, `reference` for other published timings).

`System` combines a chip with the microbenchmarks into the per-device numbers the roofline and the
simulator need (one TensorCore of the TPU v7 system, one GPU of the GB200 system). Bad data raises
`HardwareDataError` naming the file, the line, and the column.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Iterable, Mapping

from mk.errors import UserError

DATA_DIR = Path(os.environ.get("MK_DATA_DIR", Path(__file__).resolve().parent.parent / "data"))


class HardwareDataError(UserError, ValueError):
    """A hardware/microbenchmark/published table that cannot be read. Names file, line and column."""


# ------------------------------------------------------------------------------------------------
# CSV reading
# ------------------------------------------------------------------------------------------------
def _read_rows(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    """(line number, row dict) for every data row; '#' lines and blank lines are skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise HardwareDataError(f"{path}: file not found") from None
    lines = text.splitlines()
    header_at = next((i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")), None)
    if header_at is None:
        raise HardwareDataError(f"{path}: no header line")
    header = next(csv.reader([lines[header_at]]))
    header = [h.strip() for h in header]
    missing = [c for c in columns if c not in header]
    if missing:
        raise HardwareDataError(f"{path}: line {header_at + 1}: header lacks column(s) {missing}; "
                                f"expected {list(columns)}, found {header}")
    rows = []
    for i in range(header_at + 1, len(lines)):
        ln = lines[i]
        if not ln.strip() or ln.lstrip().startswith("#"):
            continue
        fields = next(csv.reader([ln]))
        if len(fields) != len(header):
            raise HardwareDataError(f"{path}: line {i + 1}: expected {len(header)} columns "
                                    f"({','.join(header)}), found {len(fields)}")
        rows.append((i + 1, {h: f.strip() for h, f in zip(header, fields)}))
    return rows


def _number(path, line, column, text) -> float:
    try:
        v = float(text)
    except ValueError:
        raise HardwareDataError(f"{path}: line {line}: column '{column}': {text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise HardwareDataError(f"{path}: line {line}: column '{column}': {text!r} must be a finite "
                                f"non-negative number")
    return v


def _require(path, line, column, text):
    if not text:
        raise HardwareDataError(f"{path}: line {line}: column '{column}' is empty")
    return text


# ------------------------------------------------------------------------------------------------
# Chips (datasheet facts)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fact:
    value: float
    unit: str
    scope: str          # 'chip' | 'core'
    source: str
    line: int


# Quantities every chip must have (the model reads them); others are optional.
REQUIRED = ("hbm_bytes", "hbm_bw", "bf16_flops", "fp8_flops", "onchip_bytes", "cores_per_chip",
            "mxu_dim", "link_bw")
UNITS = {"hbm_bytes": "bytes", "hbm_bw": "bytes/s", "bf16_flops": "flop/s", "fp8_flops": "flop/s",
         "int8_flops": "flop/s", "fp4_flops": "flop/s", "fp32_flops": "flop/s", "onchip_bytes": "bytes",
         "smem_bytes": "bytes", "l2_bytes": "bytes", "cores_per_chip": "count", "sms": "count",
         "mxu_dim": "count", "link_bw": "bytes/s", "link_latency": "s"}


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet facts of one chip (the `use=1` rows), per chip unless the name says per core."""
    name: str
    kind: str                       # 'tpu' | 'gpu'
    facts: Mapping[str, Fact]       # the used value of each quantity
    alternatives: Mapping[str, tuple[Fact, ...]]  # every row (used or not), for comparison tables

    def get(self, quantity: str, default=None) -> float | None:
        f = self.facts.get(quantity)
        return default if f is None else f.value

    def source(self, quantity: str) -> str:
        return self.facts[quantity].source

    def _chip_value(self, quantity: str) -> float:
        f = self.facts[quantity]
        return f.value * self.cores_per_chip if f.scope == "core" and quantity not in _PER_CORE_NATIVE else f.value

    @property
    def cores_per_chip(self) -> int:
        return int(self.facts["cores_per_chip"].value)

    @property
    def hbm_bytes(self) -> float:
        return self._chip_value("hbm_bytes")

    @property
    def hbm_bw(self) -> float:
        return self._chip_value("hbm_bw")

    @property
    def bf16_flops(self) -> float:
        return self._chip_value("bf16_flops")

    @property
    def fp8_flops(self) -> float:
        return self._chip_value("fp8_flops")

    @property
    def mxu_dim(self) -> int:
        return int(self.facts["mxu_dim"].value)

    @property
    def link_bw(self) -> float:
        return self._chip_value("link_bw")

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of the chip for a matmul dtype ('bf16', 'fp8', 'int8', 'fp4');
        a dtype without its own rate falls back to the next wider one."""
        order = {"fp4": ("fp4_flops", "fp8_flops", "bf16_flops"), "int8": ("int8_flops", "bf16_flops"),
                 "fp8": ("fp8_flops", "bf16_flops"), "bf16": ("bf16_flops",), "fp32": ("fp32_flops", "bf16_flops")}
        if dtype not in order:
            raise HardwareDataError(f"unknown matmul dtype {dtype!r}: expected one of {sorted(order)}")
        for q in order[dtype]:
            v = self._chip_value(q) if q in self.facts else 0.0
            if v > 0:
                return v
        return self.bf16_flops

    def per_core(self, quantity: str) -> float:
        """A chip-level quantity divided over the TensorCores (or the value itself if per core)."""
        f = self.facts[quantity]
        if f.scope == "core" or quantity in _PER_CORE_NATIVE:
            return f.value
        return f.value / self.cores_per_chip

    def summary(self) -> dict:
        return {q: {"value": f.value, "unit": f.unit, "scope": f.scope, "source": f.source}
                for q, f in sorted(self.facts.items())}


# Quantities that are intrinsically per core even when the chip has several cores.
_PER_CORE_NATIVE = {"onchip_bytes", "smem_bytes", "mxu_dim", "link_latency"}


def load_chips(path: str | os.PathLike | None = None) -> dict[str, Chip]:
    path = Path(path) if path else DATA_DIR / "hardware.csv"
    cols = ("chip", "quantity", "value", "unit", "scope", "source", "use")
    facts: dict[str, dict[str, Fact]] = {}
    alts: dict[str, dict[str, list[Fact]]] = {}
    for line, r in _read_rows(path, cols):
        chip = _require(path, line, "chip", r["chip"])
        q = _require(path, line, "quantity", r["quantity"])
        if q not in UNITS:
            raise HardwareDataError(f"{path}: line {line}: column 'quantity': unknown quantity {q!r}; "
                                    f"expected one of {sorted(UNITS)}")
        v = _number(path, line, "value", r["value"])
        unit = r["unit"]
        if unit != UNITS[q]:
            raise HardwareDataError(f"{path}: line {line}: column 'unit': {q} must be in {UNITS[q]!r}, found {unit!r}")
        scope = r["scope"]
        if scope not in ("chip", "core"):
            raise HardwareDataError(f"{path}: line {line}: column 'scope': expected 'chip' or 'core', found {scope!r}")
        src = _require(path, line, "source", r["source"])
        if r["use"] not in ("0", "1"):
            raise HardwareDataError(f"{path}: line {line}: column 'use': expected 0 or 1, found {r['use']!r}")
        f = Fact(v, unit, scope, src, line)
        alts.setdefault(chip, {}).setdefault(q, []).append(f)
        if r["use"] == "1":
            prev = facts.setdefault(chip, {}).get(q)
            if prev is not None:
                raise HardwareDataError(f"{path}: line {line}: column 'use': chip {chip!r} quantity {q!r} "
                                        f"already has a used value (line {prev.line}); mark one of them use=0")
            facts[chip][q] = f
    chips = {}
    for chip, qs in alts.items():
        used = facts.get(chip, {})
        for q in REQUIRED:
            if q not in used:
                raise HardwareDataError(f"{path}: chip {chip!r} has no row with quantity {q!r} and use=1 "
                                        f"(column 'use')")
        kind = "tpu" if chip.startswith("tpu") else "gpu"
        chips[chip] = Chip(chip, kind, dict(used), {q: tuple(v) for q, v in qs.items()})
    return chips


# ------------------------------------------------------------------------------------------------
# Microbenchmarks and published figures
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measurement:
    system: str
    quantity: str
    value: float
    unit: str
    source: str
    note: str
    line: int


@dataclasses.dataclass(frozen=True)
class Microbench:
    path: str
    rows: Mapping[tuple[str, str], Measurement]

    def get(self, system: str, quantity: str) -> float:
        m = self.rows.get((system, quantity))
        if m is None:
            raise HardwareDataError(f"{self.path}: no row with system {system!r} and quantity {quantity!r}")
        return m.value

    def measurement(self, system: str, quantity: str) -> Measurement:
        self.get(system, quantity)
        return self.rows[(system, quantity)]


def load_microbench(path: str | os.PathLike | None = None) -> Microbench:
    path = Path(path) if path else DATA_DIR / "microbench.csv"
    rows = {}
    for line, r in _read_rows(path, ("system", "quantity", "value", "unit", "source", "note")):
        key = (_require(path, line, "system", r["system"]), _require(path, line, "quantity", r["quantity"]))
        if key in rows:
            raise HardwareDataError(f"{path}: line {line}: column 'quantity': duplicate {key} "
                                    f"(first at line {rows[key].line})")
        v = _number(path, line, "value", r["value"])
        rows[key] = Measurement(key[0], key[1], v, _require(path, line, "unit", r["unit"]),
                                _require(path, line, "source", r["source"]), r["note"], line)
    return Microbench(str(path), rows)


@dataclasses.dataclass(frozen=True)
class Published:
    system: str
    setting: str
    batch: int
    metric: str
    value: float
    unit: str
    source: str
    role: str
    line: int


def load_published(path: str | os.PathLike | None = None) -> list[Published]:
    path = Path(path) if path else DATA_DIR / "published.csv"
    out = []
    for line, r in _read_rows(path, ("system", "setting", "batch", "metric", "value", "unit", "source", "role")):
        b = _number(path, line, "batch", r["batch"])
        if b != int(b) or b < 1:
            raise HardwareDataError(f"{path}: line {line}: column 'batch': {r['batch']!r} must be a positive integer")
        role = r["role"]
        if role not in ("validation", "reference"):
            raise HardwareDataError(f"{path}: line {line}: column 'role': expected 'validation' or "
                                    f"'reference', found {role!r}")
        out.append(Published(_require(path, line, "system", r["system"]), _require(path, line, "setting", r["setting"]),
                             int(b), _require(path, line, "metric", r["metric"]), _number(path, line, "value", r["value"]),
                             r["unit"], _require(path, line, "source", r["source"]), role, line))
    return out


def published_value(system: str, setting: str, batch: int, metric: str = "tokens_per_s",
                    table: Iterable[Published] | None = None) -> float | None:
    for p in (load_published() if table is None else table):
        if (p.system, p.setting, p.batch, p.metric) == (system, setting, batch, metric):
            return p.value
    return None


# ------------------------------------------------------------------------------------------------
# Systems: a chip + microbenchmarks -> per-device model parameters
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class System:
    """One device's view of a multi-chip system (a TensorCore, or a GPU), for roofline and sim.

    Bandwidths in bytes/s, rates in FLOP/s, times in s. `dma_bw` is the measured streaming rate
    the DMA engine sustains (shared by all outstanding descriptors); `hbm_bw` the datasheet peak
    the roofline uses. `link_bw[link]` is the payload bandwidth of a collective's bytes on `link`.
    """
    name: str
    chip: Chip
    chips: int
    devices_per_chip: int
    dma_bw: float
    dma_latency: float
    hbm_bw: float
    hbm_bytes: float
    flops: Mapping[str, float]
    mxu_dim: int
    min_rows: int
    vector_flops: float
    vector_bw: float
    collective_latency: float
    link_bw: Mapping[str, float]
    link_latency: Mapping[str, float]  # per-link phase latency overriding collective_latency
    launch_gap: float
    step_overhead: float
    onchip_bytes: float
    schedule: str                    # the schedule the published figure ran: 'megakernel' | 'conventional'
    published_system: str            # the `system` key in published.csv
    sources: Mapping[str, str]

    @property
    def devices(self) -> int:
        return self.chips * self.devices_per_chip

    def peak_flops(self, dtype: str = "bf16") -> float:
        return self.flops.get(dtype) or self.flops["bf16"]

    def summary(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("chip",)}
        d["chip"] = self.chip.name
        d["flops"] = dict(self.flops)
        d["link_bw"] = dict(self.link_bw)
        d["link_latency"] = dict(self.link_latency)
        d["sources"] = dict(self.sources)
        return d


SYSTEMS = ("tpu-v7x16", "gb200x16")


def sibling_link_fit(mb: Microbench) -> tuple[float, float]:
    """(t0, bw) of the line t = t0 + bytes / bw through the two measured sibling-core copies
    (256 KiB at 101 GB/s, 16 MiB at 610 GB/s): a fixed cost ~2.2 us and ~663 GB/s."""
    b1, b2 = 256 * 1024, 16 * 1024 * 1024
    t1 = b1 / mb.get("tpu-v7", "sibling_copy_bw_256k")
    t2 = b2 / mb.get("tpu-v7", "sibling_copy_bw_16m")
    slope = (t2 - t1) / (b2 - b1)
    return t1 - b1 * slope, 1.0 / slope


@functools.lru_cache(maxsize=None)
def _tables(hw_path, mb_path):
    return load_chips(hw_path), load_microbench(mb_path)


def get_system(name: str, hardware_csv=None, microbench_csv=None) -> System:
    """The seed's two 16-chip systems: 'tpu-v7x16' (32 TensorCores) and 'gb200x16' (16 GPUs)."""
    chips, mb = _tables(str(hardware_csv) if hardware_csv else None, str(microbench_csv) if microbench_csv else None)
    if name == "tpu-v7x16":
        c = chips["tpu-v7"]
        cores = c.cores_per_chip
        sib_t0, sib_bw = sibling_link_fit(mb)
        srcs = {
            "dma_bw": mb.measurement("tpu-v7", "dma_stream_bw").source,
            "dma_latency": mb.measurement("tpu-v7", "dma_descriptor_latency").source,
            "hbm_bw": c.source("hbm_bw") + " / cores_per_chip",
            "collective_latency": mb.measurement("tpu-v7", "collective_phase_latency").source,
            "link_bw.ici": mb.measurement("tpu-v7", "cross_chip_3link_bw").source,
            "link_bw.sibling": "line through the two sibling-copy points of spec 6.3 (101 GB/s at 256 KiB, "
                               "610 GB/s at 16 MiB): t = t0 + bytes / bw",
            "link_latency.sibling": "intercept t0 of that line",
            "step_overhead": mb.measurement("tpu-v7", "step_fixed_overhead").source,
            "vector": mb.measurement("tpu-v7", "vector_flops").source,
            "launch_gap": mb.measurement("tpu-v7", "launch_gap").source,
        }
        return System(
            name=name, chip=c, chips=16, devices_per_chip=cores,
            dma_bw=mb.get("tpu-v7", "dma_stream_bw"), dma_latency=mb.get("tpu-v7", "dma_descriptor_latency"),
            hbm_bw=c.per_core("hbm_bw"), hbm_bytes=c.per_core("hbm_bytes"),
            flops={"bf16": c.flops("bf16") / cores, "fp8": c.flops("fp8") / cores},
            mxu_dim=c.mxu_dim, min_rows=16,
            vector_flops=mb.get("tpu-v7", "vector_flops"), vector_bw=mb.get("tpu-v7", "vector_bw"),
            collective_latency=mb.get("tpu-v7", "collective_phase_latency"),
            link_bw={"ici": mb.get("tpu-v7", "cross_chip_3link_bw"), "sibling": sib_bw},
            link_latency={"sibling": sib_t0},
            launch_gap=mb.get("tpu-v7", "launch_gap"), step_overhead=mb.get("tpu-v7", "step_fixed_overhead"),
            onchip_bytes=c.per_core("onchip_bytes"), schedule="megakernel", published_system="tpu-v7x16",
            sources=srcs)
    if name == "gb200x16":
        c = chips["gb200"]
        frac = mb.get("gpu", "hbm_stream_fraction")
        link = c.link_bw * mb.get("gpu", "nvlink_app_fraction")
        srcs = {
            "dma_bw": f"{c.source('hbm_bw')} x {mb.measurement('gpu', 'hbm_stream_fraction').source}",
            "dma_latency": mb.measurement("gpu", "dram_latency").source,
            "hbm_bw": c.source("hbm_bw"),
            "collective_latency": mb.measurement("gb200", "allreduce_latency").source,
            "link_bw.nvlink": f"{c.source('link_bw')} x {mb.measurement('gpu', 'nvlink_app_fraction').source}",
            "launch_gap": mb.measurement("gpu", "launch_gap").source,
            "vector": c.source("fp32_flops") + "; vector kernels stream from HBM at dma_bw",
        }
        return System(
            name=name, chip=c, chips=16, devices_per_chip=1,
            dma_bw=c.hbm_bw * frac, dma_latency=mb.get("gpu", "dram_latency"),
            hbm_bw=c.hbm_bw, hbm_bytes=c.hbm_bytes,
            flops={"bf16": c.flops("bf16"), "fp8": c.flops("fp8"), "fp4": c.flops("fp4")},
            mxu_dim=c.mxu_dim, min_rows=16,
            vector_flops=c.get("fp32_flops"), vector_bw=c.hbm_bw * frac,
            collective_latency=mb.get("gb200", "allreduce_latency"),
            link_bw={"nvlink": link, "ici": link, "sibling": link}, link_latency={},
            launch_gap=mb.get("gpu", "launch_gap"), step_overhead=0.0,
            onchip_bytes=c.get("onchip_bytes") * (c.get("sms") or 1), schedule="conventional",
            published_system="gb200x16", sources=srcs)
    raise HardwareDataError(f"unknown system {name!r}: expected one of {list(SYSTEMS)}")
