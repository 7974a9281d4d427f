"""The decoder norm's backward (`kernels/rmsnorm.py`) at the benchmark's shapes: its weight gradient summed by the
Triton kernel `_rms_norm_dw_sum` (one launch) against torch's column sum and a cast to the weight's dtype (two
launches, the path before it), each timed as a CUDA graph (GPU time, no launch overhead from the host), with the
error of the weight gradient against float64.

    python benchmarks/rmsnorm_backward_bench.py [--tokens 8192] [--width 2048] [--sweep]

`--sweep` also times the sum at other block shapes (columns per program x partial rows per load) and rows per
program of the backward, to choose the defaults (DW_SUM_BLOCK_N, DW_SUM_BLOCK_P, BACKWARD_ROWS).
"""

import argparse
import itertools

import torch
import triton

from modeling_diff.kernels import rmsnorm


def backward(x, weight, rstd, grad_y, torch_sum: bool):
    """`rmsnorm._backward`, or its pass with the weight gradient as torch's column sum of the partials and a cast."""
    if not torch_sum:
        return rmsnorm._backward(x, weight, rstd, grad_y, None, need_weight=True)
    grad_x, grad_parts = rmsnorm._backward_pass(x, weight, rstd, grad_y, None)
    return grad_x, grad_parts.sum(0).to(weight.dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.width, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    weight = torch.nn.Parameter(torch.randn(args.width, device="cuda", dtype=torch.bfloat16))
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    # dw = sum over rows of dy * n, n = x * rstd rounded to x's dtype (the formula of triton_rmsnorm.py), in float64
    reference = (grad_y.double() * (x.float() * rstd[:, None]).to(x.dtype).double()).sum(0)

    defaults = (rmsnorm.BACKWARD_ROWS, rmsnorm.DW_SUM_BLOCK_N, rmsnorm.DW_SUM_BLOCK_P)
    rows_options = (16, 32, 64) if args.sweep else defaults[:1]
    blocks = itertools.product((8, 16, 32, 64), (32, 64, 128)) if args.sweep else [defaults[1:]]
    # (rows a program of the backward, columns, partial rows a load of the sum); None: torch's sum
    configs = [(rows, None, None) for rows in rows_options] + [(rows, *block) for block in blocks
                                                                for rows in rows_options]
    print(f"RMSNorm backward, {args.tokens} x {args.width} bf16 (GPU us per call, CUDA graph)\n")
    print("| rows a program | weight gradient's sum | us | rel. error of dw |\n|---|---|---|---|")
    for rows, block_n, block_p in configs:
        rmsnorm.BACKWARD_ROWS = rows
        if block_n is not None:
            rmsnorm.DW_SUM_BLOCK_N, rmsnorm.DW_SUM_BLOCK_P = block_n, block_p
        torch_sum = block_n is None
        run = lambda: backward(x, weight, rstd, grad_y, torch_sum)  # noqa: E731
        error = ((run()[1].double() - reference).norm() / reference.norm()).item()
        us = triton.testing.do_bench_cudagraph(run, rep=200) * 1e3
        how = "torch's sum + cast" if torch_sum else f"dw_sum, {block_n} columns x {block_p} rows a load"
        print(f"| {rows} | {how} | {us:.1f} | {error:.1e} |", flush=True)
    rmsnorm.BACKWARD_ROWS, rmsnorm.DW_SUM_BLOCK_N, rmsnorm.DW_SUM_BLOCK_P = defaults


if __name__ == "__main__":
    main()
