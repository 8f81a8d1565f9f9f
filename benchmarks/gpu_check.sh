#!/usr/bin/env bash
# The GPU check: one script, under 4 minutes on a GPU machine. Kernel correctness and
# speed, the agent's hot path under set_sync_debug_mode("error"), and the demo with live
# switches of precision, kernels and checkpointing. Prints RESULT lines; paste them, with
# the GPU's name, into the README.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -d .venv ]; then
  python3 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[test]'
else
  . .venv/bin/activate
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== kernel tests on CUDA"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3
echo "== kernel benchmark"
timeout 90 python benchmarks/bench_kernels.py 2>&1 | tail -20
echo "== agent hot path under set_sync_debug_mode('error')"
timeout 60 python benchmarks/sync_check.py 2>&1 | tail -5
echo "== demo with live switches"
timeout 60 python benchmarks/demo_switches.py 2>&1 | tail -12
