"""Where an eager DynamicCache decoding step spends its time: host CPU or GPU, per model, on one GPU.

    python benchmarks/profile_decode.py --seq 2048 --batch 32 --out $OUT/profile

At batch 32 an eager step of the ~1.1B models issues a few hundred kernels for a few ms of GPU work, so the
host CPU decides its speed (benchmarks/RESULTS.md). For each model of bench.py this prints the wall time of a
step, the CPU time spent issuing it, and the GPU busy time (torch.profiler); with --out, one file per model with
the profiler's tables (top operators by CPU and by GPU time). With --host, also the Python functions that take the
host's time (cProfile over the timed steps' count again, its own overhead included: compare models, not ms).

With --static, the graph-replayed StaticCache step of bench.py's decode rows instead, kernel by kernel: each
kernel's own time, and its exposed time (`exposed_times`: the part of it after every kernel started before it had
ended). Under programmatic dependent launch the kernels overlap, so their own times add up to more than the step;
the exposed times and the GPU's idle time add up to it, and say which kernels the step waits on:

    python benchmarks/profile_decode.py --static --seq 2048 --batch 1 --models v1 v2 dex --out $OUT/static

Two cautions from the H200 machine: the host's speed drifts (the same steps measured up to 1.5x apart within
minutes; for tok/s, bench.py's lockstep rounds are the measure), and the first model profiled in a process
that calls cuDNN attention (transformers' models) pays ~1.5 ms of CPU per attention call, a later one does not.
"""

import argparse
import cProfile
import gc
import io
import os
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm
from transformers import DynamicCache, StaticCache

from bench import MODELS, DecodingSteps, build, kernels_patched, profiling_args, warm_up_gpu, warm_up_steps


@torch.no_grad()
def profile_model(name: str, seq: int, batch: int, steps: int, out: str | None, host: bool = False) -> dict:
    model = build(name, max_positions=seq + 2 * steps + 16)
    cache = DynamicCache(config=model.config)
    step = DecodingSteps(model, cache, batch, seq, chunk_tokens=4096)
    for _ in range(4):  # warm-up: compiles the Triton kernels
        step()
    torch.cuda.synchronize()
    issue = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        issue += time.perf_counter() - begin
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 3 / 1e6
    row = dict(model=name, wall_ms=wall * 1e3, issue_ms=issue / steps * 1e3, gpu_ms=gpu * 1e3, tok_s=batch / wall)
    if host:
        row["host_functions"] = host_profile(step, steps)
    if out:
        with open(os.path.join(out, f"profile_{name}.txt"), "w") as f:
            f.write(f"{row}\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=60))
            f.write(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
            f.write(row.get("host_functions", ""))
    del model, cache
    gc.collect()
    torch.cuda.empty_cache()
    return row


@torch.no_grad()
def profile_static_graph(name: str, seq: int, batch: int, steps: int, out: str | None) -> dict:
    """The graph-replayed StaticCache step (bench.py's decode rows): its kernels one by one, from the profiler's
    trace of `steps` replays (CUPTI sees the kernels inside a graph), as (name, calls a step, us a step)."""
    replays = 4 + 1 + 10 + 2 * steps  # warm-up, capture, untimed, timed and profiled: a position each
    model = build(name, max_positions=seq + replays + 16)
    cache = StaticCache(config=model.config, max_cache_len=seq + replays)
    step = DecodingSteps(model, cache, batch, seq, chunk_tokens=4096)
    warm_up_steps(step, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    launches = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    exposed, idle = exposed_times(launches)
    rows = [(e.key, e.count / steps, e.self_device_time_total / steps, exposed.get(e.key, 0.0) / steps)
            for e in kernels]
    busy = sum(us for _, _, us, _ in rows)
    row = dict(model=name, step_ms=step_ms, kernel_ms=busy / 1e3, kernels=sum(c for _, c, _, _ in rows),
               idle_ms=idle / steps / 1e3, table=rows)
    if out:
        with open(os.path.join(out, f"static_{name}_b{batch}.md"), "w") as f:
            f.write(f"{name}, batch {batch}, context {seq}: step {step_ms * 1e3:.1f} us replayed, kernels {busy:.1f} us, "
                    f"GPU idle {idle / steps:.1f} us a step\n")
            f.write("| kernel | calls a step | us a step | exposed us a step |\n|---|---|---|---|\n")
            f.writelines(f"| {key[:90]} | {count:g} | {us:.1f} | {shown:.1f} |\n" for key, count, us, shown in rows)
    del graph, model, cache
    gc.collect()
    torch.cuda.empty_cache()
    return row


def exposed_times(launches) -> tuple[dict, float]:
    """Where a stream of overlapping kernels spends its time: launches (name, start, end) -> ({name: the time during
    which that kernel ran and no kernel started before it was still running, summed}, the time no kernel ran
    between the first start and the last end). With programmatic dependent launch a kernel starts while the one
    before it finishes, so the kernels' own times add up to more than the step; the exposed times and the idle
    time add up to it exactly: what each kernel costs on the step's critical path."""
    exposed, idle, covered = {}, 0.0, None  # covered: the end of everything started so far
    for name, start, end in sorted(launches, key=lambda launch: launch[1]):
        if covered is None:
            covered = start
        idle += max(0.0, start - covered)
        exposed[name] = exposed.get(name, 0.0) + max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return exposed, idle


def host_profile(step, steps: int, rows: int = 40) -> str:
    """cProfile's table of `steps` steps, the functions by their own time (tottime) and their callees' (cumtime)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    text.write(f"\ncProfile of {steps} steps, by own time\n")
    stats.sort_stats("tottime").print_stats(rows)
    text.write(f"\ncProfile of {steps} steps, by time with callees\n")
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048, help="prompt tokens before the steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32, help="timed steps")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", help="folder for the profiler tables, one file per model")
    parser.add_argument("--host", action="store_true", help="also cProfile the steps (the --out files get its tables)")
    parser.add_argument("--static", action="store_true",
                        help="the graph-replayed StaticCache step instead: its kernels one by one, own and exposed time")
    args = profiling_args(parser, argv, ("seq", "batch", "steps"), "profile_decode.py")
    warm_up_gpu()
    if args.static:
        print(f"\nbatch {args.batch}, context {args.seq}, graph-replayed StaticCache steps")
        print("| model | step ms | kernel ms | kernels a step | gaps us a kernel | GPU idle ms |\n|---|---|---|---|---|---|")
        for name in args.models:
            with kernels_patched(name):
                r = profile_static_graph(name, args.seq, args.batch, args.steps, args.out)
            gap = (r["step_ms"] - r["kernel_ms"]) * 1e3 / r["kernels"]
            print(f"| {name} | {r['step_ms']:.3f} | {r['kernel_ms']:.3f} | {r['kernels']:.0f} | {gap:.2f} | "
                  f"{r['idle_ms']:.3f} |")
        return
    rows = []
    for name in tqdm(args.models, desc="models"):
        with kernels_patched(name):
            rows.append(profile_model(name, args.seq, args.batch, args.steps, args.out, args.host))
    base = next((r for r in rows if r["model"] == "llama"), None)
    print(f"\nbatch {args.batch}, prompt {args.seq}, {args.steps} eager DynamicCache steps")
    print("| model | ms / step | CPU issue ms / step | GPU busy ms / step | tok/s | vs Llama |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else ""
        print(f"| {r['model']} | {r['wall_ms']:.2f} | {r['issue_ms']:.2f} | {r['gpu_ms']:.2f} | {r['tok_s']:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
