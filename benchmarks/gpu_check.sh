#!/usr/bin/env bash
# GPU check, two scripts on one CUDA GPU, JSON to docs/results/ (or --out-dir DIR), under 8 minutes:
# - gpu_check.py: the fusion model (ViT-B/16 + a 1B-class LLaMA) in BF16, FP8 and with the FP8
#   fallback forced once: tokens/s, MFU, peak memory, every collective helper at world size 1;
# - gpu_llava.py: a LLaVA-1.5-7B-shaped model (depth reduced) on ragged batches: BF16 MFU,
#   packed vs padded tokens/s, FP8 vs BF16 through torchao's float8 training (eager, compiled).
#
#   bash benchmarks/gpu_check.sh [--out-dir DIR] [--steps N] [--warmup N]
#
# Without CUDA it prints why and exits 0 (nothing measured); the same code path runs on CPU at
# tiny sizes: python benchmarks/gpu_check.py --device cpu --tiny
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python3
if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
fi
if ! cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))'); then
    echo "gpu_check: $PY cannot import torch; install the project (.venv) first." >&2
    exit 1
fi
if [[ "$cuda" != 1 && " $* " != *" --device cpu "* && " $* " != *" --smoke "* ]]; then
    echo "gpu_check: no CUDA device visible to $PY; nothing measured (exit 0)."
    echo "gpu_check: the same code path runs on CPU: bash benchmarks/gpu_check.sh --device cpu --tiny"
    exit 0
fi
status=0
"$PY" benchmarks/gpu_check.py "$@" || status=$?
"$PY" benchmarks/gpu_llava.py "$@" || status=$?
exit "$status"
