#!/usr/bin/env bash
# Issue 26 end to end: GRPO (beta 0.04, a digits reward) from a checkpoint directory under ZeRO-3 and under tp 2, both
# with --engine-tp 2 on 2 ranks, against one process; prints the rewards and losses and every per-rank peak the run
# logs (start-up load, engine sync, checkpoint save) beside the model's bytes. OUT=dir to keep the runs elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
SW=".venv/bin/python -m spinwheel"
R=${OUT:-/tmp/spinwheel-rl-sharded}; rm -rf $R; mkdir -p $R
export OMP_NUM_THREADS=1
PYTHONPATH= $SW sft --model small --steps 2 --batch-size 4 --eval-every 0 --save-every 2 --no-progress --out-dir $R/sft > $R/sft.log 2>&1
CK=$R/sft/checkpoint
printf "def digits(completions, answers):\n    return [sum(c.isdigit() for c in t) / max(1, len(t)) for t in completions]\n" > $R/rw.py
export PYTHONPATH=$R
COMMON="--model $CK --steps 5 --prompts-per-step 4 --group-size 4 --max-new-tokens 8 --beta 0.04 --reward rw:digits --eval-every 5 --eval-examples 8 --save-every 5 --no-progress --num-threads 1"
$SW grpo $COMMON --out-dir $R/one > $R/one.log 2>&1
for lay in "--zero 3" "--tp 2"; do
  name=$(echo $lay | tr -d ' -')
  $SW launch --nproc-per-node 2 grpo $COMMON $lay --engine-tp 2 --out-dir $R/$name > $R/$name.log 2>&1
done
R=$R .venv/bin/python - <<'PY'
import json, os
R = os.environ["R"]
def rows(d): return [json.loads(l) for l in open(f"{R}/{d}/metrics.jsonl")]
one = rows("one")
for name in ("zero3", "tp2"):
    r = rows(name)
    s1 = [x for x in one if "loss" in x]; s2 = [x for x in r if "loss" in x]
    rew = all(a["reward_mean"] == b["reward_mean"] for a, b in zip(s1, s2))
    rel = max(abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in zip(s1, s2))
    keys = sorted({k for x in r for k in x if any(t in k for t in ("peak", "model_mb", "load_peak", "save_s", "engine_copy_mb", "sync_s"))})
    last = {}
    for x in r:
        for k in keys:
            if k in x: last[k] = x[k] if k not in last else max(last[k], x[k]) if "peak" in k else x[k]
    print([("%.6g" % x["loss"], round(x["reward_mean"], 4)) for x in s2]); print(name, "steps", len(s2), "rewards equal:", rew, "max loss rel diff: %.2e" % rel)
    print("  ", {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()})
PY
