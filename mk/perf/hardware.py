"""Hardware facts for the performance model, loaded from the CSV tables in `data/`.

Four tables, every value with its source (none of them is fitted to the K3 throughput table,
which is the validation set; the model runs with it locked, `published_locked`):

- `data/hardware.csv` — datasheet facts per chip (TPU v5e, v5p, v6e, v7; H100, H200, B200, GB200),
  long format `chip,quantity,value,unit,scope,source,use`. Several sources may give the same
  quantity (the seed article, the vendor page, JAX's `get_tpu_info_for_chip`); exactly one row per
  (chip, quantity) has `use=1` and is the one the model reads. `scope` says whether the value is for
  the whole chip or one TensorCore.
- `data/microbench.csv` — measured per-core / per-device microbenchmarks (DMA streaming rate,
  collective latencies, link bandwidths, kernel launch gap, ...) and the few assumptions the model
  needs (their source starts with "assumption"), `system,quantity,value,unit,low,high,source,note`;
  `low`/`high` is the range the sensitivity sweep covers.
- `data/systems.csv` — how each published run split the model (layout, expert storage, one program
  or one kernel per op); one row per system with `use=1`, the others are alternatives to sweep.
- `data/published.csv` — the published figures we compare against (`role=validation` for the
  K3 throughput table, `reference` for other published timings).

`System` combines a chip, the microbenchmarks and a layout into the per-device `Constant`s the
roofline and the simulator read (one TensorCore of the TPU v7 system, one GPU of the GB200 system,
the lent TPU v5e chip), each with its source, its range and its basis (measured, datasheet or
assumption). Bad data raises `HardwareDataError` naming the file, the line, and
the column.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Iterable, Mapping

from mk.errors import UserError

DATA_DIR = Path(os.environ.get("MK_DATA_DIR", Path(__file__).resolve().parents[2] / "data"))


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
    low: float | None = None         # the range the sensitivity sweep covers (None: not swept)
    high: float | None = None

    @property
    def assumption(self) -> bool:
        return is_assumption(self.source)


def is_assumption(source: str) -> bool:
    """A source with no measurement behind it starts with the word "assumption"."""
    return source.strip().lower().startswith("assumption")


@dataclasses.dataclass(frozen=True)
class Microbench:
    path: str
    rows: Mapping[tuple[str, str], Measurement]

    def get(self, system: str, quantity: str) -> float:
        return self.measurement(system, quantity).value

    def measurement(self, system: str, quantity: str) -> Measurement:
        m = self.rows.get((system, quantity))
        if m is None:
            raise HardwareDataError(f"{self.path}: no row with system {system!r} and quantity {quantity!r}")
        return m


def load_microbench(path: str | os.PathLike | None = None) -> Microbench:
    """`system,quantity,value,unit,[low,high,]source,note`; low/high (optional columns, blank
    allowed) give the range the sensitivity sweep covers and must bracket the value."""
    path = Path(path) if path else DATA_DIR / "microbench.csv"
    rows = {}
    for line, r in _read_rows(path, ("system", "quantity", "value", "unit", "source", "note")):
        key = (_require(path, line, "system", r["system"]), _require(path, line, "quantity", r["quantity"]))
        if key in rows:
            raise HardwareDataError(f"{path}: line {line}: column 'quantity': duplicate {key} "
                                    f"(first at line {rows[key].line})")
        v = _number(path, line, "value", r["value"])
        lo, hi = (_number(path, line, c, r[c]) if r.get(c) else None for c in ("low", "high"))
        if (lo is None) != (hi is None):
            raise HardwareDataError(f"{path}: line {line}: columns 'low' and 'high': give both or neither")
        if lo is not None and not lo <= v <= hi:
            raise HardwareDataError(f"{path}: line {line}: columns 'low'/'high': [{lo:g}, {hi:g}] does not "
                                    f"contain the value {v:g}")
        rows[key] = Measurement(key[0], key[1], v, _require(path, line, "unit", r["unit"]),
                                _require(path, line, "source", r["source"]), r["note"], line, lo, hi)
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


_PUBLISHED_LOCK = [0]


@contextlib.contextmanager
def published_locked():
    """Inside this block reading data/published.csv raises: the model's prediction path runs in it,
    so no constant can be fitted to (or read from) the figures it is validated against."""
    _PUBLISHED_LOCK[0] += 1
    try:
        yield
    finally:
        _PUBLISHED_LOCK[0] -= 1


def load_published(path: str | os.PathLike | None = None) -> list[Published]:
    if _PUBLISHED_LOCK[0]:
        raise HardwareDataError("data/published.csv read on the prediction path (inside hardware.published_locked): "
                                "the model must not see the figures it is validated against")
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
# Systems: a chip + microbenchmarks + how the published run split the model
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Constant:
    """One number the simulator reads for one device of a system: its value, unit, source and the
    range `mk simulate --sensitivity` sweeps (low == high: not swept, e.g. a datasheet figure)."""
    name: str
    value: float
    unit: str
    source: str
    low: float
    high: float
    datasheet: bool = False          # from data/hardware.csv (a datasheet figure), not a timing

    @property
    def assumption(self) -> bool:
        return is_assumption(self.source)

    @property
    def basis(self) -> str:
        """'assumption' (no measurement behind it), 'datasheet' (data/hardware.csv) or 'measured'
        (a microbenchmark or a published timing; its source says where and when)."""
        return "assumption" if self.assumption else "datasheet" if self.datasheet else "measured"

    @property
    def swept(self) -> bool:
        return self.low != self.high

    def summary(self) -> dict:
        return {"value": self.value, "unit": self.unit, "low": self.low, "high": self.high,
                "source": self.source, "assumption": self.assumption, "basis": self.basis}


@dataclasses.dataclass(frozen=True)
class SystemLayout:
    """One row of `data/systems.csv`: how a published run split K3 and stored its experts."""
    system: str
    chip: str
    layout: object                   # mk.model.layout.Layout
    program: str                     # 'megakernel' | 'per_op'
    expert_gate_up: str
    expert_down: str
    published_system: str
    use: bool
    source: str
    line: int
    mk_plan: str = "tuned"           # 'tuned': mk's plan as the model finds fastest; 'defaults': as run

    @property
    def assumption(self) -> bool:
        return is_assumption(self.source)

    def label(self) -> str:
        lay = self.layout
        return (f"TP{lay.tp_attn} attention, EP{lay.ep} x TP{lay.tp_expert} experts "
                f"({self.expert_gate_up}/{self.expert_down})")


# How `mk simulate` builds mk's plan for a system (data/systems.csv column `mk_plan`, optional):
# 'tuned': the fastest modelled of the choices the kernel runs and the deepest ring that fits VMEM
# (a system with no chip to run on); 'defaults': the kernel's defaults (`mk.kernel.step.make_step_fn`:
# `mk.kernel.plan.default_tile` and `default_prefetch_depth`), the configuration timed on the chip.
MK_PLANS = ("tuned", "defaults")


def load_systems(path: str | os.PathLike | None = None) -> list[SystemLayout]:
    """Rows of data/systems.csv (see `SystemLayout`); the `mk_plan` column may be absent ('tuned')."""
    from mk.model.layout import Layout, PlanError

    path = Path(path) if path else DATA_DIR / "systems.csv"
    cols = ("system", "chip", "chips", "cores_per_chip", "tp_attn", "ep", "tp_expert", "style", "program",
            "expert_gate_up", "expert_down", "published_system", "use", "source")
    out = []
    for line, r in _read_rows(path, cols):
        ints = {}
        for c in ("chips", "cores_per_chip", "tp_attn", "ep", "tp_expert"):
            v = _number(path, line, c, r[c])
            if v != int(v) or v < 1:
                raise HardwareDataError(f"{path}: line {line}: column '{c}': {r[c]!r} must be a positive integer")
            ints[c] = int(v)
        if r["program"] not in ("megakernel", "per_op"):
            raise HardwareDataError(f"{path}: line {line}: column 'program': expected 'megakernel' or 'per_op', "
                                    f"found {r['program']!r}")
        if r["use"] not in ("0", "1"):
            raise HardwareDataError(f"{path}: line {line}: column 'use': expected 0 or 1, found {r['use']!r}")
        mk_plan = r.get("mk_plan") or "tuned"
        if mk_plan not in MK_PLANS:
            raise HardwareDataError(f"{path}: line {line}: column 'mk_plan': expected one of {MK_PLANS}, "
                                    f"found {mk_plan!r}")
        try:
            lay = Layout(**ints, style=r["style"], name=_require(path, line, "source", r["source"]))
        except PlanError as e:
            raise HardwareDataError(f"{path}: line {line}: {e}") from None
        out.append(SystemLayout(_require(path, line, "system", r["system"]), _require(path, line, "chip", r["chip"]),
                                lay, r["program"], _require(path, line, "expert_gate_up", r["expert_gate_up"]),
                                _require(path, line, "expert_down", r["expert_down"]),
                                _require(path, line, "published_system", r["published_system"]), r["use"] == "1",
                                r["source"], line, mk_plan))
    for name in {s.system for s in out}:
        used = [s for s in out if s.system == name and s.use]
        if len(used) != 1:
            raise HardwareDataError(f"{path}: system {name!r} needs exactly one row with use=1 (column 'use'), "
                                    f"found {len(used)}")
    return out


@dataclasses.dataclass(frozen=True)
class System:
    """One device's view of a multi-chip system (a TensorCore, or a GPU), for roofline and sim.

    `constants` holds every number the simulator reads, each with its source and sweep range
    (see `Constant`); `layout` and the expert formats say how the published run split the model
    (`data/systems.csv`), `alternatives` the other layouts the sensitivity sweep tries."""
    name: str
    chip: Chip
    chips: int
    devices_per_chip: int
    setup: SystemLayout
    alternatives: tuple[SystemLayout, ...]
    constants: Mapping[str, Constant]

    @property
    def layout(self):
        return self.setup.layout

    @property
    def program(self) -> str:
        return self.setup.program

    @property
    def schedule(self) -> str:
        """The schedule the published figure ran: 'megakernel' (TPU) or 'conventional' (GPU)."""
        return "megakernel" if self.setup.program == "megakernel" else "conventional"

    @property
    def published_system(self) -> str:
        return self.setup.published_system

    @property
    def devices(self) -> int:
        return self.chips * self.devices_per_chip

    def value(self, name: str) -> float:
        try:
            return self.constants[name].value
        except KeyError:
            raise HardwareDataError(f"system {self.name}: no constant {name!r} (have {sorted(self.constants)})") from None

    def replace(self, **values: float) -> "System":
        """This system with some constants set to other values (names with '.' as in `constants`:
        pass them as a dict, `replace(**{"ici.latency": 3e-6})`)."""
        consts = dict(self.constants)
        for k, v in values.items():
            if k not in consts:
                raise HardwareDataError(f"system {self.name}: no constant {k!r} (have {sorted(consts)})")
            consts[k] = dataclasses.replace(consts[k], value=float(v))
        return dataclasses.replace(self, constants=consts)

    # the figures other modules read by name
    @property
    def hbm_bw(self) -> float:
        return self.value("hbm_bw")

    @property
    def dma_bw(self) -> float:
        return self.value("dma_bw")

    @property
    def hbm_bytes(self) -> float:
        return self.chip.per_core("hbm_bytes")

    def peak_flops(self, dtype: str = "bf16") -> float:
        key = f"flops.{dtype}"
        return self.constants[key].value if key in self.constants else self.value("flops.bf16")

    @property
    def sources(self) -> dict[str, str]:
        return {k: c.source for k, c in self.constants.items()}

    def assumptions(self) -> list[str]:
        """Names of the constants (and the layout) that rest on an assumption, not a measurement."""
        out = [k for k, c in self.constants.items() if c.assumption]
        return (["layout"] if self.setup.assumption else []) + out

    def summary(self) -> dict:
        return {"name": self.name, "chip": self.chip.name, "chips": self.chips, "devices": self.devices,
                "program": self.program, "layout": self.setup.label(), "layout_source": self.setup.source,
                "layout_assumption": self.setup.assumption,
                "constants": {k: c.summary() for k, c in self.constants.items()}}


def system_names(systems_csv=None) -> tuple[str, ...]:
    """The systems data/systems.csv describes, in its order: the seed's two 16-chip systems
    ('tpu-v7x16', 'gb200x16') and the lent TPU v5e chip ('tpu-v5e')."""
    return tuple(dict.fromkeys(s.system for s in _tables(None, None, str(systems_csv) if systems_csv else None)[2]))


def sibling_link_fit(mb: Microbench) -> tuple[float, float]:
    """(t0, bw) of the line t = t0 + bytes / bw through the two measured sibling-core copies
    (256 KiB at 101 GB/s, 16 MiB at 610 GB/s): a fixed cost ~2.2 us and ~663 GB/s."""
    b1, b2 = 256 * 1024, 16 * 1024 * 1024
    return _line(b1, b1 / mb.get("tpu-v7", "sibling_copy_bw_256k"), b2, b2 / mb.get("tpu-v7", "sibling_copy_bw_16m"))


def _line(x1, t1, x2, t2) -> tuple[float, float]:
    slope = (t2 - t1) / (x2 - x1)
    return t1 - x1 * slope, 1.0 / slope


def allreduce_phase_fit(mb: Microbench, shape: str = "8x8192") -> tuple[float, float]:
    """(t0, bw) of one exchange phase, t = t0 + bytes / bw, from a measured bf16 / f32 all-reduce
    pair on 8 cores (spec 6.3 / App. B.4): an all-reduce is 2 phases (reduce-scatter, all-gather)
    in which each rank sends 7/8 of its payload. [8, 8192]: t0 = 2.6 us, 109 GB/s; [64, 4096]:
    1.8 us, 84 GB/s."""
    rows, cols = (int(x) for x in shape.split("x"))
    per_phase = lambda itemsize: 7 / 8 * rows * cols * itemsize
    return _line(per_phase(2), mb.get("tpu-v7", f"allreduce_{shape}_bf16") / 2,
                 per_phase(4), mb.get("tpu-v7", f"allreduce_{shape}_f32") / 2)


def sibling_phase_latency(mb: Microbench) -> float:
    """Fixed part of one sibling-core exchange phase, from the chip-hierarchical [8, 8192] bf16
    all-reduce on 8 cores (spec App. B.4: 9.3 us): a sibling reduce-scatter (half the payload P to
    r XOR 1), reduce-scatter and all-gather across the 4 chips (3/8 P each, at the flat fit's
    latency and bandwidth, `allreduce_phase_fit`), a sibling all-gather (P / 2). About 1.5 us."""
    t0, bw = allreduce_phase_fit(mb, "8x8192")
    _, sbw = sibling_link_fit(mb)
    P = 8 * 8192 * 2
    ici = 2 * (t0 + 3 / 8 * P / bw)
    return (mb.get("tpu-v7", "allreduce_8x8192_hier") - ici - 2 * (P / 2) / sbw) / 2


def _measured(mb: Microbench, system: str, quantity: str, name: str, scale: float = 1.0) -> Constant:
    m = mb.measurement(system, quantity)
    lo, hi = (m.low, m.high) if m.low is not None else (m.value, m.value)
    return Constant(name, m.value * scale, m.unit, m.source, lo * scale, hi * scale)


def _datasheet(chip: Chip, quantity: str, name: str, value: float, unit: str, note: str = "") -> Constant:
    src = chip.source(quantity) + (f" {note}" if note else "")
    return Constant(name, value, unit, src, value, value, datasheet=True)


@functools.lru_cache(maxsize=None)
def _tables(hw_path, mb_path, sys_path):
    return load_chips(hw_path), load_microbench(mb_path), load_systems(sys_path)


def get_system(name: str, hardware_csv=None, microbench_csv=None, systems_csv=None) -> System:
    """A system of data/systems.csv (`system_names`): the seed's 'tpu-v7x16' (32 TensorCores) and
    'gb200x16' (16 GPUs), the lent 'tpu-v5e' (one chip, one TensorCore). A TPU's constants come from
    its chip's rows of data/microbench.csv (system = the chip's name in data/hardware.csv), the DMA
    rate from the datasheet where the chip has no measured one; `Constant.basis` says which."""
    chips, mb, setups = _tables(*(str(p) if p else None for p in (hardware_csv, microbench_csv, systems_csv)))
    rows = [s for s in setups if s.system == name]
    if not rows:
        raise HardwareDataError(f"unknown system {name!r}: expected one of {list(dict.fromkeys(s.system for s in setups))}")
    setup = next(s for s in rows if s.use)
    c = chips[setup.chip]
    K = {}

    def put(x: Constant):
        K[x.name] = x

    if c.kind == "tpu":
        cores, chip = c.cores_per_chip, c.name
        devices = setup.layout.devices
        put(_datasheet(c, "hbm_bw", "hbm_bw", c.per_core("hbm_bw"), "bytes/s", "/ cores_per_chip"))
        if (chip, "dma_stream_bw") in mb.rows:
            put(_measured(mb, chip, "dma_stream_bw", "dma_bw"))
        else:
            put(dataclasses.replace(K["hbm_bw"], name="dma_bw"))
        put(_measured(mb, chip, "dma_descriptor_latency", "dma_latency"))
        for dt in ("bf16", "fp8"):
            if c.get(f"{dt}_flops"):                 # no fp8 MXU (v5e): no fp8 rate
                put(_datasheet(c, f"{dt}_flops", f"flops.{dt}", c.flops(dt) / cores, "flop/s", "/ cores_per_chip"))
        put(_measured(mb, chip, "mxu_min_rows", "mxu_min_rows"))
        put(_measured(mb, chip, "mxu_push_rows", "mxu_push_rows"))
        put(_measured(mb, chip, "vector_flops", "vector_flops"))
        put(_measured(mb, chip, "vector_bw", "vector_bw"))
        if (chip, "dequant_op_rate") in mb.rows:     # the kernel's own unpack, timed (`mk microbench`)
            put(_measured(mb, chip, "dequant_op_rate", "dequant_op_rate"))
        if devices > 1:                              # the links: spec App. B.4's TPU v7 collectives
            t0, bw = allreduce_phase_fit(mb, "8x8192")
            t0_lo, bw_lo = allreduce_phase_fit(mb, "64x4096")
            fit = "fit of spec 6.3 / App. B.4's [8, 8192] bf16 and f32 all-reduces on 8 cores (2 phases each)"
            put(Constant("ici.latency", t0, "s", f"{fit}: fixed part of one phase; range: the [64, 4096] pair's fit .. "
                         f"{mb.measurement('tpu-v7', 'collective_phase_latency_min').source}",
                         t0_lo, mb.get("tpu-v7", "collective_phase_latency_min")))
            put(Constant("ici.bw", bw, "bytes/s", f"{fit}: payload bandwidth per core; range: the [64, 4096] pair's "
                         f"fit .. {mb.measurement('tpu-v7', 'cross_chip_3link_bw').source}",
                         bw_lo, mb.get("tpu-v7", "cross_chip_3link_bw")))
            s0, sbw = sibling_link_fit(mb)
            sib = "line through spec 6.3 / App. B.4's sibling-core copies (101 GB/s at 256 KiB, 610 GB/s at 16 MiB)"
            put(Constant("sibling.latency", sibling_phase_latency(mb), "s",
                         f"spec App. B.4's chip-hierarchical [8, 8192] all-reduce (9.3 us) less its two cross-chip "
                         f"phases (the flat fit): two sibling phases; range: .. the intercept of the {sib}",
                         sibling_phase_latency(mb), s0))
            put(Constant("sibling.bw", sbw, "bytes/s", f"{sib}: slope", sbw, sbw))
        put(_measured(mb, chip, "step_fixed_overhead", "step_overhead"))
        put(_measured(mb, chip, "routing_per_layer", "routing"))
        return System(name, c, setup.layout.chips, cores, setup, tuple(s for s in rows if not s.use), K)
    frac = mb.measurement("gpu", "hbm_stream_fraction")
    link = mb.measurement("gpu", "nvlink_app_fraction")
    put(_datasheet(c, "hbm_bw", "hbm_bw", c.hbm_bw, "bytes/s"))
    put(Constant("dma_bw", c.hbm_bw * frac.value, "bytes/s", f"{c.source('hbm_bw')} x {frac.source}",
                 c.hbm_bw * frac.low, c.hbm_bw * frac.high))
    put(_measured(mb, "gpu", "dram_latency", "dma_latency"))
    for dt in ("bf16", "fp8", "fp4"):
        put(_datasheet(c, f"{dt}_flops", f"flops.{dt}", c.flops(dt), "flop/s"))
    for q in ("mxu_min_rows", "mxu_push_rows"):
        put(_datasheet(c, "mxu_dim", q, c.mxu_dim, "count"))
    put(_datasheet(c, "fp32_flops", "vector_flops", c.get("fp32_flops"), "flop/s"))
    put(Constant("vector_bw", c.hbm_bw * frac.value, "bytes/s", f"vector kernels stream from HBM: {frac.source}",
                 c.hbm_bw * frac.low, c.hbm_bw * frac.high))
    put(_measured(mb, "gb200", "allreduce_latency", "nvlink.latency"))
    put(Constant("nvlink.bw", c.link_bw * link.value, "bytes/s", f"{c.source('link_bw')} x {link.source}",
                 c.link_bw * link.low, c.link_bw * link.high))
    put(_measured(mb, "gpu", "launch_gap", "launch_gap"))
    put(_measured(mb, "gpu", "step_overhead", "step_overhead"))
    return System(name, c, setup.layout.chips, 1, setup, tuple(s for s in rows if not s.use), K)


def hbm_per_core(chip: str) -> float:
    """HBM bytes of one TensorCore (one JAX device) of `chip` (mk.kernel.plan name), data/hardware.csv."""
    from mk.kernel.plan import HARDWARE_CHIP
    return load_chips()[HARDWARE_CHIP[chip]].per_core("hbm_bytes")
