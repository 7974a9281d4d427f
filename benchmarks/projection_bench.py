"""The Linear maps of a decoding step: cuBLAS (one F.linear per weight) against modeling_diff's projection kernels
(`kernels/projection.py`: q, k, v and V2's lambda_proj in one launch; gate and up with silu(gate) * up in one),
each timed as a CUDA graph of 20 calls replayed (what a graph-replayed decoding step pays, without launch overhead
from the host), and the host time of a call issued eagerly (the layers' own forward against the kernel's wrapper:
what an eager DynamicCache step, bound by the host CPU, pays).

    python benchmarks/projection_bench.py [--sweep] [--shapes gate down] [--tokens 1] [--out $OUT/projections.json]

Shapes: the ~1.1B presets (hidden 2048, MLP 8192, vocab 32000), at 1 and 32 tokens. Prints per shape the time of
each and the bandwidth reached (the weights' bytes / time; the copy bandwidth measured in the same run beside it).
`--sweep` also times the kernels at other block sizes, warps and pipeline stages, to choose the defaults.
"""

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench import copy_bandwidth, warm_up_gpu, write_atomically
from modeling_diff.kernels.projection import gated_projection, launch_gated_projection, launch_projections, linear_maps

HIDDEN, MLP, VOCAB = 2048, 8192, 32000
# (name, output widths of the weights read together, input width, gated)
SHAPES = [
    ("qkv (dex, llama 32x64 / 8 kv)", (2048, 512, 512), HIDDEN, False),
    ("qkv + lambda_proj (v2)", (4096, 512, 512, 32), HIDDEN, False),
    ("o_proj", (2048,), HIDDEN, False),
    ("gate, up + silu * up", (MLP,), HIDDEN, True),
    ("down_proj", (HIDDEN,), MLP, False),
    ("lm_head", (VOCAB,), HIDDEN, False),
]
CALLS = 20  # per graph


def graph_time(fn) -> float:
    """Seconds per call of `fn`, CALLS calls captured in one CUDA graph, the median of 20 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def host_time(fn, calls: int = 300) -> float:
    """Seconds of host time per call of `fn` issued back to back (the launch queue absorbs the GPU's share): what an
    eager decoding step, bound by the host CPU, pays. The median of 5 rounds."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return sorted(times)[2]


def kernel_call(x, weights, gated, block_n, step, warps, stages):
    """The kernel at one configuration of the sweep, through the launches the model's wrappers use."""
    if gated:
        y = torch.empty(x.shape[0], weights[0].shape[0], dtype=x.dtype, device=x.device)
        return lambda: launch_gated_projection(x, weights[0], weights[1], y, block_n, step, stages, warps)
    y = torch.empty(x.shape[0] * sum(w.shape[0] for w in weights), dtype=x.dtype, device=x.device)
    return lambda: launch_projections(x, weights, y, block_n, step, stages, warps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time other block sizes, warps and stages too")
    parser.add_argument("--shapes", nargs="+", help="only the shapes whose name contains one of these")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32], help="tokens of x (at most 64)")
    parser.add_argument("--out", help="JSON file for the rows")
    args = parser.parse_args(argv)
    warm_up_gpu()
    bandwidth = copy_bandwidth()
    rows = []
    shapes = [s for s in SHAPES if not args.shapes or any(part in s[0] for part in args.shapes)]
    cases = [(s, m) for s in shapes for m in args.tokens]
    for (name, widths, k, gated), m in tqdm(cases, desc="shapes"):
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths]
        if gated:
            weights.append(torch.randn_like(weights[0]))
        nbytes = sum(w.numel() * 2 for w in weights)
        if gated:
            cublas = lambda: F.silu(F.linear(x, weights[0])) * F.linear(x, weights[1])  # noqa: E731
        else:
            cublas = lambda: [F.linear(x, w) for w in weights]  # noqa: E731
        row = dict(shape=name, tokens=m, mbytes=nbytes / 1e6, cublas_us=graph_time(cublas) * 1e6)
        layers = [torch.nn.Linear(k, w.shape[0], bias=False, device="cuda", dtype=w.dtype) for w in weights]
        for layer, w in zip(layers, weights):
            layer.weight.data = w
        if gated:  # the modules' own forward, as the model calls them without the kernels
            module_calls = lambda: F.silu(layers[0](x)) * layers[1](x)  # noqa: E731
        else:
            module_calls = lambda: [layer(x) for layer in layers]  # noqa: E731
        with torch.no_grad():  # the model's call, with its block sizes
            call = (lambda: gated_projection(x, *layers)) if gated else (lambda: linear_maps(x, *layers, fused=True))
            row["kernel_us"] = graph_time(call) * 1e6
            row["cublas_host_us"], row["kernel_host_us"] = host_time(module_calls) * 1e6, host_time(call) * 1e6
        configs = itertools.product((16, 32, 64, 128), (64, 128, 256, 512), (4, 8), (3, 4, 5)) if args.sweep else ()
        timed = [(row["kernel_us"], "default")]
        for config in configs:
            try:
                timed.append((graph_time(kernel_call(x, weights, gated, *config)) * 1e6, config))
            except Exception as error:  # a config out of the GPU's shared memory
                tqdm.write(f"{name} m={m} {config}: {type(error).__name__}")
        row["best_us"], row["best_config"] = min(timed, key=lambda t: t[0])
        row["configs"] = sorted(timed, key=lambda t: t[0])
        row["cublas_tbs"] = nbytes / row["cublas_us"] / 1e6
        row["kernel_tbs"] = nbytes / row["kernel_us"] / 1e6
        row["best_tbs"] = nbytes / row["best_us"] / 1e6
        rows.append(row)
        tqdm.write(json.dumps(row))
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; (block rows, block k, warps, stages) of the best config")
    print("| weights | tokens | MB | cuBLAS us (TB/s) | kernel us (TB/s) | best us (TB/s), config | kernel vs cuBLAS | "
          "host us: modules / kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens']} | {r['mbytes']:.1f} | {r['cublas_us']:.1f} ({r['cublas_tbs']:.2f}) | "
              f"{r['kernel_us']:.1f} ({r['kernel_tbs']:.2f}) | {r['best_us']:.1f} ({r['best_tbs']:.2f}), "
              f"{r['best_config']} | {r['cublas_us'] / r['kernel_us']:.2f}x | "
              f"{r['cublas_host_us']:.1f} / {r['kernel_host_us']:.1f} |")
    if args.out:
        write_atomically(args.out, json.dumps(dict(bandwidth_tbs=bandwidth / 1e12, rows=rows), indent=1))


if __name__ == "__main__":
    main()
