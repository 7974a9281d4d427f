"""The split-KV decode kernel alone (`kernels/triton_decode._decode_partial`, without its reduce) over a grid of launch
configurations, beside a variant of its loop that reads K and V through TMA tensor descriptors (not adopted: kept here
as the measured alternative, benchmarks/RESULTS.md). Prints us a launch (a CUDA graph of launches replayed,
`triton.testing.do_bench_cudagraph`) and the cache's bytes / time.

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
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench import write_atomically
from modeling_diff.kernels import triton_decode as td
from modeling_diff.kernels._triton import cdiv, next_power_of_2

SHAPES = {  # q heads, kv heads, q dim, k dim, v dim
    "v1": (32, 4, 64, 128, 128), "v2": (64, 8, 64, 64, 64), "dex": (32, 8, 64, 64, 64),
}


@triton.jit(do_not_specialize=["S", "offset", "chunk", "splits", "parts"])
def _partial_tma(Q, Kd, Vd, Part, sqb, sqh, sql, H_KV, S, L, offset, chunk, splits, parts,
                 SCALE: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                 DQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PAIRED: tl.constexpr, CHUNK_STATIC: tl.constexpr):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    start = split * chunk
    r = tl.arange(0, BLOCK_R)
    g = r // L
    t = r % L
    row_ok = r < G * L
    column = dk[None, :] - ((kvh * G + g) % 2 * DQ)[:, None] if PAIRED else dk[None, :]
    q = tl.load(Q + b * sqb + (kvh * G + g)[:, None] * sqh + t[:, None] * sql + column,
                mask=row_ok[:, None] & (column >= 0) & (column < DQ), other=0.0)
    qk_scale = SCALE * 1.4426950408889634
    m_i = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, DV), tl.float32)
    for n0 in range(0, CHUNK_STATIC if CHUNK_STATIC > 0 else chunk, BLOCK_N):
        n = start + n0 + tl.arange(0, BLOCK_N)
        k = Kd.load([pid_bh, start + n0, 0]).reshape(BLOCK_N, DK)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        allowed = (n[None, :] <= (offset + t)[:, None]) & (n < S)[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = Vd.load([pid_bh, start + n0, 0]).reshape(BLOCK_N, DV)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = pid_bh * splits + split
    tl.store(Part + (part * BLOCK_R + r)[:, None] * DV + dv[None, :], acc)
    tl.store(Part + parts * DV + part * BLOCK_R + r, m_i)
    tl.store(Part + parts * (DV + 1) + part * BLOCK_R + r, l_i)


def tma_launch(query, key, value, scale, block_n, warps, stages, per_sm):
    batch, q_heads, length, q_dim = query.shape
    _, kv_heads, kv_length, k_dim = key.shape
    v_dim = value.shape[-1]
    groups = q_heads // kv_heads
    block_rows = max(16, next_power_of_2(groups * length))
    target = max(1, cdiv(per_sm * td._sm_count(query.device), batch * kv_heads))
    chunk = cdiv(cdiv(kv_length, target), block_n) * block_n
    splits = cdiv(kv_length, chunk)
    parts = batch * kv_heads * splits * block_rows
    work = torch.empty(parts * (v_dim + 2), dtype=torch.float32, device=query.device)
    kd = TensorDescriptor.from_tensor(key.view(batch * kv_heads, kv_length, k_dim), [1, block_n, k_dim])
    vd = TensorDescriptor.from_tensor(value.view(batch * kv_heads, kv_length, v_dim), [1, block_n, v_dim])

    def run():
        _partial_tma[(batch * kv_heads, splits)](
            query, kd, vd, work, *query.stride()[:3], kv_heads, kv_length, length, kv_length - length, chunk,
            splits, parts, SCALE=scale, G=groups, BLOCK_R=block_rows, BLOCK_N=block_n, DQ=q_dim, DK=k_dim,
            DV=v_dim, PAIRED=k_dim == 2 * q_dim, CHUNK_STATIC=chunk if td.TRITON_INTERPRETING else 0, num_warps=warps, num_stages=stages)
        return work, splits, parts, block_rows
    return run


def reference_launch(query, key, value, scale, block_n, warps, stages, per_sm):
    patches = dict(PARTIAL_BLOCK_N=block_n, PARTIAL_BLOCK_N_WIDE_FEW_TOKENS=block_n, PARTIAL_NUM_WARPS=warps,
                   PARTIAL_NUM_STAGES=stages, PARTIAL_NUM_STAGES_FEW_TOKENS=stages, PROGRAMS_PER_SM=per_sm,
                   PROGRAMS_PER_SM_FEW_TOKENS=per_sm)

    def run():
        old = {n: getattr(td, n) for n in patches}
        for n, v in patches.items():
            setattr(td, n, v)
        try:
            return td._partial_softmaxes(query, key, value, None, scale, td._plain)
        finally:
            for n, v in old.items():
                setattr(td, n, v)
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
    ap.add_argument("--modes", nargs="+", default=["v1", "v2", "dex"])
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--kinds", nargs="+", default=["ref", "tma"])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), rep=200) * 1e-3)
    del src, dst
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
        for kind, bn, w, st, p in itertools.product(args.kinds, args.block_n, args.warps, args.stages, args.per_sm):
            launch = (tma_launch if kind == "tma" else reference_launch)(q, k, v, scale, bn, w, st, p)
            try:
                res = launch()
                torch.cuda.synchronize()
                out = merged(*res, hq, hkv, args.batch, dv)
                if want is None:
                    want = out
                err = (out - want).abs().max().item()
                us = triton.testing.do_bench_cudagraph(launch, rep=100) * 1e3
            except Exception as e:  # a configuration out of shared memory
                print(f"{mode} {kind} {bn},{w},{st},{p}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row = dict(mode=mode, kind=kind, block_n=bn, warps=w, stages=st, per_sm=p, splits=res[1], us=us,
                       tb_s=cache_bytes / us / 1e6, share_of_copy=cache_bytes / us / 1e6 / (bw / 1e12), err=err)
            rows.append(row)
            print(f"{mode} {kind:3} bn{bn:4} w{w} st{st} p{p} splits {res[1]:3}: {us:7.2f} us "
                  f"{row['tb_s']:.2f} TB/s ({row['share_of_copy']:.2f}) err {err:.1e}", flush=True)
        best = {}
        for r in rows:
            if r["mode"] == mode:
                key = r["kind"]
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        for key, r in best.items():
            print(f"BEST {mode} b{args.batch} {args.seq} {key}: {r}", flush=True)
        del q, k, v
    if args.out:
        write_atomically(args.out, json.dumps(dict(copy_tb_s=bw / 1e12, batch=args.batch, seq=args.seq, rows=rows),
                                              indent=1))


if __name__ == "__main__":
    main()
