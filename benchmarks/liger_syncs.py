"""What Liger's host synchronizations cost a training step: each model's step as bench.py times it, then without them.

    python benchmarks/liger_syncs.py --seq 2048 --batch 4 --models llama-liger v1-liger v2-liger

Liger's fused linear cross-entropy (liger-kernel 0.8.5) waits for the GPU three times a step: the count of tokens
that are not ignored (`target_mask.sum().item()`, in its forward) and a comparison of the loss's gradient with 1
(`torch.equal`, two waits, in its backward). After each, the GPU runs dry until the host has launched the work
after it. Here every model's step is timed twice, each in a fresh process: as it is, and with those three lines
replaced in Liger's source (the count taken as the number of targets, the comparison as false). Timing only: the
second step's loss is scaled wrongly where some targets are ignored. Prints tok/s of both and their ratio.
"""

import argparse
import contextlib
import inspect
import json
import os

from tqdm import tqdm

from bench import MODELS, bench_train, build, in_fresh_process, profiling_args, warm_up_gpu, write_atomically

# Liger's synchronizing lines and what stands for them in the timed variant
SYNCS = {
    "target_mask.sum().item()": "target.numel()",
    "not torch.equal(grad_output, torch.tensor(1.0, device=grad_output.device))": "False",
}


@contextlib.contextmanager
def without_syncs():
    """Liger's fused linear cross-entropy forward and backward, redefined in their module without the SYNCS while
    the block runs; the originals are put back after it."""
    import liger_kernel.ops.fused_linear_cross_entropy as module

    names = ("fused_linear_cross_entropy_forward", "fused_linear_cross_entropy_backward")
    originals = {name: getattr(module, name) for name in names}
    sources = {name: inspect.getsource(originals[name]) for name in names}
    for line, stand_in in SYNCS.items():
        found = [name for name in names if line in sources[name]]
        if not found:
            raise RuntimeError(f"Liger's synchronizing line {line!r} not found (another liger-kernel version?)")
        for name in found:
            sources[name] = sources[name].replace(line, stand_in)
    replaced = {}
    for name in names:
        namespace = dict(module.__dict__)
        exec(compile(sources[name], module.__file__, "exec"), namespace)
        replaced[name] = namespace[name]
    module.__dict__.update(replaced)
    try:
        yield
    finally:
        module.__dict__.update(originals)


def train_rate(name: str, seq: int, batch: int, repeats: int, synced: bool) -> float:
    warm_up_gpu(2.0)
    with contextlib.nullcontext() if synced else without_syncs():
        return bench_train(build(name, max(seq, 4096)), batch, seq, repeats)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", nargs="+", default=["llama-liger", "v1-liger", "v2-liger"],
                        choices=[m for m in MODELS if m.endswith("-liger")])
    parser.add_argument("--out", help="folder for the rows (syncs.json)")
    args = profiling_args(parser, argv, ("seq", "batch", "repeats"), "liger_syncs.py")
    rows = []
    for name in tqdm(args.models, desc="models"):
        synced, unsynced = (in_fresh_process(train_rate, name, args.seq, args.batch, args.repeats, s)
                            for s in (True, False))
        rows.append(dict(model=name, seq=args.seq, batch=args.batch, tok_s=synced, tok_s_without_syncs=unsynced))
    print(f"\n| model ({args.seq} x {args.batch}) | tok/s | without Liger's syncs | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        ratio = row["tok_s_without_syncs"] / row["tok_s"]
        print(f"| {row['model']} | {row['tok_s'] / 1e3:.1f}k | {row['tok_s_without_syncs'] / 1e3:.1f}k | {ratio:.3f} |")
    if args.out:
        write_atomically(os.path.join(args.out, "syncs.json"), json.dumps(rows, indent=1))
    print(f"{len(rows)} models timed with and without Liger's synchronizations.")


if __name__ == "__main__":
    main()
