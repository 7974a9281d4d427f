# Sourced by the accelerator machine's scripts (gpu_check.sh, gpu_tests.sh): the package installed from this working
# tree, and the wheels carried in .whl*/ (the machine has no network): liger-kernel, and flash-attn-4 with the CuTe
# DSL it runs on. A wheel larger than what one device call carries (the DSL's CUDA 13 libraries, 92 MB) travels in
# parts (`split -b`) over two calls, NAME.whl.part-aa in one folder and the rest in another: joined here first.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p /tmp/joined_wheels
for first in .whl*/*.whl.part-aa; do
    [ -e "$first" ] || continue
    name=$(basename "${first%.part-aa}")
    parts=$(for part in .whl*/"$name".part-*; do echo "$(basename "$part") $part"; done | sort | cut -d' ' -f2)
    cat $parts > "/tmp/joined_wheels/$name"
done
wheels=$(ls .whl*/*.whl /tmp/joined_wheels/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
    if python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site $wheels > /tmp/wheels.log 2>&1; then
        export PYTHONPATH=/tmp/site
    else
        echo "gpu_setup.sh: the carried wheels did not install:"; tail -5 /tmp/wheels.log
    fi
    # The CuTe DSL's packages sit under its dsl_packages folder, which its .pth file adds: PYTHONPATH reads no .pth.
    [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
fi
