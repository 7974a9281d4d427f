"""Registers and spills of V1's flash-diff dK/dV kernel for the H200, compiled without a GPU.

    python benchmarks/kernel_registers.py

Triton compiles each config of `attention_bench.py --sweep`'s dK/dV grid for sm_90a at the ~1.1B model's V1 shapes
(d 64, V 128, 4 query heads per kv head), and ptxas (shipped with triton) reports the registers per thread and the
bytes spilled. The H200's sweep found the kernel's fast configs all spilling
(`results_h200_flash_diff_backward_sweep.md`), so a change meant to remove spills can be checked here first, on
the CPU, before device time goes to timing it.
"""

import inspect
import os
import re
import subprocess
import tempfile

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attention_bench import DKDV_GRID
from modeling_diff.kernels.triton_flash_diff import _flash_diff_bwd_dkdv

PTXAS = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
POINTERS = {"Mu": "*fp32", "Lse": "*fp32", "Delta": "*fp32", "Mask": "*u8",
            **dict.fromkeys("Q K V G DK DVout".split(), "*bf16")}
# the GPU's constants (S_STATIC and L_STATIC: their defaults, the interpreter's loop bounds off)
V1_SHAPES = dict(SCALE=0.125, GROUP=4, DQK=64, DV=128, SPLIT_K=True, V1=True, HAS_MASK=False, HEADS=4, S_STATIC=0,
                 L_STATIC=0)


def ptxas_report(kernel, constants: dict, num_warps: int, num_stages: int) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) of `kernel` compiled for sm_90a: the pointers of POINTERS, the
    `constants` as constexprs, every other argument an int32."""
    params = list(inspect.signature(kernel.fn).parameters)
    constants = {name: value for name, value in constants.items() if name in params}
    signature = {p: "constexpr" if p in constants else POINTERS.get(p, "i32") for p in params}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(params.index(name),): value for name, value in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as file:
            file.write(compiled.asm["ptx"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spilled


def main():
    print("| BLOCK_M | BLOCK_N | warps | stages | registers | spill stores (bytes) |\n|---|---|---|---|---|---|")
    for config in DKDV_GRID:
        options = {k: config[k] for k in ("num_warps", "num_stages")}
        registers, spilled = ptxas_report(_flash_diff_bwd_dkdv, {**V1_SHAPES, **config}, **options)
        print(f"| {config['BLOCK_M']} | {config['BLOCK_N']} | {options['num_warps']} | {options['num_stages']} | "
              f"{registers} | {spilled} |", flush=True)


if __name__ == "__main__":
    main()
