"""The MLP's products with its activation in their epilogue (`kernels/swiglu.py`, `_gate_up_activation` and
`_down_grad_activation`: Triton, autotuned) against cuBLAS's products and the activation's own pass (the path on GPUs
without TMA), at the benchmark's shapes (tokens x hidden 2048 -> intermediate 8192, bf16):

    forward   gate = x W_gate^T, up = x W_up^T, c = silu(gate) up
    backward  dc = dy W_down, then da, db and c again (for down_proj's weight gradient)

Each timed as a CUDA graph (GPU time, no launch overhead), the two paths alternating three times, with the largest
difference between their outputs and the autotuner's pick.

    python benchmarks/swiglu_products_bench.py [--tokens 8192] [--hidden 2048] [--intermediate 8192]
"""

import argparse

import torch
import triton

from modeling_diff.kernels import swiglu


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    T, H, I = args.tokens, args.hidden, args.intermediate
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    rows, grad_rows = torch.randn(T, H, **bf16), torch.randn(T, H, **bf16)
    w_gate, w_up = torch.randn(I, H, **bf16) / H ** 0.5, torch.randn(I, H, **bf16) / H ** 0.5
    w_down = torch.randn(H, I, **bf16) / I ** 0.5
    gate, up, _ = swiglu._gate_up_activation(rows, w_gate, w_up)
    calls = {
        "forward": (lambda: swiglu._gate_up_activation(rows, w_gate, w_up), 2,
                    lambda: (torch.nn.functional.linear(rows, w_gate), torch.nn.functional.linear(rows, w_up))),
        "backward": (lambda: swiglu._down_grad_activation(grad_rows, w_down, gate, up, recompute=True), 1,
                     lambda: grad_rows.mm(w_down)),
    }
    take = swiglu._products_take_the_activation
    print(f"{torch.cuda.get_device_name()}, {T} x {H} -> {I} bf16: GPU us a call (CUDA graph)\n")
    print("| call | cuBLAS's products alone | cuBLAS + the activation pass | products with the activation | "
          "ratio | max abs difference |\n|---|---|---|---|---|---|")
    for name, (call, products, cublas) in calls.items():
        fused_out = call()
        swiglu._products_take_the_activation = lambda *tensors: False
        pass_out = call()
        swiglu._products_take_the_activation = take
        difference = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused_out, pass_out))
        pairs = []
        for _ in range(3):
            swiglu._products_take_the_activation = lambda *tensors: False
            separate = timed(call)
            swiglu._products_take_the_activation = take
            pairs.append((separate, timed(call)))
        alone = timed(cublas)
        separate, fused = (sorted(p)[1] for p in zip(*pairs))  # medians
        print(f"| {name} | {alone:.1f} ({2 * T * H * I * products / alone / 1e6:.0f} TFLOP/s) | {separate:.1f} | "
              f"{fused:.1f} ({2 * T * H * I * products / fused / 1e6:.0f} TFLOP/s) | {separate / fused:.2f}x | "
              f"{difference:.3g} |", flush=True)
        print("    pairs (pass / epilogue): " + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in pairs))
    for name, kernel in (("forward", swiglu._GATE_UP_SWIGLU), ("backward", swiglu._DOWN_GRAD_SWIGLU)):
        print(f"{name} pick: {getattr(kernel, 'best_config', None)}")


if __name__ == "__main__":
    main()
