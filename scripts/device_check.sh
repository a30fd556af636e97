#!/usr/bin/env bash
# The checks that need a GPU, as one short run on a lent device machine (the device tool's `run`, ~4 minutes):
#
#     bash scripts/device_check.sh
#
# It uses that machine's own python3 (its CUDA build of PyTorch, transformers, pytest); nothing is installed, since
# nothing can be fetched there. The log goes to stdout and to $OUT/device_check.log when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-${TMPDIR:-/tmp}}/device_check.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), \
'| transformers', transformers.__version__)"
  status=0
  # CUDA model parity (fp32, bf16), paged attention, engine vs HF generate (incl. swap through pinned memory),
  # the parallel trainer on NCCL
  $PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py || status=1
  # the Triton paged attention kernels compiled for this GPU (no interpreter: TRITON_INTERPRET unset), then their
  # speed against the gather path (where triton does not import they skip and the benchmark times the gather path)
  $PY -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  env -u TRITON_INTERPRET $PY -m pytest -q -p no:cacheprovider -rs tests/test_triton_attention.py || status=1
  env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 $PY benchmarks/paged_attention.py || status=1
  exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
