"""How far V1's lambda gradient in bfloat16 lies from float32 (float64 on a CPU), eager and fast path alike.

    python benchmarks/lambda_grad_precision.py            # on the GPU: fast = the default path (flash-diff)
    python benchmarks/lambda_grad_precision.py --hook     # lambda's output changed by a forward hook, 1.5 x + 0.05

Two layers of the ~1.1B V1 model (the GPU shapes of tests/test_kernels.py), one training step on random ids.
At initialisation the two maps of a differential head are nearly equal, so A1 V - lambda A2 V is nearly
(1 - lambda) A2 V, which subln's RMSNorm divides away: the gradient of lambda, -sum(dx . A2 V) with dx orthogonal
to that row, is a small difference of large terms. In bfloat16 it is then far from the float32 value, and two
bfloat16 paths (eager's maps, SDPA, the flash-diff kernel) far from each other. Prints, for each length and path,
the relative error of lambda_q1's gradient per layer against the reference, and the ratio of first elements.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_model  # noqa: E402

from modeling_diff import preset_config  # noqa: E402


def lambda_grads(base, ids, dtype, implementation, hook) -> list[torch.Tensor]:
    model = tiny_model("v1", attn_implementation=implementation, **shape())
    model.load_state_dict(base.state_dict())
    model = model.to(ids.device, dtype)
    if hook:
        for layer in model.model.layers:
            layer.self_attn.diff_lambda.register_forward_hook(lambda module, args, out: out * 1.5 + 0.05)
    model.train()(ids, labels=ids).loss.backward()
    return [layer.self_attn.diff_lambda.lambda_q1.grad.double() for layer in model.model.layers]


def shape(mode: str = "v1") -> dict:
    """The config fields of two layers of the ~1.1B `mode` model (tests/test_kernels.py's GPU shapes)."""
    fields = dict(preset_config(f"1.1b-{mode}").to_diff_dict(), num_hidden_layers=2, vocab_size=1000)
    return {k: v for k, v in fields.items() if k not in ("model_type", "transformers_version")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", action="store_true", help="lambda's output changed by a forward hook")
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 256])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference_dtype = torch.float32 if device == "cuda" else torch.float64
    paths = [("eager", torch.bfloat16), ("sdpa", torch.bfloat16), ("sdpa", reference_dtype)]
    print(f"| length | path | dtype | rel. error per layer vs eager {reference_dtype} | ratio of first elements |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        torch.manual_seed(0)
        base = tiny_model("v1", **shape())
        ids = torch.randint(3, 1000, (2, length), device=device)
        reference = lambda_grads(base, ids, reference_dtype, "eager", args.hook)
        for implementation, dtype in paths:
            grads = lambda_grads(base, ids, dtype, implementation, args.hook)
            errors = [round(((g - r).norm() / r.norm()).item(), 4) for g, r in zip(grads, reference)]
            ratios = [round((g[0] / r[0]).item(), 3) for g, r in zip(grads, reference)]
            print(f"| {length} | {implementation} | {str(dtype).removeprefix('torch.')} | {errors} | {ratios} |")


if __name__ == "__main__":
    main()
