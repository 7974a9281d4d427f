"""Where a training step spends its GPU time and its activation memory, per model, on one GPU.

    python benchmarks/profile_train.py --seq 2048 --batch 4 --models llama-liger v1-liger --out $OUT/train_profile

For each model of bench.py (each in a fresh process: Liger's patches are process-wide) this runs forward +
backward + fused AdamW as bench.py's training rows do and prints: the step's wall time, the peak memory, the
bytes the forward saves for the backward (every distinct storage that autograd keeps, through
`torch.autograd.graph.saved_tensors_hooks`), and the GPU time per kernel class (matmuls, attention forward,
attention backward, everything else). With --out, one file per model with the profiler's kernel table and the
saved activations by shape (which tensors a model keeps that another does not).
"""

import argparse
import os
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from bench import MODELS, build, in_fresh_process, kernels_patched, profiling_args, warm_up_gpu


def kernel_class(name: str) -> str:
    """A kernel's class from its name (cuBLAS / CUTLASS matmuls, attention forward and backward, the rest)."""
    lowered = name.lower()
    if any(word in lowered for word in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "matmul"
    if any(word in lowered for word in ("flash_diff_bwd", "flash_bwd", "attention_backward", "bwd_kernel", "dkdv",
                                        "_dq")):
        return "attention backward"
    if any(word in lowered for word in ("flash_diff_fwd", "flash_fwd", "fmha", "attention", "sdpa")):
        return "attention forward"
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


def profile_model(name: str, seq: int, batch: int, out: str | None) -> dict:
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
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    classes = Counter()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    for e in events:
        classes[kernel_class(e.key)] += e.self_device_time_total / 1e3
    row = dict(model=name, seq=seq, batch=batch, step_ms=wall * 1e3, peak_gib=peak, saved_gib=saved,
               gpu_ms=sum(classes.values()), **{f"{k} ms": v for k, v in classes.items()})
    if out:
        with open(os.path.join(out, f"train_{name}_{seq}x{batch}.txt"), "w") as f:
            f.write(f"{row}\n\nkernels by GPU time (ms per step):\n")
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:40]:
                ms = e.self_device_time_total / 1e3
                f.write(f"{ms:9.3f} {e.count:6d}  {kernel_class(e.key):18s} {e.key[:110]}\n")
            f.write("\nsaved for the backward (GiB by shape, dtype):\n")
            for (shape, dtype), gib in by_shape.most_common(40):
                f.write(f"{gib:8.3f}  {shape} {dtype}\n")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["llama-liger", "v1-liger", "v2-liger", "dex-liger"],
                        choices=MODELS)
    parser.add_argument("--out", help="folder for the kernel and activation tables, one file per model")
    args = profiling_args(parser, argv, ("seq", "batch"), "profile_train.py")
    rows = [in_fresh_process(profile_model, name, args.seq, args.batch, args.out)
            for name in tqdm(args.models, desc="models")]
    columns = ["step_ms", "peak_gib", "saved_gib", "gpu_ms", "matmul ms", "attention forward ms",
               "attention backward ms", "other ms"]
    print(f"\n| model ({args.seq} x {args.batch}) | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['model']} | " + " | ".join(f"{row.get(c, 0.0):.2f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
