#!/usr/bin/env bash
# cfrun's demo: train on real data (scikit-learn's handwritten digits) twice under cfrun, once
# uninterrupted and once SIGKILLed after step 110 (cfrun restarts it from the checkpoint at step 100),
# then check that both runs end with the same model, bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
out=cfrun-jobs/quickstart
rm -rf "$out" && mkdir -p "$out"

echo "== 1/3 uninterrupted run"
cfrun --interval 20 --job-dir "$out/uninterrupted" examples/digits_train.py --epochs 4 \
  --out "$out/uninterrupted.pt"

echo "== 2/3 the same run, SIGKILLed after step 110 and resumed by cfrun"
cfrun --interval 20 --job-dir "$out/crashed" --inject-crash 110 examples/digits_train.py \
  --epochs 4 --out "$out/crashed.pt"

echo "== 3/3 compare the final models"
python - "$out/uninterrupted.pt" "$out/crashed.pt" <<'PY'
import sys
import torch

a, b = (torch.load(p, weights_only=True) for p in sys.argv[1:3])
same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print(f"{len(a)} tensors compared: " + ("IDENTICAL, bit for bit" if same else "DIFFERENT"))
sys.exit(0 if same else 1)
PY
