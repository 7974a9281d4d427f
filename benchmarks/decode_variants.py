"""The graph-replayed StaticCache step with each of the decoding step's launch choices turned off alone, in one
process:

- `pdl`: programmatic dependent launch (`kernels/_triton.PDL_ENABLED`);
- `split`: o_proj / down_proj split along their input (`kernels/projection.split_linear`; off: cuBLAS and the
  residual add, as before it);
- `cache_write`: the StaticCache write in one launch, in the projections' launch where they split
  (`kernels/cache_write.py`; off: transformers' `Cache.update`);
- `projection_write`: the StaticCache write in the projections' launch (off: in a launch of its own);
- `rotated`: q, k, v split along their input, summed and rotated in one pass (`kernels/projection.rotated_projections`;
  off: one launch for the products, then the RoPE kernel);
- `rotary`: the step's cos and sin in one launch (`kernels/rope.rope_cos_sin`; off: transformers' rotary embedding);
- `deferred_add`: the MLP's residual add in the next norm's pass where down_proj runs on cuBLAS (more than
  `projection.SPLIT_MAX_TOKENS` tokens; `modeling_diff_llama.defers_residual_adds`; off: a launch of its own).
- `greedy`: the step's argmax in one launch (`kernels/greedy.greedy_tokens`; off: torch.argmax).
- `step_mask`: a StaticCache step's mask in one launch (`kernels/masks.static_step_mask`; off: transformers'
  `create_causal_mask`).

    python benchmarks/decode_variants.py [--seq 2048] [--batch 1 32] [--models v1 v2 dex] [--out $OUT/variants.json]
    python benchmarks/decode_variants.py --variants default --partial 128,4,3,2 64,4,3,4   # the decode kernel's launch

`--partial BLOCK_N,WARPS,STAGES,PROGRAMS_PER_SM ...` adds a variant per launch configuration of the split-KV decode
kernel (`kernels/triton_decode.py`; its default is 64,4,3,2, with 4 stages and 3 programs a multiprocessor in steps of
at most 16 tokens, and 128 keys a tile at 3 stages there for V1's 2d-wide values; BLOCK_N sets both widths, STAGES
every step's).
`--constants MODULE.NAME=VALUE[+MODULE.NAME=VALUE...] ...` adds one per set of the kernels' launch rules, MODULE one of
`_triton`, `projection`, `triton_decode` (e.g. `projection.SPLIT_MAX_TOKENS=32+_triton.DECODE_PDL_MAX_TOKENS=32`:
the split products, and the decode kernel's few-token launch with PDL, at batch 32).
`--gated BLOCK_N,BLOCK_K,WARPS,STAGES ...` adds one per launch configuration of the MLP's gate and up
(`kernels/projection.py`'s GATED_FEW_TOKENS / GATED_MORE_TOKENS, both set); `--split BLOCK_N,STEP,PARTS ...` one per
launch configuration of the products split along K (SPLIT_FEW_TOKENS / SPLIT_MORE_TOKENS, both set: q, k, v,
o_proj and down_proj). `--pdl-more-tokens KERNELS[+KERNELS...] ...` adds one per set of kernels launched with PDL in
steps of more than their rule's tokens too (`_triton.DECODE_PDL_MAX_TOKENS` for decode, `PDL_MAX_TOKENS` for the
others; KERNELS one of decode, norm, projection; e.g. `decode+norm`).

Prints the step (ms) and its share of the roofline (bench.py's definition, the bandwidth measured in the same run) per
model, batch and variant; the variants alternate within each model and batch, `--rounds` times (median).
"""

import argparse
import ast
import contextlib
import json

import torch
from tqdm import tqdm

import bench
import modeling_diff.diff_attention as attention
import modeling_diff.modeling_diff_llama as modeling
from bench import (
    MODELS, bench_static_decode, build, copy_bandwidth, decode_work, kernels_patched, warm_up_gpu, write_atomically,
)
from modeling_diff.kernels import _triton, cache_write, projection, rmsnorm, rope, triton_decode


def _no_split(*args):  # a dispatch predicate that declines
    return False


def _cache_update(cache, layer_idx, key, value):
    return cache.update(key, value, layer_idx)


def _nothing(*args):  # a lookup that finds nothing: no StaticCache layer to write into, no mask made
    return None


def _torch_argmax(scores, out, owner):
    return torch.argmax(scores, -1, out=out)


# feature -> the (object, attribute, value) that turn it off
FEATURES = {
    "pdl": [(_triton, "PDL_ENABLED", False)],
    "split": [(attention, "split_linear_applies", _no_split), (modeling, "split_linear_applies", _no_split)],
    "cache_write": [(attention, "update_cache", _cache_update), (attention, "projection_cache_layer", _nothing)],
    "projection_write": [(attention, "projection_cache_layer", _nothing)],
    "rotated": [(attention, "rotated_projections_apply", _no_split)],
    "rotary": [(modeling, "rope_cos_sin_applies", _no_split)],
    "deferred_add": [(modeling, "defers_residual_adds", _no_split)],
    "greedy": [(bench, "greedy_tokens", _torch_argmax)],
    "step_mask": [(modeling, "static_step_mask", _nothing)],
}
VARIANTS = ["default", *FEATURES]


# --partial's fields -> the constants each sets (STAGES: at every token count)
PARTIAL_CONSTANTS = (
    ("PARTIAL_BLOCK_N", "PARTIAL_BLOCK_N_WIDE_FEW_TOKENS"), ("PARTIAL_NUM_WARPS",),
    ("PARTIAL_NUM_STAGES", "PARTIAL_NUM_STAGES_FEW_TOKENS", "PARTIAL_NUM_STAGES_WIDE_FEW_TOKENS"),
    ("PROGRAMS_PER_SM", "PROGRAMS_PER_SM_FEW_TOKENS"),
)


def launch_values(option: str, config: str, fields: int) -> list[int]:
    values = [int(v) for v in config.split(",")]
    if len(values) != fields or min(values) < 1:
        raise SystemExit(f"{option} takes {fields} comma-separated positive ints, got {config!r}")
    return values


def partial_variant(config: str) -> str:
    """A `--partial` configuration as a variant: its changes registered in FEATURES under 'partial=...'."""
    values = launch_values("--partial", config, len(PARTIAL_CONSTANTS))
    name = f"partial={config}"
    FEATURES[name] = [
        (triton_decode, constant, value)
        for constants, value in zip(PARTIAL_CONSTANTS, values) for constant in constants
    ]
    return name


def gated_variant(config: str) -> str:
    """A `--gated` configuration (rows a program, K step, warps, most stages of the MLP's gate and up launch, at
    every token count) as a variant registered in FEATURES under 'gated=...'."""
    values = tuple(launch_values("--gated", config, 4))
    name = f"gated={config}"
    FEATURES[name] = [(projection, "GATED_FEW_TOKENS", values), (projection, "GATED_MORE_TOKENS", values)]
    return name


def split_variant(config: str) -> str:
    """A `--split` configuration (rows a program, most K step, most parts of K of the split products: q, k, v,
    o_proj, down_proj; at every token count) as a variant registered in FEATURES under 'split=...'."""
    values = tuple(launch_values("--split", config, 3))
    name = f"split={config}"
    FEATURES[name] = [(projection, "SPLIT_FEW_TOKENS", values), (projection, "SPLIT_MORE_TOKENS", values)]
    return name


CONSTANT_MODULES = {"_triton": _triton, "projection": projection, "triton_decode": triton_decode}
# --pdl-more-tokens's kernels -> the modules whose launches they are (each imports `dependent_launch` by name)
PDL_KERNELS = {"decode": (triton_decode,), "norm": (rmsnorm, rope), "projection": (projection, cache_write)}


def _dependent_launch_at_any_tokens(tensor, tokens, most=None):
    return _triton.dependent_launch(tensor, 1)


def pdl_variant(config: str) -> str:
    """A `--pdl-more-tokens` set (kernel groups of PDL_KERNELS joined by '+') as a variant registered in FEATURES
    under 'pdl-more-tokens=...': those kernels launch with PDL whatever the step's tokens."""
    names = config.split("+")
    unknown = [name for name in names if name not in PDL_KERNELS]
    if unknown:
        raise SystemExit(f"--pdl-more-tokens: {', '.join(unknown)} not among {', '.join(PDL_KERNELS)}")
    name = f"pdl-more-tokens={config}"
    FEATURES[name] = [(module, "dependent_launch", _dependent_launch_at_any_tokens)
                      for group in names for module in PDL_KERNELS[group]]
    return name


def constants_variant(config: str) -> str:
    """A `--constants` set (MODULE.NAME=VALUE joined by '+', VALUE a Python literal of the constant's type) as a
    variant registered in FEATURES under 'constants=...'."""
    changes = []
    for item in config.split("+"):
        target, _, text = item.partition("=")
        module_name, _, constant = target.partition(".")
        module = CONSTANT_MODULES.get(module_name)
        if module is None or not constant.isupper() or not hasattr(module, constant):
            raise SystemExit(f"--constants: {target!r} is not MODULE.NAME of an upper-case constant, MODULE one of "
                             f"{', '.join(CONSTANT_MODULES)}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--constants: {target}'s value {text!r} is not a Python literal") from None
        current = getattr(module, constant)
        if type(value) is not type(current):
            raise SystemExit(f"--constants: {target} takes a value of type {type(current).__name__}, got {text!r}")
        changes.append((module, constant, value))
    name = f"constants={config}"
    FEATURES[name] = changes
    return name


def label(variant: str) -> str:
    return variant if variant == "default" or "=" in variant else f"{variant} off"


@contextlib.contextmanager
def switched(variant: str):
    """The default step, with `variant`'s feature turned off (or its decode-kernel launch configuration)."""
    changes = FEATURES.get(variant, [])
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--models", nargs="+", default=["v1", "v2", "dex"], choices=MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--partial", nargs="*", default=[], metavar="BLOCK_N,WARPS,STAGES,PROGRAMS_PER_SM")
    parser.add_argument("--constants", nargs="*", default=[], metavar="MODULE.NAME=VALUE[+...]")
    parser.add_argument("--gated", nargs="*", default=[], metavar="BLOCK_N,BLOCK_K,WARPS,STAGES")
    parser.add_argument("--split", nargs="*", default=[], metavar="BLOCK_N,STEP,PARTS")
    parser.add_argument("--pdl-more-tokens", nargs="*", default=[], metavar="KERNELS[+KERNELS...]")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.variants += [partial_variant(config) for config in args.partial]
    args.variants += [constants_variant(config) for config in args.constants]
    args.variants += [gated_variant(config) for config in args.gated]
    args.variants += [split_variant(config) for config in args.split]
    args.variants += [pdl_variant(config) for config in args.pdl_more_tokens]
    warm_up_gpu()
    bandwidth = copy_bandwidth()
    rows = []
    print("| model | batch | variant | step ms (range) | share |\n|---|---|---|---|---|")
    for name in args.models:
        with kernels_patched(name):
            model = build(name, max_positions=args.seq + args.steps + 16)
            for batch in args.batch:
                floor = decode_work(name, model, batch, args.seq, args.steps) * batch / bandwidth  # seconds a step
                times = {v: [] for v in args.variants}
                for _ in tqdm(range(args.rounds), desc=f"{name} b{batch}", leave=False):
                    for v in args.variants:
                        with switched(v):
                            times[v].append(batch / bench_static_decode(model, batch, args.seq, args.steps, 4096))
                for v, ts in times.items():
                    ts.sort()
                    step = ts[len(ts) // 2]
                    rows.append(dict(model=name, batch=batch, seq=args.seq, variant=label(v), step_ms=step * 1e3,
                                     steps_ms=[t * 1e3 for t in ts], floor_ms=floor * 1e3, share=floor / step))
                    print(f"| {name} | {batch} | {label(v)} | {step * 1e3:.3f} ({ts[0] * 1e3:.3f}-"
                          f"{ts[-1] * 1e3:.3f}) | {floor / step:.2f} |")
            del model
            torch.cuda.empty_cache()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if args.out:
        write_atomically(args.out, json.dumps(dict(bandwidth=bandwidth, rows=rows), indent=1))


if __name__ == "__main__":
    main()
