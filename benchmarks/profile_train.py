"""Where a training step spends its GPU time and its activation memory, per model, on one GPU.

    python benchmarks/profile_train.py --seq 2048 --batch 4 --models llama-liger v1-liger --out $OUT/train_profile

For each model of bench.py (each in a fresh process: Liger's patches are process-wide) this runs forward +
backward + fused AdamW as bench.py's training rows do and prints: the step's wall time, the peak memory, the
bytes the forward saves for the backward (every distinct storage that autograd keeps, through
`torch.autograd.graph.saved_tensors_hooks`), and the GPU time per kernel class (matmuls, attention forward,
attention backward, everything else), per step of two profiled back to back. With --out, one file per model with
the profiler's kernel table, the idle stretches between the second step's kernels (`kernel_gaps`: the first step
starts on an empty queue, the second behind the first's backward and optimizer, as in a training loop) and the
saved activations by shape (which tensors a model keeps that another does not).

With --trace (needs --out), also where the GPU waits on the host within a step: one more step is profiled with the
host's operators and Python frames, its Chrome trace written gzipped, and each stretch in which no kernel ran
(`idle_gaps`) put down to the host operator that launched the kernel after it. A step's wall time minus its GPU
busy time is that idle time plus the host's time before the first kernel and after the last.

With --host, also the host's time to enqueue the decoder stack's training forward (without the loss: Liger's fused
loss synchronizes) and its backward, each behind a `torch.cuda._sleep` long enough that launches only queue, next to
the GPU time of each phase (CUDA events): where the host's time nears the GPU's, the GPU waits for launches.

With --matmuls, also the step's matrix products by operator and shapes (a step profiled with the host's
operators and their input shapes): calls, GPU ms and TFLOP/s of each, against the matmul peak of the same process
(`bench.matmul_peak`): where the products fall short of it, and by how many ms.

With --syncs, also the calls of one step that make the host wait for the GPU (`sync_sites`: torch's sync debug
mode), by call site. After each, the GPU runs dry until the host has launched the work after it, so a sync early in
the forward leaves the forward host-bound.
"""

import argparse
import bisect
import gzip
import json
import math
import os
import statistics
import time
import traceback
import warnings
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from bench import MODELS, build, in_fresh_process, kernels_patched, matmul_peak, profiling_args, warm_up_gpu


def kernel_class(name: str) -> str:
    """A kernel's class from its name: attention forward and backward (the flash-diff kernels, FlashAttention-4's
    CuTe kernels, cuDNN's and PyTorch's SDPA kernels; their pre- and post-processing kernels with the backward),
    cuBLAS / CUTLASS matmuls, the rest. Attention first: FlashAttention-4's names contain "cutlass"."""
    lowered = name.lower()
    if any(word in lowered for word in ("flash_diff", "flash_attn", "flash_fwd", "flash_bwd", "fmha", "attention",
                                        "sdpa", "dot_do_o", "convert_dq")):
        backward = any(word in lowered for word in ("bwd", "bprop", "backward", "dkdv", "_dq", "dot_do_o",
                                                    "fmha_cutlassb"))  # PyTorch's memory-efficient backward
        return "attention backward" if backward else "attention forward"
    if any(word in lowered for word in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "matmul"
    return "other"


def saved_activations(model, ids) -> tuple[float, Counter]:
    """(GiB of distinct storages the forward saves for the backward, GiB by (shape, dtype)); parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, by_shape = set(), Counter()

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in params and tensor.device.type == "cuda":
            seen.add(ptr)
            by_shape[(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))] += storage.nbytes() / 2**30
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(by_shape.values()), by_shape


class HostOps:
    """The host's operators and Python frames [(start, end, thread, name)] of a trace, by thread: which enclose a
    time (a launch)."""

    def __init__(self, host_ops):
        self.by_thread = {}
        for start, end, thread, name in sorted(host_ops):
            self.by_thread.setdefault(thread, []).append((start, end, name))
        self.starts = {thread: [op[0] for op in ops] for thread, ops in self.by_thread.items()}

    def enclosing(self, time_: float, thread) -> list[str]:
        """The names of the operators of `thread` running at `time_`, outermost first."""
        ops = self.by_thread.get(thread, [])
        return [name for _, op_end, name in ops[:bisect.bisect_right(self.starts.get(thread, []), time_)]
                if op_end >= time_]


def idle_gaps(kernels, launches, host_ops, min_gap: float = 0.0) -> tuple[float, list]:
    """The stretches between a step's first kernel start and last kernel end in which no kernel ran, each put down
    to the host: kernels (start, end, correlation, name) and launches {correlation: (time, thread)} as the profiler's
    trace gives them (times in us), host_ops [(start, end, thread, name)] the host's operators and Python frames.
    Returns (the idle time summed, [(gap, the time the kernel after it was launched less the end of the one before,
    the names of the host operators enclosing that launch, outermost first)] for gaps of at least min_gap): a
    launch after the GPU ran dry means the host was behind (or waiting, as in a synchronizing call)."""
    ops = HostOps(host_ops)
    total, gaps, covered = 0.0, [], None
    for start, end, correlation, *_ in sorted(kernels):
        if covered is not None and start > covered:
            total += start - covered
            if start - covered >= min_gap and correlation in launches:
                time_, thread = launches[correlation]
                gaps.append((start - covered, time_ - covered, ops.enclosing(time_, thread)))
        covered = end if covered is None else max(covered, end)
    return total, gaps


# Host operators named after these are ours, transformers', Liger's, FlashAttention-4's or torch.optim's: a launch is
# put down to the innermost of them (else to its innermost operator).
NAMED_SOURCES = ("modeling_diff", "liger_kernel", "transformers/", "flash_attn", "torch/optim", "autograd::engine")


def named_source(enclosing: list[str]) -> str:
    named = [name for name in enclosing if any(word in name for word in NAMED_SOURCES)] or enclosing or ["(none)"]
    return named[-1][:140]


def launch_sites(kernels, launches, host_ops) -> Counter:
    """(count, GPU us) of a step's kernels by their launching host operator (`named_source`) and kind (memsets,
    memcopies, kernels): where a step's ~1200 launches come from."""
    ops, sites = HostOps(host_ops), Counter()
    for start, end, correlation, name in kernels:
        kind = "memset" if name.startswith("Memset") else "memcpy" if name.startswith("Memcpy") else "kernel"
        source = named_source(ops.enclosing(*launches[correlation])) if correlation in launches else "(no launch)"
        sites[(source, kind, "count")] += 1
        sites[(source, kind, "us")] += end - start
    return sites


def kernel_gaps(kernels, large: float = 20.0, rows: int = 20) -> str:
    """The idle stretches between a step's kernels as the CUDA-only profile gives them (the host unslowed by the
    profiler's operator records), kernels [(start, end, name)] in us: small (< `large` us: the GPU's own time
    between back-to-back kernels) and large ones summed, and the largest with the kernels around them."""
    small, gaps, covered, before = 0.0, [], None, ""
    for start, end, name in sorted(kernels):
        if covered is not None and start > covered:
            if start - covered < large:
                small += start - covered
            else:
                gaps.append((start - covered, before, name))
        if covered is None or end > covered:
            covered, before = end, name
    lines = [f"GPU idle between kernels (CUDA-only profile): {(small + sum(g[0] for g in gaps)) / 1e3:.2f} ms; "
             f"{small / 1e3:.2f} ms in gaps of < {large:g} us, {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} "
             f"of >= {large:g} us; {len(kernels)} kernels", "the largest (us, kernel before -> kernel after):"]
    lines += [f"{gap:9.1f}  {a[:60]} -> {b[:60]}" for gap, a, b in sorted(gaps, reverse=True)[:rows]]
    return "\n".join(lines)


def trace_events(path: str) -> tuple[list, dict, list]:
    """(kernels, launches, host operators) of a Chrome trace that torch.profiler exported, as `idle_gaps` takes them."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels, launches, host_ops = [], {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        category, args = e.get("cat"), e.get("args", {})
        if category in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append((e["ts"], e["ts"] + e["dur"], args.get("correlation"), e.get("name", "")))
        elif category == "cuda_runtime" or category == "cuda_driver":
            launches[args.get("correlation")] = (e["ts"], e["tid"])
            if e["dur"] >= 50:  # a blocking call (a synchronization, an allocation) shows up as a host op of its own
                host_ops.append((e["ts"], e["ts"] + e["dur"], e["tid"], e["name"]))
        elif category in ("cpu_op", "python_function", "user_annotation"):
            host_ops.append((e["ts"], e["ts"] + e["dur"], e["tid"], e["name"]))
    return kernels, launches, host_ops


def gap_report(path: str, min_gap: float = 20.0, rows: int = 40) -> str:
    """The idle time of the traced step and the host operators behind its gaps of at least min_gap us, summed by the
    innermost operator of our code, transformers', Liger's, FlashAttention-4's or torch.optim's (`named_source`), and
    by the outermost; then the step's launches by the same operators (`launch_sites`)."""
    kernels, launches, host_ops = trace_events(path)
    total, gaps = idle_gaps(kernels, launches, host_ops, min_gap=min_gap)
    inner, outer = Counter(), Counter()
    for gap, _, enclosing in gaps:
        inner[named_source(enclosing)] += gap / 1e3
        outer[(enclosing or ["(none)"])[0][:140]] += gap / 1e3
    lines = [f"GPU idle within the step: {total / 1e3:.2f} ms, {sum(g for g, _, _ in gaps) / 1e3:.2f} ms of it in "
             f"{len(gaps)} gaps of >= {min_gap:g} us", "",
             "by the innermost host operator of the launch after it (ms):"]
    lines += [f"{ms:8.3f}  {name}" for name, ms in inner.most_common(rows)]
    lines += ["", "by the outermost host operator (ms):"]
    lines += [f"{ms:8.3f}  {name}" for name, ms in outer.most_common(rows)]
    lines += ["", "the largest gaps (us, launch after the GPU ran dry us, enclosing operators):"]
    for gap, late, enclosing in sorted(gaps, key=lambda g: -g[0])[:rows]:
        lines.append(f"{gap:9.1f} {late:9.1f}  " + " > ".join(name[:60] for name in enclosing[-6:]))
    sites = launch_sites(kernels, launches, host_ops)
    counts = Counter({key[:2]: n for key, n in sites.items() if key[2] == "count"})
    memsets = sum(n for (_, kind), n in counts.items() if kind == "memset")
    lines += ["", f"launches of the step: {sum(counts.values())} ({memsets} memsets), by the launching host operator "
              "(count, kind, GPU ms):"]
    lines += [f"{n:6d}  {kind:6s} {sites[(source, kind, 'us')] / 1e3:8.3f}  {source}"
              for (source, kind), n in counts.most_common(3 * rows)]
    return "\n".join(lines)


# The matrix-product operators a step's products end in (F.linear, torch.matmul and cuBLAS calls reach these), and
# where in their input shapes the two factors are.
MATMUL_FACTORS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::addmm_": (1, 2), "aten::bmm": (0, 1),
                  "aten::baddbmm": (1, 2), "aten::baddbmm_": (1, 2)}


def product_flops(op: str, input_shapes) -> float:
    """FLOPs of one call of a MATMUL_FACTORS operator from its input shapes: 2 x batch x M x K x N."""
    first, second = (input_shapes[i] for i in MATMUL_FACTORS[op])
    *batch, m, k = first
    return 2.0 * math.prod(batch) * m * k * second[-1]


def matmul_table(events, peak: float) -> list[dict]:
    """The step's products by operator and shapes, from `key_averages(group_by_input_shape=True)` of a profile
    with the host's operators (each event: key, input_shapes, count, device_time_total in us): calls, GPU ms,
    TFLOP/s and the ms above what the peak (FLOP/s) would take; most ms lost first."""
    rows = []
    for e in events:
        if e.key not in MATMUL_FACTORS or not e.device_time_total:
            continue
        flops = product_flops(e.key, e.input_shapes) * e.count
        ms = e.device_time_total / 1e3
        rows.append(dict(op=e.key.removeprefix("aten::"), shapes=" x ".join(str(tuple(s)) for s in e.input_shapes
                                                                           if s), calls=e.count, ms=ms,
                         tflops=flops / ms / 1e9, lost_ms=ms - flops / peak * 1e3))
    return sorted(rows, key=lambda row: -row["lost_ms"])


def matmul_report(step, peak: float, rows: int = 30) -> str:
    """`matmul_table` of one run of `step` as text, with the totals."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    table = matmul_table(prof.key_averages(group_by_input_shape=True), peak)
    total_ms, lost = sum(r["ms"] for r in table), sum(r["lost_ms"] for r in table)
    lines = [f"matrix products of the step: {sum(r['calls'] for r in table)} calls, {total_ms:.2f} GPU ms, "
             f"{lost:.2f} ms above the peak of {peak / 1e12:.0f} TFLOP/s", "",
             "| op | shapes | calls | GPU ms | TFLOP/s | ms above the peak |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['shapes']} | {r['calls']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['lost_ms']:.3f} |"
              for r in table[:rows]]
    return "\n".join(lines)


def sync_sites(step, frames: int = 5) -> Counter:
    """The synchronizing calls of one run of `step` on the GPU (torch's sync debug mode: an `.item()`, a copy to the
    host, a data-dependent shape), counted by call site: the innermost `frames` Python frames, innermost first."""
    sites = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        sites[" < ".join(f"{short_path(f.filename)}:{f.lineno}" for f in reversed(stack[-frames:]))] += 1

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return sites


def short_path(filename: str) -> str:
    """A file's path from its package on: site-packages/transformers/x.py -> transformers/x.py."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker)[-1]
    return os.path.relpath(filename) if os.path.isabs(filename) else filename


# How long the GPU sleeps while the host's launches are timed (here, attention_host.py, host_profile.py): about
# 1.5 s of an H100's or H200's clock, longer than a 2K x 4 step's forward or backward takes the host to launch.
SLEEP_CYCLES = 3_000_000_000


def host_times(model, ids, repeats: int = 5) -> dict:
    """Medians over `repeats` of the host's ms to enqueue the decoder stack's forward and its backward, and the GPU's
    ms for each (events recorded after the sleep, so the GPU ran the phase without waiting for the host)."""
    times = {"forward host ms": [], "forward GPU ms": [], "backward host ms": [], "backward GPU ms": []}

    def timed(phase, run):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        result = run()
        times[f"{phase} host ms"].append((time.perf_counter() - began) * 1e3)
        end.record()
        torch.cuda.synchronize()
        times[f"{phase} GPU ms"].append(start.elapsed_time(end))
        return result

    for _ in range(repeats):
        hidden = timed("forward", lambda: model.model(ids).last_hidden_state)
        loss = hidden.float().square().mean()
        timed("backward", loss.backward)
        model.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in times.items()}


def traced_step(step, path: str) -> None:
    """One step under the profiler with the host's operators and Python frames, its Chrome trace gzipped to path
    (torch's export gzips a path ending in .gz)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def profile_model(name: str, seq: int, batch: int, out: str | None, trace: bool = False, syncs: bool = False,
                  host: bool = False, matmuls: bool = False) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    warm_up_gpu(1.0)
    with kernels_patched(name):
        model = build(name, max_positions=seq).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

        def step():
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(2):  # warm-up: Triton compiles, the optimizer state is allocated
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 3
        peak = torch.cuda.max_memory_allocated() / 2**30
        saved, by_shape = saved_activations(model, ids)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # two steps, as bench.py runs them: no wait between
            step()
            step()
            torch.cuda.synchronize()
        if trace:
            trace_path = os.path.join(out, f"trace_{name}_{seq}x{batch}.json.gz")
            traced_step(step, trace_path)
        products = matmul_report(step, matmul_peak()[0]) if matmuls else ""
        sites = sync_sites(step) if syncs else Counter()
        host_row = host_times(model, ids) if host else {}
    # the second step's kernels: the first started on an empty queue (its forward waits for every launch where the
    # host is slower than the GPU), the second behind the first's backward and optimizer, as in a training loop
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = kernel_gaps(kernels[len(kernels) // 2:])
    classes = Counter()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    for e in events:
        classes[kernel_class(e.key)] += e.self_device_time_total / 2e3  # ms a step
    row = dict(model=name, seq=seq, batch=batch, step_ms=wall * 1e3, peak_gib=peak, saved_gib=saved,
               gpu_ms=sum(classes.values()), **{f"{k} ms": v for k, v in classes.items()}, **host_row)
    if syncs:
        row["host syncs"] = sum(sites.values())
    if out:
        with open(os.path.join(out, f"train_{name}_{seq}x{batch}.txt"), "w") as f:
            f.write(f"{row}\n\nkernels by GPU time (ms per step):\n")
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
                ms = e.self_device_time_total / 2e3
                f.write(f"{ms:9.3f} {e.count // 2:6d}  {kernel_class(e.key):18s} {e.key[:110]}\n")
            f.write("\n" + gaps + "\n")
            f.write("\nsaved for the backward (GiB by shape, dtype):\n")
            for (shape, dtype), gib in by_shape.most_common(40):
                f.write(f"{gib:8.3f}  {shape} {dtype}\n")
            if trace:
                f.write("\n" + gap_report(trace_path) + "\n")
            if matmuls:
                f.write("\n" + products + "\n")
            if syncs:
                f.write("\nsynchronizing calls in one step (count, call site innermost first):\n")
                f.writelines(f"{count:4d}  {site}\n" for site, count in sites.most_common())
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["llama-liger", "v1-liger", "v2-liger", "dex-liger"],
                        choices=MODELS)
    parser.add_argument("--out", help="folder for the kernel and activation tables, one file per model")
    parser.add_argument("--trace", action="store_true",
                        help="also the step's trace and where the GPU waits on the host")
    parser.add_argument("--syncs", action="store_true", help="also the calls of a step that wait for the GPU")
    parser.add_argument("--matmuls", action="store_true",
                        help="also the step's matrix products by shapes, against the matmul peak (needs --out)")
    parser.add_argument("--host", action="store_true",
                        help="also the host's and the GPU's ms of the forward and of the backward, apart")
    args = profiling_args(parser, argv, ("seq", "batch"), "profile_train.py")
    for flag in ("trace", "matmuls"):
        if getattr(args, flag) and not args.out:
            parser.error(f"--{flag} needs --out")
    rows = [
        in_fresh_process(profile_model, name, args.seq, args.batch, args.out, args.trace, args.syncs, args.host,
                         args.matmuls)
        for name in tqdm(args.models, desc="models")
    ]
    columns = ["step_ms", "peak_gib", "saved_gib", "gpu_ms", "matmul ms", "attention forward ms",
               "attention backward ms", "other ms"] + (["host syncs"] if args.syncs else [])
    columns += ["forward host ms", "forward GPU ms", "backward host ms", "backward GPU ms"] if args.host else []
    print(f"\n| model ({args.seq} x {args.batch}) | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        cells = (row.get(c, 0.0) for c in columns)
        print(f"| {row['model']} | " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells) + " |")


if __name__ == "__main__":
    main()
