# Sourced by the accelerator machine's scripts (gpu_check.sh, gpu_tests.sh): the package installed from this working
# tree, and liger-kernel from its wheel where one was carried in .whl/ (the machine has no network).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/liger_kernel-*.whl \
        >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
fi
