"""The training MLP's node on quack's GEMMs (activation in their epilogues, `modeling_diff/kernels/quack_mlp.py`)
against the project's node (cuBLAS products and the activation's own passes, `kernels/swiglu.py`) and against the
node's cuBLAS products alone (the floor with no activation pass): forward + backward of one ~1.1B MLP layer.

    python3 benchmarks/quack_mlp_bench.py [--tokens 8192] [--hidden 2048] [--intermediate 8192] [--tuned]

Prints ms per forward + backward (median of --repeats rounds of 10 after warm-up), the peak memory above the inputs,
the first call's seconds (quack compiles its kernels then; and again at another token count?), and each node's
largest relative error against the float32 arithmetic of LlamaMLP on the same bf16 inputs (out and
the four gradients). Needs a Hopper GPU and quack-kernels (carried to the GPU machine with flash-attn-4).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from modeling_diff.kernels import quack_mlp, swiglu


def products_only(x, w_gate, w_up, w_down, grad_out):
    """The node's products on cuBLAS with no activation pass: c = gate(x) stands in for silu(gate(x)) * up(x)."""
    rows = x.reshape(-1, x.shape[-1])
    gate, up = F.linear(rows, w_gate), F.linear(rows, w_up)
    F.linear(gate, w_down)
    grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
    dc = grad_rows.mm(w_down)
    grad_rows.t().mm(up)
    dc.mm(w_gate).addmm_(gate, w_up)
    dc.t().mm(rows), gate.t().mm(rows)


def reference(x, w_gate, w_up, w_down, grad_out):
    """LlamaMLP's arithmetic in float32 on the same inputs: (out, dx, dW_gate, dW_up, dW_down)."""
    leaves = [t.detach().float().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    x32, g32, u32, d32 = leaves
    out = F.linear(F.silu(F.linear(x32, g32)) * F.linear(x32, u32), d32)
    out.backward(grad_out.float())
    return [out.detach()] + [t.grad for t in leaves]


def run(node, x, w_gate, w_up, w_down, grad_out):
    leaves = [t.detach().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    out = node(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def timed(fn, repeats):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 10)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tuned", action="store_true", help="quack's autotuned configurations (compiles several)")
    args = parser.parse_args()
    quack_mlp.TUNED = args.tuned
    quack_mlp.ENABLED = True  # measured here whatever MODELING_DIFF_QUACK says
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, **bf16)
    w_gate, w_up = (torch.randn(args.intermediate, args.hidden, **bf16) * args.hidden**-0.5 for _ in range(2))
    w_down = torch.randn(args.hidden, args.intermediate, **bf16) * args.intermediate**-0.5
    grad_out = torch.randn(args.tokens, args.hidden, **bf16)
    inputs = (x, w_gate, w_up, w_down, grad_out)
    assert quack_mlp.quack_mlp_runs_on(x, w_gate, w_up, w_down), "quack's kernels do not run here"
    expected = reference(*inputs)
    nodes = {
        "project (cuBLAS + activation passes)": lambda *t: swiglu._SwiGLUMLP.apply(*t),
        "quack (activation in the epilogues)": quack_mlp.quack_swiglu_mlp,
    }
    names = ["out", "dx", "dW_gate", "dW_up", "dW_down"]
    rows = []
    for label, node in tqdm(nodes.items(), desc="nodes"):
        start = time.perf_counter()
        got = run(node, *inputs)
        first = time.perf_counter() - start
        errors = {n: ((g.float() - e).abs().max() / e.abs().max()).item() for n, g, e in zip(names, got, expected)}
        del got
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(lambda: run(node, *inputs), args.repeats) * 1e3
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append((label, ms, peak, first, errors))
    floor = timed(lambda: products_only(*inputs), args.repeats) * 1e3
    # another token count (a batch of other lengths): whether quack compiles its kernels again for it
    shorter = args.tokens - 3 * 128
    start = time.perf_counter()
    run(quack_mlp.quack_swiglu_mlp, x[:shorter], w_gate, w_up, w_down, grad_out[:shorter])
    torch.cuda.synchronize()
    other_length = time.perf_counter() - start
    flops = 2 * args.tokens * args.hidden * args.intermediate * 9  # 3 products forward, 6 backward
    print(f"\nMLP forward + backward, {args.tokens} tokens, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"bf16, quack {'tuned' if args.tuned else 'default configurations'}; {torch.cuda.get_device_name()}")
    print("| node | ms | TFLOP/s of the products | vs the project's | peak MiB | first call s | "
          + " | ".join(f"max rel. error {n}" for n in names) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(names))
    for label, ms, peak, first, errors in rows:
        print(f"| {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {rows[0][1] / ms:.3f}x | {peak:.0f} | {first:.1f} | "
              + " | ".join(f"{errors[n]:.2e}" for n in names) + " |")
    print(f"| cuBLAS products alone (no activation) | {floor:.3f} | {flops / floor / 1e9:.0f} | "
          f"{rows[0][1] / floor:.3f}x | | | " + " | ".join("" for _ in names) + " |")
    print(f"quack's first call at {shorter} tokens, after its calls at {args.tokens}: {other_length:.2f} s")


if __name__ == "__main__":
    main()
