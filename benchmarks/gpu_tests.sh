#!/usr/bin/env bash
# On the accelerator machine: the test files that run the kernels on a GPU, one after another, each under its own
# time limit, in a device call of their own (tests/test_kernels.py alone took 336 s on the H200 at 7fa55fc, 190
# tests). Every test's name and outcome goes to OUT_DIR/tests.log as it ends (pytest -v), so a file stopped by its
# limit still says what passed and failed; OUT_DIR/summary.txt has a line a file and the failures' names. Two files:
# the device call returns at most eight.
#   bash benchmarks/gpu_tests.sh OUT_DIR [SECONDS_A_FILE] [test files...]
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_tests.sh OUT_DIR [SECONDS_A_FILE] [test files...]}
limit=${2:-300}
shift $(( $# < 2 ? $# : 2 ))
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    files=(tests/test_kernels.py tests/test_compile.py tests/test_liger.py tests/test_attention.py
           tests/test_generation.py tests/test_decode_graphs.py tests/test_greedy.py tests/test_static_step_mask.py
           tests/test_cache_write.py tests/test_flash_attn_4.py
           "tests/test_modeling.py::test_offloading_caches_generate_the_dynamic_cache_s_tokens")
fi
mkdir -p "$out"
source benchmarks/gpu_setup.sh
for file in "${files[@]}"; do
    start=$(cat "$out/tests.log" 2>/dev/null | wc -l)
    timeout -s KILL "$limit" python3 -m pytest -v -rfE -p no:cacheprovider "$file" >> "$out/tests.log" 2>&1
    status=$?
    log=$(tail -n +"$((start + 1))" "$out/tests.log")
    passed=$(grep -c " PASSED" <<< "$log")
    failed=$(grep -c " FAILED" <<< "$log")
    skipped=$(grep -c " SKIPPED" <<< "$log")
    stopped=$([ "$status" -eq 137 ] && echo ", stopped at its ${limit} s limit" || echo "")
    echo "$file: exit $status, $passed passed, $failed failed, $skipped skipped$stopped" | tee -a "$out/summary.txt"
    grep -E "^(\S+::\S+ FAILED|FAILED |ERROR )" <<< "$log" | sort -u | sed 's/^/  /' | tee -a "$out/summary.txt"
done
