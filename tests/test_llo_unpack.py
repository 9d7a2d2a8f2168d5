"""docs/tpu-v5e/llo_unpack.py: reading one tile's loop out of libtpu's `final_bundles` dump (the
deviceless compile itself is what the script runs; here only its reader, on a made-up dump)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DUMP = """= control target key start
LB: loop body
= control target key end

     0   :  { %7 = vsyncpa [#allocation3], 0 }
   0x1   :  { %s1 = smov 0 }
   0x2 LB: > { %p52_p0 = scmp.lt.s32.totalorder %s1, 0  ;;  %v10_v1 = vand.u32 %v2, %v3  ;;  %v11 = vmul.u32 %v2, %v4 }
   0x3   : > { %v12 = vshll.u32 %v10_v1, 6  ;;  %v13 = vadd.s32 %v12, %v5  ;;  %v14 = vor.u32 %v13, %v6  ;;  %v15 = vand.u32 %v14, %v7 }
   0x4   : > { %20 = vmatpush.bf16.msra.mxu0 %v15  ;;  %v16 = vld [vmem:[#allocation2] sm:$0xff] }
   0x5   : > { %21 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v16  ;;  %v17 = vpop.f32.mrf.mxu0 }
   0x6   :  { %46 = sbr.rel (!%p44_p2) target = $region44 }
   0x7   : > { %v18 = vadd.f32 %v17, %v19 }
   0x8   :  { %47 = vsyncpa [#allocation3], 1 }
"""


def _script():
    spec = importlib.util.spec_from_file_location("llo_unpack", ROOT / "docs/tpu-v5e/llo_unpack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_loop_body_is_counted_from_its_label_to_the_backward_branch():
    llo = _script()
    body = llo.loop_body(DUMP)
    assert len(body) == 5                                           # 0x2 .. 0x6, delay slots excluded
    assert body[0] == ["scmp.lt.s32.totalorder", "vand.u32", "vmul.u32"]
    c = llo.count(body)
    assert c["bundles"] == 5
    assert c["vector_alu_ops"] == 6                                 # not vld, vmatpush, vmatmul, vpop
    assert c["mxu_pushes"] == 1 and c["bundles_with_4_alu_ops"] == 1
    assert c["ops"]["vand.u32"] == 2


def test_every_unpack_the_chip_lowers_is_a_case():
    names = [n for n, _, _ in _script().cases()]
    assert {"bf16", "int4.dot", "int4.astype", "mxfp4.pairs", "mxfp4.pairs_mul", "mxfp4.shift"} <= set(names)
