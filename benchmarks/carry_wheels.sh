#!/usr/bin/env bash
# Here, before device calls: the wheels that benchmarks/gpu_setup.sh installs on the accelerator machine (no network
# there; python3 3.12, CUDA 13), downloaded from the package index into .whl/ (liger-kernel) and .whl-fa4-carry/
# (flash-attn-4, the CuTe DSL it runs on, quack, apache-tvm-ffi). The DSL's CUDA 13 libraries (a 92 MB wheel) go as
# a .tar.xz of their unpacked files with xz's x86 filter: 52 MB, which with the rest and the working tree fits the 64
# MiB a call carries (62.2 MB of carried folders at 6b65abd). Both folders are ignored by git (.git/info/exclude).
# Takes about 4 minutes on 2 cores (the xz).
#   bash benchmarks/carry_wheels.sh        then: run(..., carry=[".whl", ".whl-fa4-carry"])
set -euo pipefail
cd "$(dirname "$0")/.."
for folder in .whl/ .whl-fa4-carry/; do
    grep -qxF "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
done
target=(--only-binary=:all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64)
download() { python3 -m pip download -q "${target[@]}" -d "$@"; }  # a failed download stops the script (set -e)
# Made in a scratch folder and moved into place at the end: a failure leaves the folders that were there as they were.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/.whl" "$scratch/.whl-fa4-carry" "$scratch/libs" "$scratch/files"
download "$scratch/.whl" liger-kernel==0.8.5
download "$scratch/.whl-fa4-carry" flash-attn-4==4.0.0b40 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2
download "$scratch/libs" nvidia-cutlass-dsl-libs-cu13==4.8.1
python3 -m zipfile -e "$scratch"/libs/nvidia_cutlass_dsl_libs_cu13-*.whl "$scratch/files"
tar -C "$scratch/files" -cf - . | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 \
    > "$scratch/.whl-fa4-carry/nvidia_cutlass_dsl_libs_cu13-4.8.1.tar.xz"
rm -rf .whl .whl-fa4-carry && mv "$scratch/.whl" "$scratch/.whl-fa4-carry" .
ls -l .whl .whl-fa4-carry
echo "carried folders: $(du -cb .whl .whl-fa4-carry | tail -1 | cut -f1) bytes; tracked files:" \
     "$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes; a call carries at most 67108864"
