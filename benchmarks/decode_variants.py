"""The graph-replayed StaticCache step with each of the decoding step's launch choices on and off, in one process:
programmatic dependent launch (`kernels/_triton.PDL_ENABLED`) and o_proj / down_proj split along their input
(`kernels/projection.split_linear`; off: cuBLAS and the residual add, as before it).

    python benchmarks/decode_variants.py [--seq 2048] [--batch 1 32] [--models v1 v2 dex] [--out $OUT/variants.json]

Prints the step (ms) and its share of the roofline (bench.py's definition, the bandwidth measured in the same run) per
model, batch and variant; the variants alternate within each model and batch, `--rounds` times (median).
"""

import argparse
import contextlib
import json

import torch
from tqdm import tqdm

import modeling_diff.diff_attention as attention
import modeling_diff.modeling_diff_llama as modeling
from bench import (
    MODELS, bench_static_decode, build, copy_bandwidth, decode_work, kernels_patched, warm_up_gpu, write_atomically,
)
from modeling_diff.kernels import _triton

VARIANTS = [(pdl, split) for pdl in (True, False) for split in (True, False)]


@contextlib.contextmanager
def variant(pdl: bool, split: bool):
    saved = _triton.PDL_ENABLED, attention.split_linear_applies, modeling.split_linear_applies
    _triton.PDL_ENABLED = pdl
    if not split:
        attention.split_linear_applies = modeling.split_linear_applies = lambda *args: False
    try:
        yield
    finally:
        _triton.PDL_ENABLED, attention.split_linear_applies, modeling.split_linear_applies = saved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--models", nargs="+", default=["v1", "v2", "dex"], choices=MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    warm_up_gpu()
    bandwidth = copy_bandwidth()
    rows = []
    print("| model | batch | PDL | split o_proj, down_proj | step ms (range) | share |\n|---|---|---|---|---|---|")
    for name in args.models:
        with kernels_patched(name):
            model = build(name, max_positions=args.seq + args.steps + 16).eval()
            for batch in args.batch:
                floor = decode_work(name, model, batch, args.seq, args.steps) * batch / bandwidth  # seconds a step
                times = {v: [] for v in VARIANTS}
                for _ in tqdm(range(args.rounds), desc=f"{name} b{batch}", leave=False):
                    for v in VARIANTS:
                        with variant(*v):
                            times[v].append(batch / bench_static_decode(model, batch, args.seq, args.steps, 4096))
                for (pdl, split), ts in times.items():
                    ts.sort()
                    step = ts[len(ts) // 2]
                    rows.append(dict(model=name, batch=batch, seq=args.seq, pdl=pdl, split=split, step_ms=step * 1e3,
                                     steps_ms=[t * 1e3 for t in ts], floor_ms=floor * 1e3, share=floor / step))
                    print(f"| {name} | {batch} | {pdl} | {split} | {step * 1e3:.3f} ({ts[0] * 1e3:.3f}-"
                          f"{ts[-1] * 1e3:.3f}) | {floor / step:.2f} |")
            del model
            torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.out:
        write_atomically(args.out, json.dumps(dict(bandwidth=bandwidth, rows=rows), indent=1))


if __name__ == "__main__":
    main()
