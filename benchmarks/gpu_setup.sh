# Sourced by the accelerator machine's scripts (gpu_check.sh, gpu_tests.sh): the package installed from this working
# tree, and the wheels carried in .whl*/ folders (the machine has no network): liger-kernel, and flash-attn-4 with the
# CuTe DSL it runs on. A wheel too large for what one device call carries (the DSL's CUDA 13 libraries: 92 MB as a
# wheel, 64 MiB a call) travels as NAME.tar.xz of its unpacked contents (53 MB with xz's 256 MiB dictionary),
# unpacked where pip puts the others.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
wheels=$(ls .whl*/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
    if python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site $wheels > /tmp/wheels.log 2>&1; then
        export PYTHONPATH=/tmp/site
    else
        echo "gpu_setup.sh: the carried wheels did not install:"; tail -5 /tmp/wheels.log
    fi
fi
for archive in .whl*/*.tar.xz; do
    [ -e "$archive" ] && mkdir -p /tmp/site && tar -xJf "$archive" -C /tmp/site && export PYTHONPATH=/tmp/site
done
# The CuTe DSL's packages sit under its dsl_packages folder, which its .pth file adds: PYTHONPATH reads no .pth.
if [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ]; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
fi
