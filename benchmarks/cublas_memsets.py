"""Which matrix products of a training step get a memset from cuBLAS before their kernel, per BLAS library.

    python benchmarks/cublas_memsets.py

A 2K x 4 training step launches 258-314 memsets (`profile_train.py --trace`), each inside `aten::mm` before its
kernel: a launch boundary of a few us each. This times each product of the MLP at the ~1.1B benchmark's shapes
(8192 tokens, hidden 2048, MLP 8192) with torch's default BLAS library and with cuBLASLt
(`torch.backends.cuda.preferred_blas_library`), and counts the memsets and names the kernel of one call of each
(torch.profiler), to see whether another library or layout would launch the products without them.
"""

import torch
import triton
from torch.profiler import ProfilerActivity, profile

TOKENS, HIDDEN, MLP = 8192, 2048, 8192


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, grad_out, total = (torch.randn(TOKENS, HIDDEN, **bf16) for _ in range(3))
    w_gate, w_down = torch.randn(MLP, HIDDEN, **bf16), torch.randn(HIDDEN, MLP, **bf16)
    product, grad_gate = torch.randn(TOKENS, MLP, **bf16), torch.randn(TOKENS, MLP, **bf16)
    products = {  # the MLP's forward and backward products (kernels/swiglu.py), by what they compute
        "gate = x W_gate^T": lambda: x.mm(w_gate.t()),
        "down_proj's input gradient": lambda: grad_out.mm(w_down),
        "down_proj's weight gradient": lambda: grad_out.t().mm(product),
        "x's gradient from gate": lambda: grad_gate.mm(w_gate),
        "x's gradient from up, added": lambda: total.addmm_(grad_gate, w_gate),
        "gate's weight gradient": lambda: grad_gate.t().mm(x),
    }
    print("| library | product | us | memsets a call | kernel |\n|---|---|---|---|---|")
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for name, run in products.items():
            run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
            kernels = [n for n in names if not n.startswith("Memset")]
            us = triton.testing.do_bench(run, warmup=20, rep=200) * 1e3
            kernel = kernels[0][:60] if kernels else ""
            print(f"| {library} | {name} | {us:.1f} | {len(names) - len(kernels)} | {kernel} |", flush=True)


if __name__ == "__main__":
    main()
