"""Probe: the MLP's activation in the epilogue of a Triton matrix product, against cuBLAS's product and the separate
activation pass (`kernels/swiglu.py`), at the benchmark's shapes (tokens x hidden 2048, intermediate 8192, bf16).

    backward  dc = dy @ W_down (T x I, inner dimension = hidden), then da, db and c from a = gate(x), b = up(x)
    forward   a = x @ W_gate^T and b = x @ W_up^T in one program (two accumulators), then c = silu(a) b

The activation pass reads and writes (tokens x intermediate) tensors at the bandwidth's limit (4.3 + 2.0 ms of a 2K x 4
step of DEX on an H100); in the product's epilogue it would not re-read dc, gate(x) and up(x). Worth it only if the
Triton product runs near cuBLAS's. Each variant is timed as a CUDA graph (GPU time), alternating, and checked against
the current path (the same rounding: dc and a, b rounded to bf16 before the activation).

    python benchmarks/mlp_epilogue_probe.py [--tokens 8192] [--hidden 2048] [--intermediate 8192] [--quick]
"""

import argparse
import itertools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from modeling_diff.kernels import swiglu


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order of output tiles (GROUP_M rows of tiles at a time, for L2 reuse)."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % group_m), (tile_id % in_group) // group_m


@triton.jit
def _bwd_epilogue(dc, off_m, off_n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE: tl.constexpr, EPILOGUE: tl.constexpr):
    if EPILOGUE:
        dc = dc.to(DAd.dtype).to(tl.float32)  # dc rounded as cuBLAS writes it
        a = Ad.load([off_m, off_n]).to(tl.float32)
        b = Bd.load([off_m, off_n]).to(tl.float32)
        sig = tl.sigmoid(a)
        s = (a * sig).to(DAd.dtype).to(tl.float32)
        ds = (dc * b).to(DAd.dtype).to(tl.float32)
        DAd.store([off_m, off_n], (ds * sig * (1.0 + a * (1.0 - sig))).to(DAd.dtype))
        DBd.store([off_m, off_n], (dc * s).to(DBd.dtype))
        if RECOMPUTE:
            Cd.store([off_m, off_n], (s * b).to(Cd.dtype))
    else:
        DAd.store([off_m, off_n], dc.to(DAd.dtype))


@triton.jit
def _mm_swiglu_bwd(Gd, Wd, Ad, Bd, DAd, DBd, Cd, M, N, K, PROGRAMS,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, RECOMPUTE: tl.constexpr, EPILOGUE: tl.constexpr):
    """dc = G (M x K) @ W (K x N), and the activation's backward in the epilogue; PROGRAMS programs loop over the tiles
    (persistent where fewer than the tiles)."""
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m, off_n = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            acc = tl.dot(Gd.load([off_m, ki * BK]), Wd.load([ki * BK, off_n]), acc)
        if SUBTILE:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            _bwd_epilogue(acc0, off_m, off_n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE, EPILOGUE)
            _bwd_epilogue(acc1, off_m, off_n + BN // 2, Ad, Bd, DAd, DBd, Cd, RECOMPUTE, EPILOGUE)
        else:
            _bwd_epilogue(acc, off_m, off_n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE, EPILOGUE)


@triton.jit
def _mm_swiglu_fwd(Xd, WGd, WUd, Ad, Bd, Cd, M, N, K, PROGRAMS,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   FLATTEN: tl.constexpr, EPILOGUE: tl.constexpr):
    """a = X (M x K) @ WG^T, b = X @ WU^T (WG, WU: N x K) in one program, and c = silu(a) b in the epilogue."""
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m, off_n = pid_m * BM, pid_n * BN
        acc_a = tl.zeros((BM, BN), dtype=tl.float32)
        acc_b = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            x = Xd.load([off_m, ki * BK])
            acc_a = tl.dot(x, WGd.load([off_n, ki * BK]).T, acc_a)
            acc_b = tl.dot(x, WUd.load([off_n, ki * BK]).T, acc_b)
        a = acc_a.to(Ad.dtype)
        b = acc_b.to(Bd.dtype)
        Ad.store([off_m, off_n], a)
        Bd.store([off_m, off_n], b)
        if EPILOGUE:
            af = a.to(tl.float32)
            s = (af * tl.sigmoid(af)).to(Cd.dtype).to(tl.float32)
            Cd.store([off_m, off_n], (s * b.to(tl.float32)).to(Cd.dtype))


def descriptor(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))


def mm_swiglu_bwd(grad_rows, w_down, gate, up, cfg, epilogue=True):
    """(da, db, c) as `swiglu._SwiGLUMLP.backward`'s product and activation pass compute them."""
    M, K = grad_rows.shape
    N = w_down.shape[1]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    EN = BN // 2 if cfg["SUBTILE"] else BN
    da, db, c = torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(gate)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, cfg["programs"]) if cfg["programs"] else tiles
    _mm_swiglu_bwd[(programs,)](
        descriptor(grad_rows, (BM, BK)), descriptor(w_down, (BK, BN)), descriptor(gate, (BM, EN)),
        descriptor(up, (BM, EN)), descriptor(da, (BM, EN)), descriptor(db, (BM, EN)), descriptor(c, (BM, EN)),
        M, N, K, programs, BM=BM, BN=BN, BK=BK, GROUP_M=8, SUBTILE=cfg["SUBTILE"], FLATTEN=cfg["FLATTEN"],
        RECOMPUTE=True, EPILOGUE=epilogue, num_warps=cfg["warps"], num_stages=cfg["stages"])
    return da, db, c


def mm_swiglu_fwd(rows, w_gate, w_up, cfg, epilogue=True):
    M, K = rows.shape
    N = w_gate.shape[0]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    a = rows.new_empty(M, N)
    b, c = torch.empty_like(a), torch.empty_like(a)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, cfg["programs"]) if cfg["programs"] else tiles
    _mm_swiglu_fwd[(programs,)](
        descriptor(rows, (BM, BK)), descriptor(w_gate, (BN, BK)), descriptor(w_up, (BN, BK)),
        descriptor(a, (BM, BN)), descriptor(b, (BM, BN)), descriptor(c, (BM, BN)),
        M, N, K, programs, BM=BM, BN=BN, BK=BK, GROUP_M=8, FLATTEN=cfg["FLATTEN"], EPILOGUE=epilogue,
        num_warps=cfg["warps"], num_stages=cfg["stages"])
    return a, b, c


def current_bwd(grad_rows, w_down, gate, up):
    """The path of `_SwiGLUMLP.backward`: cuBLAS's dc, then the activation pass (da in place of dc)."""
    dc = grad_rows.mm(w_down)
    db, c = torch.empty_like(up), torch.empty_like(gate)
    swiglu._swiglu_bwd[(triton.cdiv(gate.numel(), swiglu.BLOCK),)](
        gate, up, dc, dc, db, c, gate.numel(), BLOCK=swiglu.BLOCK, RECOMPUTE=True)
    return dc, db, c


def current_fwd(rows, w_gate, w_up):
    a, b = torch.nn.functional.linear(rows, w_gate), torch.nn.functional.linear(rows, w_up)
    return a, b, swiglu._silu_mul(a, b)


def configs(quick, sms, forward):
    shapes = [(128, 128, 64), (128, 256, 64)] if not forward else [(128, 128, 64), (128, 64, 64)]
    out = []
    for (BM, BN, BK), stages, warps, flatten, programs, subtile in itertools.product(
            shapes, (3, 4), (8,), (True, False), (None, sms, 2 * sms), (False, True)):
        if (programs is None and flatten) or (forward and subtile) or (quick and (stages == 4 or subtile)):
            continue
        out.append(dict(BM=BM, BN=BN, BK=BK, stages=stages, warps=warps, FLATTEN=flatten, programs=programs,
                        SUBTILE=subtile))
    return out


def timed(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    T, H, I = args.tokens, args.hidden, args.intermediate
    bf = dict(device="cuda", dtype=torch.bfloat16)
    rows, grad_rows = torch.randn(T, H, **bf), torch.randn(T, H, **bf)
    w_gate, w_up = torch.randn(I, H, **bf) / H ** 0.5, torch.randn(I, H, **bf) / H ** 0.5
    w_down = torch.randn(H, I, **bf) / I ** 0.5
    gate, up = current_fwd(rows, w_gate, w_up)[:2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak_flop = 2 * T * H * I

    for direction in ("backward", "forward"):
        forward = direction == "forward"
        ref = current_fwd(rows, w_gate, w_up) if forward else current_bwd(grad_rows, w_down, gate, up)
        base = (lambda: current_fwd(rows, w_gate, w_up)) if forward else (
            lambda: current_bwd(grad_rows, w_down, gate, up))
        product = (lambda: (torch.nn.functional.linear(rows, w_gate), torch.nn.functional.linear(rows, w_up))) \
            if forward else (lambda: grad_rows.mm(w_down))
        flop = peak_flop * (2 if forward else 1)
        print(f"\n## {direction}, {T} x {H} -> {I}, {torch.cuda.get_device_name()}\n")
        print("| variant | us | TFLOP/s of the products | max |err| vs current |\n|---|---|---|---|")
        for name, fn in (("current: cuBLAS + activation pass", base), ("cuBLAS product(s) alone", product)):
            us = timed(fn)
            print(f"| {name} | {us:.1f} | {flop / us / 1e6:.0f} | |", flush=True)
        results = []
        for cfg in configs(args.quick, sms, forward):
            run = (lambda c=cfg: mm_swiglu_fwd(rows, w_gate, w_up, c)) if forward else (
                lambda c=cfg: mm_swiglu_bwd(grad_rows, w_down, gate, up, c))
            bare = (lambda c=cfg: mm_swiglu_fwd(rows, w_gate, w_up, c, epilogue=False)) if forward else (
                lambda c=cfg: mm_swiglu_bwd(grad_rows, w_down, gate, up, c, epilogue=False))
            try:
                got = run()
                err = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref))
                us, us_bare = timed(run), timed(bare)
            except Exception as error:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"| {cfg} | failed: {type(error).__name__}: {str(error)[:80]} | | |", flush=True)
                continue
            results.append((us, cfg))
            print(f"| fused {cfg} | {us:.1f} (product alone {us_bare:.1f}) | {flop / us_bare / 1e6:.0f} | {err:.3g} |",
                  flush=True)
        if results:
            us, cfg = min(results, key=lambda r: r[0])
            again = [(timed(base), timed(lambda: (mm_swiglu_fwd(rows, w_gate, w_up, cfg) if forward else
                                                  mm_swiglu_bwd(grad_rows, w_down, gate, up, cfg)))) for _ in range(3)]
            print(f"\nbest {cfg}: current vs fused, alternating: " +
                  ", ".join(f"{b:.1f} / {f:.1f}" for b, f in again), flush=True)


if __name__ == "__main__":
    main()
