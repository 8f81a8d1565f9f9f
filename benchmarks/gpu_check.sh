#!/usr/bin/env bash
# The GPU check: one script, about 6 minutes on a GPU machine. Kernel correctness and
# speed, the agent's hot path under set_sync_debug_mode("error"), the demo on the GPU
# with live switches of precision, kernels, checkpointing and memory, the dashboard's
# screen on it, and the agent's cost on a GPU loop. Prints RESULT lines; paste them,
# with the GPU's name, into the README.
#
# Python: a .whl folder (wheels of what the machine's own Python lacks, for a machine
# with CUDA's torch and no package index) is installed beside that Python; else .venv,
# made and installed here when there is none. Each part's output goes to its own file
# under $OUT (default /tmp/gpu-check); the checks that time nothing run side by side,
# the benchmarks one at a time after them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/gpu-check-site"
  py=python3
  # the C hot path (pyproject.toml's ext-modules), built in place as pip would: a C
  # compiler and Python's headers
  python3 - <<'PY' || exit 1
import subprocess, sysconfig, tomllib
with open("pyproject.toml", "rb") as file:
    modules = tomllib.load(file)["tool"]["setuptools"]["ext-modules"]
compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
for module in modules:
    target = module["name"].replace(".", "/") + sysconfig.get_config_var("EXT_SUFFIX")
    includes = [sysconfig.get_paths()["include"], *module.get("include-dirs", [])]
    subprocess.run([compiler, "-shared", "-fPIC", *module.get("extra-compile-args", []),
                    *("-I" + include for include in includes), *module["sources"],
                    "-o", target], check=True)
PY
else
  if [ ! -d .venv ]; then
    python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' || exit 1
  fi
  py=.venv/bin/python
fi
export PYTHONUNBUFFERED=1 GPUWATCH_LOG_DIR=/tmp/gpu-check-runs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$py -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'triton', triton.__version__, torch.cuda.get_device_name())"
nproc

echo "== side by side: kernel tests, hot path, live switches, dashboard screen"
timeout 240 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_memory.py \
  > "$out/tests.log" 2>&1 &
timeout 240 $py benchmarks/sync_check.py > "$out/sync_check.log" 2>&1 &
timeout 240 $py benchmarks/demo_switches.py > "$out/demo_switches.log" 2>&1 &
timeout 240 $py benchmarks/dashboard_screen.py > "$out/dashboard_screen.txt" 2>&1 &
wait
tail -3 "$out/tests.log"
tail -4 "$out/sync_check.log"
grep -v "^step" "$out/demo_switches.log" | tail -30
tail -1 "$out/dashboard_screen.txt"

echo "== kernel benchmark (alone)"
timeout 240 $py benchmarks/bench_kernels.py --rows 16384 > "$out/bench_kernels.log" 2>&1
tail -32 "$out/bench_kernels.log"
echo "== the agent's cost on a GPU loop (alone)"
timeout 200 $py benchmarks/bench_overhead.py --device cuda --steps 1000 --rounds 6 \
  > "$out/bench_overhead.log" 2>&1
tail -22 "$out/bench_overhead.log"
