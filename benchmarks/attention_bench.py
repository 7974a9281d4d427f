"""One attention layer of the ~1.1B models, forward and forward + backward, on one GPU: which path is faster.

    python benchmarks/attention_bench.py --seq 2048 8192
    python benchmarks/attention_bench.py --sweep     # V1's flash-diff kernels over a grid of block sizes
    python benchmarks/attention_bench.py --sweep --mode v2     # V2's (one key head for both maps, V of d)
    python benchmarks/attention_bench.py --sweep --seq 2048 --kernels dkdv     # the dK/dV kernel alone
    python benchmarks/attention_bench.py --profile --seq 2048 8192   # each layer's step by kernel (torch.profiler)

Rows: transformers' LlamaAttention (32 heads of 64, 8 kv heads; SDPA) as the reference; modeling_diff V1 and
V2 through the flash-diff kernel (`kernels/flash_diff.py`, attn_implementation "fused_diff") and through the
plain path (one attention call of the pairs, then the fused Triton combine), and DEX (one attention call). The plain
paths' attention call is FlashAttention-4's where the flash-attn-4 package is installed
(`MODELING_DIFF_FLASH_ATTN_4=0` in the environment: SDPA's). Projections, RoPE and the output
projection are included, as in the model. Tokens per batch: 8192 (4 x 2048, or 1 x 8192).

`--profile` puts each layer's forward + backward down to its kernels: GPU ms a step per kernel name, the
attention's own kernels (flash-diff's three, or cuDNN's) beside the projections' matmuls.

`--sweep` times each of the three flash-diff kernels (forward, dK/dV, dQ) of V1 or V2 (`--mode`) alone at the
model's shapes for every block size, warp count and pipeline depth of a grid, beside the candidate the autotuner
picked: what to put among the autotuner's candidates in `triton_flash_diff.py`.
"""

import argparse
import itertools
import sys
from collections import Counter

import torch
from tqdm import tqdm
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding

from modeling_diff import preset_config
from modeling_diff.diff_attention import ATTENTION_CLASSES


def layer(name: str):
    """(module, config) in bf16 on the GPU; name: llama, v1, v2, dex, v1-plain or v2-plain."""
    if name == "llama":
        config = LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
        config._attn_implementation = "sdpa"
        module = LlamaAttention(config, layer_idx=0)
    else:
        mode = name.split("-")[0]
        config = preset_config(f"1.1b-{mode}")
        config._attn_implementation = "fused_diff"
        module = ATTENTION_CLASSES[mode](config, layer_idx=0)
        if name.endswith("plain"):
            module.flash_diff_applies = lambda *args: False
    return module.to("cuda", torch.bfloat16), config


def milliseconds(fn, repeats: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def steps(name: str, seq: int, tokens: int):
    """(forward, train): one forward without gradients, and one forward + backward, of the layer `name` on random
    hidden states of `tokens` tokens in sequences of `seq`."""
    module, config = layer(name)
    batch = max(1, tokens // seq)
    x = torch.randn(batch, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq, device="cuda")[None].expand(batch, -1)
    rope = LlamaRotaryEmbedding(config, device="cuda")(x, positions)
    grad = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            module(x, rope, None)

    def train():
        out = module(x, rope, None)[0]
        out.backward(grad)

    return forward, train


def measure(name: str, seq: int, tokens: int, repeats: int) -> dict:
    forward, train = steps(name, seq, tokens)
    return dict(model=name, seq=seq, forward_ms=milliseconds(forward, repeats), train_ms=milliseconds(train, repeats))


def per_kernel_ms(averages, repeats: int) -> Counter:
    """GPU ms per kernel name per step from the profiler's `key_averages()` over `repeats` steps (as profile_train.py
    reads them: the entries with a self device time are the kernels)."""
    return Counter({e.key: e.self_device_time_total / 1000 / repeats for e in averages if e.self_device_time_total > 0})


def profile_kernels(name: str, seq: int, tokens: int, repeats: int = 10) -> Counter:
    """The layer's forward + backward by kernel: GPU ms a step per kernel name, after 3 untimed steps."""
    from torch.profiler import ProfilerActivity, profile

    _, train = steps(name, seq, tokens)
    for _ in range(3):
        train()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            train()
        torch.cuda.synchronize()
    return per_kernel_ms(prof.key_averages(), repeats)


class FixedLaunch:
    """A Triton kernel launched with fixed block sizes and options in place of its autotuned wrapper; it keeps its
    last launch so that the kernel can be timed alone (`relaunch`, which returns the compiled kernel). Its key and
    value descriptors get the config's tiles, as the autotuner's pre-hook gives them (`tile_descriptors`)."""

    def __init__(self, kernel, **options):
        self.kernel, self.options, self.last = kernel, options, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from modeling_diff.kernels.triton_flash_diff import tile_descriptors

            meta = {**kwargs, **self.options}
            tile_descriptors({**dict(zip(self.kernel.arg_names, args)), **meta})  # kept by every relaunch
            self.last = (grid(meta) if callable(grid) else grid, args, meta)
            self.relaunch()
        return launch

    def relaunch(self):
        grid, args, meta = self.last
        return self.kernel[grid](*args, **meta)


def _grid(blocks, warps, stages):
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for (m, n), w, s in itertools.product(blocks, warps, stages)]


DKDV_BLOCKS = [(16, 32), (32, 32), (64, 32), (128, 32), (16, 64), (32, 64), (64, 64), (32, 128)]
# 8 warps at 128 keys: two warpgroups of 64 keys share the query tiles; 16 x 128 is the grid's one fast-sized
# config that spills nothing (`kernel_registers.py`), 32 x 128 at 2 stages spills only outside the query loops
# V2's accumulators (dK, dK, dV of 64 wide) take half of V1's registers: larger tiles and deeper pipelines for it
DKDV_GRID = [*_grid(DKDV_BLOCKS, [4], [2, 3]), *_grid([(32, 64), (64, 64), (16, 128), (32, 128)], [8], [3]),
             *_grid([(16, 128), (32, 128)], [8], [2]), *_grid([(64, 128), (128, 64)], [8], [2, 3]),
             *_grid([(32, 128), (64, 64)], [4], [4])]
DQ_GRID = _grid([(64, 32), (64, 64), (128, 32), (128, 64)], [4, 8], [2, 3])
FWD_GRID = [*_grid([(64, 64), (128, 32), (128, 64)], [4, 8], [2, 3, 4]), *_grid([(64, 128), (128, 128)], [8], [2, 3])]
SWEEP_KERNELS = ("fwd", "dkdv", "dq")


def sweep_kernels(seq: int, tokens: int, kernels_timed=SWEEP_KERNELS, mode: str = "v1") -> list[dict]:
    """The flash-diff kernels of `mode` at the ~1.1B model's shapes (V1: 16 heads, 4 kv heads, d 64, K1|K2
    and V 128 wide, lambda and subln; V2: 32 heads, 8 kv heads, one key head of 64 for both maps, V 64, a noise
    weight per token), each config of the grid timed alone (median ms of triton.testing.do_bench), the other kernels
    left to their autotuner. Each config's output and gradients are compared with the autotuned kernels' (max
    relative error).
    kernels_timed: those of SWEEP_KERNELS to time."""
    import triton

    import modeling_diff.kernels.flash_diff as flash_diff
    import modeling_diff.kernels.triton_flash_diff as kernels

    config = preset_config(f"1.1b-{mode}")
    batch, heads, kv_heads, d = max(1, tokens // seq), config.num_attention_heads, config.num_key_value_heads, 64
    v1 = mode == "v1"
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    query = torch.randn(batch, seq, heads, 2, d, **bf16, requires_grad=True)
    key = torch.randn(batch, kv_heads, seq, 2 * d if v1 else d, **bf16, requires_grad=True)
    value = torch.randn(batch, kv_heads, seq, 2 * d if v1 else d, **bf16, requires_grad=True)
    if v1:
        mu = torch.tensor(0.3, device="cuda", requires_grad=True)
        norm = LlamaRMSNorm(2 * d).to(**bf16)  # V1's subln
    else:  # V2's noise weight per token and head, in (0, 1) as its sigmoid gives it
        mu = torch.rand(batch, seq, heads, **bf16).requires_grad_()
        norm = None
    grad = torch.randn(batch, seq, heads, value.shape[-1], **bf16)

    def step():
        out = flash_diff.flash_diff_attention(query, key, value, None, mu, d**-0.5, norm=norm, norm_scale=0.8)
        return out, *torch.autograd.grad(out, (query, key, value), grad)

    reference = step()  # the autotuned kernels' choice
    rows = []
    runs = [("fwd", "flash_diff_fwd", kernels._flash_diff_fwd, FWD_GRID),
            ("dkdv", "flash_diff_bwd_dkdv", kernels._flash_diff_bwd_dkdv, DKDV_GRID),
            ("dq", "flash_diff_bwd_dq", kernels._flash_diff_bwd_dq, DQ_GRID)]
    for name, attribute, raw, candidates in (run for run in runs if run[0] in kernels_timed):
        tuned = getattr(flash_diff, attribute)
        picked = {**tuned.best_config.kwargs, "num_warps": tuned.best_config.num_warps,
                  "num_stages": tuned.best_config.num_stages}
        for options in tqdm(candidates, desc=f"{name} {seq}"):
            fixed = FixedLaunch(raw, **options)
            setattr(flash_diff, attribute, fixed)
            row = dict(kernel=name, mode=mode, seq=seq, batch=batch, **options)
            try:
                grads = step()
                row["err"] = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference))
                compiled = fixed.relaunch()
                row["regs"], row["spills"] = compiled.n_regs, compiled.n_spills
                row["ms"] = triton.testing.do_bench(fixed.relaunch, return_mode="median")
            except triton.runtime.errors.OutOfResources:
                row["ms"] = float("nan")
            finally:
                setattr(flash_diff, attribute, tuned)
            row["picked"] = options == picked
            rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="the flash-diff kernels over a grid of block sizes")
    parser.add_argument("--mode", choices=("v1", "v2"), default="v1", help="--sweep: the model whose shapes")
    parser.add_argument("--profile", action="store_true", help="each layer's forward + backward by kernel")
    parser.add_argument("--top", type=int, default=8, help="--profile: the kernels shown per layer")
    parser.add_argument("--layers", nargs="+", default=["llama", "v1", "v1-plain", "v2", "v2-plain"],
                        choices=["llama", "v1", "v1-plain", "v2", "v2-plain", "dex"], help="the rows (llama first)")
    parser.add_argument("--kernels", nargs="+", choices=SWEEP_KERNELS, default=SWEEP_KERNELS,
                        help="--sweep: the kernels to time")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention_bench.py needs a CUDA GPU")
    if args.sweep:
        rows = [r for s in args.seq for r in sweep_kernels(s, args.tokens, args.kernels, args.mode)]
        print("| kernel | mode | seq x batch | BLOCK_M | BLOCK_N | warps | stages | ms | registers / spills | "
              "grad error | autotuner's pick |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(rows, key=lambda r: (r["kernel"], r["seq"], r["ms"])):
            print(f"| {r['kernel']} | {r['mode']} | {r['seq']} x {r['batch']} | {r['BLOCK_M']} | {r['BLOCK_N']} | "
                  f"{r['num_warps']} | {r['num_stages']} | {r['ms']:.3f} | "
                  f"{r.get('regs', '')} / {r.get('spills', '')} | {r.get('err', float('nan')):.1e} | "
                  f"{'yes' if r['picked'] else ''} |")
        return
    names = args.layers
    if args.profile:  # the table after the progress bars, so that no line of it shares one with them
        lines = ["| seq | layer | kernel | GPU ms a step | share of the layer's |", "|---|---|---|---|---|"]
        for seq in args.seq:
            for name in tqdm(names, desc=f"profiles {seq}"):
                times = profile_kernels(name, seq, args.tokens)
                total = sum(times.values())
                lines += [f"| {seq} | {name} | {kernel[:80]} | {ms:.3f} | {ms / total:.0%} |"
                          for kernel, ms in times.most_common(args.top)]
                lines.append(f"| {seq} | {name} | all {len(times)} kernels | {total:.3f} | 100% |")
        print("\n".join(lines))
        return
    rows = [measure(n, s, args.tokens, args.repeats) for s in args.seq for n in tqdm(names, desc="layers")]
    base = {r["seq"]: r for r in rows if r["model"] == "llama"}
    print("| seq | layer | forward ms | vs Llama | forward + backward ms | vs Llama |\n|---|---|---|---|---|---|")
    for r in rows:
        ref = base[r["seq"]]
        print(f"| {r['seq']} | {r['model']} | {r['forward_ms']:.3f} | {r['forward_ms'] / ref['forward_ms']:.2f}x | "
              f"{r['train_ms']:.3f} | {r['train_ms'] / ref['train_ms']:.2f}x |")


if __name__ == "__main__":
    main()
