#!/usr/bin/env bash
# On the accelerator machine: install the package, run the kernel tests at real shapes, then the benchmark.
#   bash benchmarks/gpu_check.sh [OUT_DIR] [bench.py arguments...]
set -uo pipefail
out=${1:-benchmarks/out}; shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_compile.py --durations=8 2>&1 | tee "$out/tests.log" | tail -40
python3 benchmarks/bench.py --out "$out/results.json" "$@" 2>&1 | tee "$out/bench.log" | grep -v '^{' | tail -60
