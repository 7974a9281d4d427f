"""What programmatic dependent launch (PDL) and split-K save in a graph-replayed decoding step: experimental kernels
(the experiment behind `kernels/triton_launch.py` and `projection.split_linear`, with the variants they did not take:
PDL without reading the weights before the wait, other block sizes and parts).

    python benchmarks/pdl_bench.py [--out $OUT/pdl.json]

A graph-replayed batch-1 step of the ~1.1B models runs ~200 kernels, ~1.2 us apart (benchmarks/RESULTS.md). With
PDL (Hopper), a kernel launched with `launch_pdl=True` may start while the one before it finishes; it waits
(griddepcontrol.wait) before reading what that one wrote, and may read its weights before the wait. This times:
1. the boundary: a graph of 20 tiny kernels, PDL off and on;
2. GEMVs of the step's weights (x (M, K) W^T, W (N, K)), Triton, over block sizes and split-K (float32 partials, then
   a reduce that adds the residual), PDL off / on / on with the first weight tile read before the wait, against
   cuBLAS's F.linear;
3. cuBLAS GEMVs followed by a tiny PDL kernel, against the same without PDL.
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from tqdm import tqdm

from bench import copy_bandwidth, warm_up_gpu, write_atomically
from projection_bench import graph_time  # CALLS calls in one CUDA graph, the median of 20 replays


@triton.jit
def _tiny(X, Y, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) + 1, mask=offs < N)


@triton.jit(do_not_specialize=["M"])
def _gemv(X, W, Y, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          SPLIT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    # Y: (M, N) in X's dtype where SPLIT == 1, else (SPLIT, M, N) float32 partial sums over K / SPLIT each
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k0 = pid_k * (K // SPLIT)
    w_ptrs = W + cols[:, None].to(tl.int64) * K + k0 + ks[None, :]
    x_ptrs = X + rows[:, None] * K + k0 + ks[None, :]
    x_ok = rows[:, None] < M
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PREFETCH:
        w_first = tl.load(w_ptrs)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PREFETCH:
        acc = tl.dot(tl.load(x_ptrs, mask=x_ok, other=0.0), tl.trans(w_first), acc)
    for k in range(BLOCK_K if PREFETCH else 0, K // SPLIT, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=x_ok, other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k)), acc)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT == 1:
        tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.store(Y + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=ok)


@triton.jit
def _split_reduce(P, R, Y, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Y = R + sum_s P[s], P (SPLIT, M, N) float32 partials, R and Y (M, N): down_proj's residual add in its reduce
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.load(R + offs, mask=ok).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * MN + offs, mask=ok)
    tl.store(Y + offs, (acc.to(Y.dtype.element_ty).to(tl.float32) + r).to(Y.dtype.element_ty), mask=ok)


def gemv_call(x, w, residual, block_n, block_k, split, stages, pdl, prefetch, warps=4):
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n), split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split == 1:
        def run():
            _gemv[grid](x, w, y, m, n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=1,
                        PDL=pdl, PREFETCH=prefetch, num_warps=warps, num_stages=stages, launch_pdl=pdl)
        run.y = y
        return run
    parts = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    reduce_block = 1024

    def run():
        _gemv[grid](x, w, parts, m, n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                    PDL=pdl, PREFETCH=prefetch, num_warps=warps, num_stages=stages, launch_pdl=pdl)
        _split_reduce[(triton.cdiv(m * n, reduce_block),)](parts, residual, y, m * n, SPLIT=split, BLOCK=reduce_block,
                                                          PDL=pdl, launch_pdl=pdl)
    run.y = y
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="JSON file for the rows")
    args = parser.parse_args(argv)
    warm_up_gpu()
    bandwidth = copy_bandwidth()
    rows = []
    x = torch.randn(2048, device="cuda")
    y = torch.empty_like(x)
    for pdl in (False, True):
        t = graph_time(lambda: _tiny[(2,)](x, y, 2048, BLOCK=1024, PDL=pdl, launch_pdl=pdl))
        rows.append(dict(test="tiny kernel", pdl=pdl, us=t * 1e6))
        print(f"tiny kernel, PDL {pdl}: {t * 1e6:.2f} us a call")
    shapes = [("o_proj", 2048, 2048), ("down_proj", 2048, 8192), ("qkv dex", 3072, 2048), ("gate+up", 16384, 2048)]
    for (name, n, k), m in tqdm(list(itertools.product(shapes, (1, 32))), desc="shapes"):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        reference = F.linear(xm, w) + residual
        t_cublas = graph_time(lambda: F.linear(xm, w))
        t_cublas_add = graph_time(lambda: torch.add(F.linear(xm, w), residual))
        t_cublas_tiny = {
            pdl: graph_time(lambda: (F.linear(xm, w), _tiny[(2,)](x, y, 2048, BLOCK=1024, PDL=pdl, launch_pdl=pdl)))
            for pdl in (False, True)
        }
        mb = n * k * 2 / 1e6
        base = dict(shape=name, m=m, n=n, k=k, mb=mb)
        rows.append(dict(base, test="cublas", us=t_cublas * 1e6, tb_s=mb / t_cublas / 1e6))
        rows.append(dict(base, test="cublas + add", us=t_cublas_add * 1e6))
        for pdl, t in t_cublas_tiny.items():
            rows.append(dict(base, test="cublas + tiny", pdl=pdl, us=t * 1e6))
        best = None  # the sweep with PDL and the prefetch, then the best config without them
        for block_n, block_k, split in itertools.product((16, 32, 64), (256, 512), (1, 2, 4, 8)):
            if (k // split) % block_k or (split == 8 and k < 8192):
                continue
            row = dict(base, test="triton", block_n=block_n, block_k=block_k, split=split, pdl=True, prefetch=True)
            try:
                fn = gemv_call(xm, w, residual, block_n, block_k, split, 4 if block_n < 64 else 2, True, True)
                fn()
                # split > 1: the reduce adds the residual
                torch.testing.assert_close(fn.y, reference if split > 1 else reference - residual, atol=0.05, rtol=0.02)
                row["us"] = graph_time(fn) * 1e6
            except Exception as error:  # noqa: BLE001 (out of resources: the row says so)
                row["error"] = str(error)[:200]
            rows.append(row)
            if "us" in row and (best is None or row["us"] < best["us"]):
                best = row
        if best is None:
            continue
        cells = [f"PDL + prefetch {best['us']:.2f}"]
        for pdl, prefetch in ((False, False), (True, False)):
            fn = gemv_call(xm, w, residual, best["block_n"], best["block_k"], best["split"],
                           4 if best["block_n"] < 64 else 2, pdl, prefetch)
            t = graph_time(fn) * 1e6
            rows.append(dict(best, pdl=pdl, prefetch=prefetch, us=t))
            cells.append(f"PDL {pdl} prefetch {prefetch} {t:.2f}")
        print(f"{name} m={m} ({mb:.1f} MB): cuBLAS {t_cublas * 1e6:.2f} us ({mb / t_cublas / 1e6:.2f} TB/s), "
              f"+ add {t_cublas_add * 1e6:.2f}; + tiny {t_cublas_tiny[False] * 1e6:.2f} / with PDL "
              f"{t_cublas_tiny[True] * 1e6:.2f}; best Triton n{best['block_n']} k{best['block_k']} "
              f"split {best['split']}: {', '.join(cells)} (split > 1: with the reduce and the residual)")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.out:
        write_atomically(args.out, json.dumps(dict(bandwidth=bandwidth, rows=rows), indent=1))


if __name__ == "__main__":
    main()
