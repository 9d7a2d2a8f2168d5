#!/usr/bin/env bash
# The device decode loop (mk.model.loop) on the lent TPU v5e: `mk bench --mode generate` on k3-chip,
# bf16 then MXFP4 experts, the kernel and the fair XLA step at B = 1, 2, 4, 8, 64 decode steps per
# case in chunks of 16. Each row: the loop's decode tokens/s beside the step's device rate (trace)
# and the per-token host loop's wall clock. Both runs together stay under 8 minutes (timeouts 210 +
# 250 s); a run cut short still logs every finished case to $OUT/NAME.log.
#   OUT=DIR bash docs/tpu-v5e/run-generate.sh
# writes DIR/generate-bf16.out and DIR/generate-mxfp4.out ({"metadata", "rows"} JSON) and their .log.
STEP_PAUSE=2 source docs/tpu-v5e/steps.sh
step generate-bf16 210 python3 -m mk bench --mode generate --config k3-chip --experts bf16 --batch 1,2,4,8 \
  --impl kernel,xla --steps 64 --chunk 16 --json
step generate-mxfp4 250 python3 -m mk bench --mode generate --config k3-chip --experts mxfp4 --batch 1,2,4,8 \
  --impl kernel,xla --steps 64 --chunk 16 --json
for f in "$OUT"/generate-*.out; do
  python3 - "$f" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit(print(sys.argv[1], "no JSON (see its .log)"))
for r in d["rows"]:
    print(d["metadata"]["experts"], r["impl"], r["batch"], r.get("error") or
          f"loop {r['loop_tok_s']:.1f} tok/s ({r['loop_step_ms']:.3f} ms/step), device {r['device_step_ms']} ms/step, "
          f"of device {r['frac_of_device']}, host loop {r['host_step_ms']} ms/step")
PY
done
