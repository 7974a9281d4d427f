# Sourced by the accelerator machine's scripts (gpu_check.sh, gpu_tests.sh): the package installed from this working
# tree, and the wheels carried in .whl*/ folders (the machine has no network): liger-kernel, and flash-attn-4 with the
# CuTe DSL it runs on. A wheel too large for what one device call carries (the DSL's CUDA 13 libraries: 92 MB as a
# wheel, 64 MiB a call) travels as NAME.tar.xz of its unpacked contents (52 MB: `xz --x86
# --lzma2=preset=9e,dict=256MiB`), unpacked where pip puts the others. `bash benchmarks/carry_wheels.sh` makes both
# folders from the package index.
# The folder's name ends in site-packages: the epilogue fingerprint of quack (carried with flash-attn-4;
# quack/gemm_runtime/identity.py) takes a function as installed code, by its name alone, only where its file lies
# under a site-packages folder; under /tmp/site it read the CuTe DSL's own functions down to a ContextVar and failed
# (TypeError) before any GEMM of quack's ran.
export PYTHONUNBUFFERED=1
SITE=/tmp/site-packages
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
wheels=$(ls .whl*/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
    if python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE $wheels > /tmp/wheels.log 2>&1; then
        export PYTHONPATH=$SITE
    else
        echo "gpu_setup.sh: the carried wheels did not install:"; tail -5 /tmp/wheels.log
    fi
fi
for archive in .whl*/*.tar.xz; do
    [ -e "$archive" ] && mkdir -p $SITE && tar -xJf "$archive" -C $SITE && export PYTHONPATH=$SITE
done
# The CuTe DSL's packages sit under its dsl_packages folder, which its .pth file adds: PYTHONPATH reads no .pth.
if [ -d $SITE/nvidia_cutlass_dsl/dsl_packages ]; then
    export PYTHONPATH=$PYTHONPATH:$SITE/nvidia_cutlass_dsl/dsl_packages
fi
# The same folders in a .pth file of python3's own site-packages: the tests' subprocesses run without PYTHONPATH
# (tests/ecosystem_helpers.py's offline_env), and found no liger-kernel there.
if [ -n "${PYTHONPATH:-}" ]; then
    purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    tr ':' '\n' <<< "$PYTHONPATH" > "$purelib/carried-wheels.pth"
fi
