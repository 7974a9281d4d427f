"""Registers, spills and loop lengths of the flash-diff kernels for the H200, compiled without a GPU.

    python benchmarks/kernel_registers.py              # the dK/dV kernel at V1's shapes
    python benchmarks/kernel_registers.py --mode v2    # at V2's
    python benchmarks/kernel_registers.py --kernel fwd --mode v2 --opcodes    # the forward, and each loop's opcodes

Triton compiles each config of a grid for sm_90a at the ~1.1B model's shapes (V1: keys K1|K2 of 64 each, V 128,
4 differential heads per kv head; V2: one 64-wide key head for both maps, V 64, 4 pairs per kv head): the dK/dV
and dQ kernels over `attention_bench.py --sweep`'s grids, the forward over its autotuner's candidates. ptxas (shipped
with triton) reports the registers per thread and the bytes spilled. The H200's sweep found the dK/dV kernel's fast
configs all spilling (`results_h200_flash_diff_backward_sweep.md`), so a change meant to remove spills can be
checked here first, on the CPU, before device time goes to timing it.

ptxas's totals do not say where the spills run. nvdisasm (also shipped with triton) gives the SASS, and the
last columns count the spill instructions (LDL + STL) inside each tile loop (the innermost loops, in program order:
dK/dV's over the diagonal query tiles, then over those that see every key; the forward's and dQ's over the key
tiles every query sees, then the diagonal), which run once a tile, against those in the rest of the kernel, which
run once a head or once a program. Each loop's length is also given per score element of its tile (instructions x
threads / (BLOCK_M x BLOCK_N)): what the loop issues for each query-key pair, comparable across tile sizes and
kernels. `--opcodes` lists each loop's most frequent opcodes (say, the compares and selects of masked loads, or a
multiply the exponent's fused multiply-add could take).
"""

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attention_bench import DKDV_GRID, DQ_GRID
from modeling_diff.kernels.triton_flash_diff import _FWD as FWD_CANDIDATES
from modeling_diff.kernels.triton_flash_diff import _flash_diff_bwd_dkdv, _flash_diff_bwd_dq, _flash_diff_fwd

BIN = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
PTXAS, NVDISASM = os.path.join(BIN, "ptxas"), os.path.join(BIN, "nvdisasm")
# the arguments' types as the model's launches give them (the flash-diff kernels', the decode kernel's Part and
# Written); any other argument is an int32. One differs: V2's forward gets Mu (the noise weight) in the model's
# dtype, which changes only the loads of its epilogue, outside the tile loops
ARGUMENT_TYPES = {"Mu": "*fp32", "Terms": "*fp32", "Lse": "*fp32", "Rstd": "*fp32", "Mask": "*u8", "Part": "*fp32",
                  "Written": "*i64", "eps": "fp32", "norm_scale": "fp32",
                  **dict.fromkeys("Q K V G DK DVout DQ NormW Y Pairs".split(), "*bf16")}  # and `descriptor_types`
# the GPU's constants
V1_SHAPES = dict(SCALE=0.125, GROUP=4, DQK=64, DV=128, SPLIT_K=True, V1=True, HAS_MASK=False, WHOLE_TILES=True)
V2_SHAPES = dict(V1_SHAPES, DV=64, SPLIT_K=False, V1=False)
SHAPES = dict(v1=V1_SHAPES, v2=V2_SHAPES)


def descriptor_types(constants: dict) -> dict:
    """The flash-diff kernels' key and value descriptors as the launches give them: blocks of a tile of keys
    (`tile_descriptors`); none for a kernel without those constants (the decode kernel's)."""
    if not {"BLOCK_N", "DQK", "DV"} <= constants.keys():
        return {}
    n, dqk, dv = (constants[name] for name in ("BLOCK_N", "DQK", "DV"))
    return dict(Kd=f"tensordesc<bf16[{n}, {dqk}]>", Vd=f"tensordesc<bf16[{n}, {dv}]>")


def compile_sm90(kernel, constants: dict, num_warps: int, num_stages: int):
    """`kernel` compiled for sm_90a: the `constants` as constexprs, the other arguments of the types of
    ARGUMENT_TYPES."""
    params = list(inspect.signature(kernel.fn).parameters)
    types = {**ARGUMENT_TYPES, **descriptor_types(constants)}
    constants = {name: value for name, value in constants.items() if name in params}
    signature = {p: "constexpr" if p in constants else types.get(p, "i32") for p in params}
    # As the GPU's launcher specializes them: pointers 16-byte aligned, ints multiples of 16 (the model's strides
    # and lengths are). Without it no load is vectorized or pipelined and the kernel is not the one that runs
    # (32 x 64, 4 warps, 3 stages: 824 bytes of spill stores unaligned, 380 aligned).
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
               if signature[p] != "constexpr" and not signature[p].startswith(("fp", "tensordesc"))}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={(params.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_counts(kernel, constants: dict, num_warps: int, num_stages: int) -> dict:
    """ptxas's counts for `kernel` (`compile_sm90`): registers (per thread), stack (bytes of local memory a thread:
    the GPU's `n_spills` is stack / 4, the unit of `attention_bench.py --sweep`'s spills column), stores and loads
    (bytes of spill stores and loads); and loops: (SASS instructions, LDL + STL among them, opcode counts) of each
    innermost loop, in program order; rest: the LDL + STL outside them."""
    compiled = compile_sm90(kernel, constants, num_warps, num_stages)
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
        with open(ptx, "w") as file:
            file.write(compiled.asm["ptx"])
        with open(cubin, "wb") as file:
            file.write(compiled.asm["cubin"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([NVDISASM, "-c", cubin], capture_output=True, text=True, check=True).stdout
    count = lambda pattern: int(re.search(pattern, log).group(1))  # noqa: E731
    loops, rest = spills_by_loop(sass)
    return dict(registers=count(r"Used (\d+) registers"), stack=count(r"(\d+) bytes stack frame"),
                stores=count(r"(\d+) bytes spill stores"), loads=count(r"(\d+) bytes spill loads"),
                loops=loops, rest=rest)


def spills_by_loop(sass: str) -> tuple[list[tuple[int, int, collections.Counter]], int]:
    """([(instructions, LDL + STL, opcode counts)] of each innermost loop of nvdisasm's `sass`, LDL + STL outside
    them). A loop: a branch back to a label before it; not the out-of-line retries of a TMA barrier's wait (a SYNCS,
    a MOV and the branch back), which are no tile loop. An opcode: the instruction's name without its predicate and
    modifiers (HGMMA, MUFU, FFMA, ...)."""
    labels, instructions, label = {}, [], None
    for line in sass.splitlines():
        if found := re.match(r"\s*\.(L_x_\d+):", line):
            label = found.group(1)
        elif found := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            instructions.append(found.group(2))
            if label is not None:
                labels[label], label = len(instructions) - 1, None
    spans = [(labels[found.group(1)], i) for i, text in enumerate(instructions)
             if (found := re.search(r"BRA\b.*?\.(L_x_\d+)", text)) and labels.get(found.group(1), i) < i]
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    spill = [bool(re.search(r"\b(LDL|STL)\b", text)) for text in instructions]
    opcode = lambda text: re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]  # noqa: E731
    loops = [(b - a + 1, sum(spill[a:b + 1]), collections.Counter(map(opcode, instructions[a:b + 1])))
             for a, b in innermost]
    barrier_wait = {"SYNCS", "MOV", "BRA"}
    loops = [loop for loop in loops if not ("SYNCS" in loop[2] and set(loop[2]) <= barrier_wait)]
    return loops, sum(spill) - sum(n for _, n, _ in loops)


def ptxas_report(kernel, constants: dict, num_warps: int, num_stages: int) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) of `kernel` compiled for sm_90a (`ptxas_counts`)."""
    counts = ptxas_counts(kernel, constants, num_warps, num_stages)
    return counts["registers"], counts["stores"]


# each kernel: (the kernel, its grid, constants beyond the shapes): the forward as training runs it (SAVE)
KERNELS = dict(
    dkdv=(_flash_diff_bwd_dkdv, DKDV_GRID, {}),
    dq=(_flash_diff_bwd_dq, DQ_GRID, {}),
    fwd=(_flash_diff_fwd, FWD_CANDIDATES, dict(SAVE=True)),
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=sorted(SHAPES), default="v1", help="the model's shapes to compile for")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="dkdv", help="the flash-diff kernel")
    parser.add_argument("--opcodes", type=int, nargs="?", const=12, default=0,
                        help="list each loop's N most frequent opcodes (12 if N is left out)")
    args = parser.parse_args(argv)
    kernel, grid, extra = KERNELS[args.kernel]
    print("| BLOCK_M | BLOCK_N | warps | stages | registers | stack bytes (GPU spills x 4) | spill stores / loads "
          "(bytes) | LDL + STL a tile (instructions of the loop; per score element) | LDL + STL elsewhere |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for config in grid:
        options = {k: config[k] for k in ("num_warps", "num_stages")}
        blocks = {k: config[k] for k in ("BLOCK_M", "BLOCK_N")}
        c = ptxas_counts(kernel, {**SHAPES[args.mode], **extra, **blocks}, **options)
        threads_per_element = 32 * options["num_warps"] / (blocks["BLOCK_M"] * blocks["BLOCK_N"])
        loops = ", ".join(f"{spills} ({size}; {size * threads_per_element:.1f})" for size, spills, _ in c["loops"])
        print(f"| {config['BLOCK_M']} | {config['BLOCK_N']} | {options['num_warps']} | {options['num_stages']} | "
              f"{c['registers']} | {c['stack']} | {c['stores']} / {c['loads']} | {loops} | {c['rest']} |", flush=True)
        for number, (_, _, opcodes) in enumerate(c["loops"] if args.opcodes else [], start=1):
            print(f"|   | loop {number}: " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(args.opcodes)) +
                  " | | | | | | | |")


if __name__ == "__main__":
    main()
