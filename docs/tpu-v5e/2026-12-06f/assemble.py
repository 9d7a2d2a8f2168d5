"""How this folder's record JSON were made from the raw outputs of the chip calls (run once, here).

- generate-k3chip-{bf16,mxfp4}.json: the first call (`bash docs/tpu-v5e/run-generate.sh`) ran past its
  steps' time limits after the kernel's four batches (and XLA's B = 1 with bf16); its rows survive in
  generate-{bf16,mxfp4}.log ("bench: row" lines). A second call measured the XLA step's remaining batches
  (generate-xla-{bf16,mxfp4}.out). Each record joins both calls' rows; its provenance is the second call's.
- prefill-k3chip-{bf16,mxfp4}.json: prefill_bench.py printed no record yet at this commit; the record is
  made here from its metadata, with the summary `mk.perf.prefill_bench.prefill_summary` gives.
- The calls set MK_COMMIT to the short hash; the records carry the full one (the same commit).
"""
import json
import subprocess
import sys

sys.path.insert(0, "../../..")
from mk.perf.bench import generate_summary          # noqa: E402
from mk.perf.prefill_bench import prefill_summary   # noqa: E402

FULL = subprocess.run(["git", "rev-parse", "fbed638"], capture_output=True, text=True, check=True).stdout.strip()


def log_rows(path):
    return [json.loads(l.split("bench: row ", 1)[1]) for l in open(path) if l.startswith("bench: row ")]


for experts in ("bf16", "mxfp4"):
    second = json.load(open(f"generate-xla-{experts}.out"))
    first = log_rows(f"generate-{experts}.log")
    rows = first + [r for r in second["rows"] if (r["impl"], r["batch"]) not in {(f["impl"], f["batch"]) for f in first}]
    rec = dict(second["record"], commit=FULL, summary=generate_summary(rows))
    rec["command"] = (f"python -m mk bench --mode generate --config k3-chip --experts {experts} --batch 1,2,4,8 "
                      f"--impl kernel,xla --steps 64 --chunk 16 --json")
    rec["commit_note"] = ("rows joined from two calls: the command above (cut by its time limit; rows from "
                          f"generate-{experts}.log) and, for the XLA batches it did not reach, "
                          f"`{second['record']['command']}` (generate-xla-{experts}.out); see assemble.py")
    meta = dict(second["metadata"], command=rec["command"])
    json.dump({"record": rec, "metadata": meta, "rows": rows}, open(f"generate-k3chip-{experts}.json", "w"), indent=2)

    out = json.load(open(f"prefill-k3chip-{experts}.out"))
    m = out["metadata"]
    rec = {"kind": "prefill", "key": {"config": m["config"], "experts": m["experts"]},
           "summary": prefill_summary(out["rows"]), "commit": FULL, "dirty": False, "date": m["date"][:19],
           "chip": "tpu-v5e", "device_kind": m["device_kind"], "backend": "tpu", "jax_version": m["jax_version"],
           "command": f"python3 docs/tpu-v5e/prefill_bench.py --config k3-chip --experts {experts} "
                      "--lengths 1024,128,4096 --token-lengths 1024,128 --reps 2",
           "commit_note": "record made from the metadata by assemble.py (the script printed none at this commit)"}
    json.dump(dict(record=rec, **out), open(f"prefill-k3chip-{experts}.json", "w"), indent=2)

d = json.load(open("bench-d48-bf16-peer.out"))
d["record"]["commit"] = FULL
json.dump(d, open("bench-k3d48-bf16-peer.json", "w"), indent=2)
