"""The split-KV decode kernel alone (`kernels/triton_decode._decode_partial`, without its reduce) over a grid of launch
configurations. Prints us a launch (a CUDA graph of launches replayed, `triton.testing.do_bench_cudagraph`) and the
cache's bytes / time. (The variant with TMA loads in benchmarks/RESULTS.md was this script's `_partial_tma` at ea6b349:
`git show ea6b349:benchmarks/decode_kernel_sweep.py`; not adopted, so not kept.)

    python benchmarks/decode_kernel_sweep.py --batch 32 --seq 2048 [--modes v1 v2 dex] [--out $OUT/sweep.json]

Caution: launched alone, again and again on the same cache, the kernel finds part of it in L2 (50 MB on the H200):
its rows read up to 4.38 TB/s at 8K, above the copy bandwidth, and it took 38.5 us where the graph-replayed step
spent 41.2 on it. Configurations that keep few bytes in flight gain most from that, so a ranking here is a
candidate for `decode_variants.py`, not a result.
"""

import argparse
import itertools
import json

import torch
import triton

import decode_variants
from bench import copy_bandwidth, write_atomically
from modeling_diff.kernels import triton_decode as td

SHAPES = {  # q heads, kv heads, q dim, k dim, v dim
    "v1": (32, 4, 64, 128, 128), "v2": (64, 8, 64, 64, 64), "dex": (32, 8, 64, 64, 64),
}


def launch_of(query, key, value, scale, block_n, warps, stages, per_sm):
    """The split-KV launch (`_partial_softmaxes`) at one configuration of the grid: decode_variants.py's `--partial`
    variant of the same fields, its constants put back after each launch."""
    variant = decode_variants.partial_variant(f"{block_n},{warps},{stages},{per_sm}")

    def run():
        with decode_variants.switched(variant):
            return td._partial_softmaxes(query, key, value, None, scale, td._plain)
    return run


def merged(work, splits, parts, block_rows, q_heads, kv_heads, batch, v_dim):
    """The merged per-row output (B, KVH, BLOCK_R, DV) from the workspace, in torch."""
    o = work[: parts * v_dim].view(batch * kv_heads, splits, block_rows, v_dim)
    m = work[parts * v_dim: parts * (v_dim + 1)].view(batch * kv_heads, splits, block_rows)
    l = work[parts * (v_dim + 1):].view(batch * kv_heads, splits, block_rows)
    beta = torch.exp2(m - m.amax(1, keepdim=True))
    return (o * beta[..., None]).sum(1) / (l * beta).sum(1)[..., None]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--modes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    S = args.seq + 132  # a StaticCache's length: prompt + warm-up + new tokens
    for mode in args.modes:
        hq, hkv, dq, dk, dv = SHAPES[mode]
        q = torch.randn(args.batch, hq, 1, dq, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(args.batch, hkv, S, dk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(args.batch, hkv, S, dv, device="cuda", dtype=torch.bfloat16)
        cache_bytes = k.numel() * 2 + v.numel() * 2
        scale = dq ** -0.5
        want = None
        for bn, w, st, p in itertools.product(args.block_n, args.warps, args.stages, args.per_sm):
            launch = launch_of(q, k, v, scale, bn, w, st, p)
            try:
                res = launch()
                torch.cuda.synchronize()
                out = merged(*res, hq, hkv, args.batch, dv)
                if want is None:
                    want = out
                err = (out - want).abs().max().item()
                us = triton.testing.do_bench_cudagraph(launch, rep=100) * 1e3
            except Exception as e:  # a configuration out of shared memory
                print(f"{mode} {bn},{w},{st},{p}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row = dict(mode=mode, block_n=bn, warps=w, stages=st, per_sm=p, splits=res[1], us=us,
                       tb_s=cache_bytes / us / 1e6, share_of_copy=cache_bytes / us / 1e6 / (bw / 1e12), err=err)
            rows.append(row)
            print(f"{mode} bn{bn:4} w{w} st{st} p{p} splits {res[1]:3}: {us:7.2f} us "
                  f"{row['tb_s']:.2f} TB/s ({row['share_of_copy']:.2f}) err {err:.1e}", flush=True)
        best = min((r for r in rows if r["mode"] == mode), key=lambda r: r["us"], default=None)
        print(f"BEST {mode} b{args.batch} {args.seq}: {best}", flush=True)
        del q, k, v
    if args.out:
        write_atomically(args.out, json.dumps(dict(copy_tb_s=bw / 1e12, batch=args.batch, seq=args.seq, rows=rows),
                                              indent=1))


if __name__ == "__main__":
    main()
