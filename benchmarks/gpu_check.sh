#!/usr/bin/env bash
# On the accelerator machine: install the package, run the model benchmark, the kernel tests at real shapes, the
# attention-layer benchmark, the profile of eager batch-32 decoding steps and, where liger-kernel's wheel was
# carried in .whl/ (it is not installed there), Liger's tests and its kernels against the project's.
#   bash benchmarks/gpu_check.sh [OUT_DIR] [bench.py arguments...]
set -uo pipefail
out=${1:-benchmarks/out}; shift || true
mkdir -p "$out"
source benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python3 benchmarks/bench.py --out "$out/results.json" "$@" > "$out/bench.log" 2>&1; grep "^|" "$out/bench.log"
bash benchmarks/gpu_tests.sh "$out" 400 tests/test_kernels.py tests/test_compile.py
python3 benchmarks/attention_bench.py 2>&1 | grep "^|" | tee "$out/attention.md"
python3 benchmarks/profile_decode.py --out "$out/profile" 2>&1 | grep "^|" | tee "$out/profile.md"
if python3 -c "import liger_kernel" 2>/dev/null; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_liger.py 2>&1 | tee "$out/liger_tests.log" | tail -2
    python3 benchmarks/liger_kernels.py 2>&1 | grep "^|" | tee "$out/liger_kernels.md"
fi
