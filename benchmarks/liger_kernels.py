"""Liger's kernels against the project's own and PyTorch's, one operation at a time, at the ~1.1B model's shapes.

    python benchmarks/liger_kernels.py [--tokens 8192] [--ops rmsnorm rope swiglu mlp loss] [--chunk-budgets 1 4]

bf16 on one GPU, forward and forward + backward (median ms, `triton.testing.do_bench`), for the operations that
`apply_liger_kernel_to_diff_llama` can take over:
- RMSNorm over hidden 2048: transformers' LlamaRMSNorm (eager), modeling_diff's kernel (`kernels/rmsnorm.py`),
  Liger's `LigerRMSNorm` (Llama casting, in place);
- RoPE of queries and keys (head_dim 64): transformers' `apply_rotary_pos_emb`, modeling_diff's one-launch kernel
  (`kernels/rope.py`), Liger's `liger_rope`, for V1 / Llama's 32 query heads and V2's 64, over 8 kv heads;
- SwiGLU's silu(gate) * up at MLP 8192: PyTorch eager and Liger's kernel;
- the whole MLP (hidden 2048, MLP 8192): transformers' LlamaMLP, Liger's `LigerSwiGLUMLP` and modeling_diff's
  `DiffLlamaMLP` (`kernels/swiglu.py`: the activation computed again in the backward instead of kept), with the
  peak memory of each;
- lm_head + cross-entropy over vocab 32000: transformers' loss on materialised logits, Liger's fused linear
  cross-entropy at each `--chunk-budgets` value (its `chunk_mem_const`; `modeling_diff.liger` picks one per call)
  and lm_head's product alone (the floor of any fused loss), with the peak memory of each.
"""

import argparse
import functools
import sys

import torch
import torch.nn.functional as F
import triton
from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy, liger_rope, liger_swiglu
from liger_kernel.transformers.rms_norm import LigerRMSNorm
from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from modeling_diff import DiffLlamaConfig
from modeling_diff.kernels import apply_rope, rms_norm
from modeling_diff.modeling_diff_llama import DiffLlamaMLP

HIDDEN, HEAD_DIM, KV_HEADS, MLP, VOCAB = 2048, 64, 8, 8192, 32000


def timed(fn, inputs, backward: bool) -> float:
    """Median ms of fn(*inputs) (and of its backward from a fixed random gradient)."""
    if not backward:
        with torch.no_grad():
            return triton.testing.do_bench(lambda: fn(*inputs), return_mode="median")
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(o) for o in outputs]

    def step():
        outs = fn(*inputs)
        torch.autograd.backward(outs if isinstance(outs, tuple) else (outs,), [g.clone() for g in grads])

    return triton.testing.do_bench(step, grad_to_none=inputs, return_mode="median")


def rms_norm_rows(tokens: int) -> list[tuple]:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    llama = LlamaRMSNorm(HIDDEN, eps=1e-5).cuda().to(torch.bfloat16)
    liger = LigerRMSNorm(HIDDEN, eps=1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        llama.weight.normal_(1.0, 0.1)
        liger.weight.copy_(llama.weight)
    own = lambda x: rms_norm(x, llama.weight, llama.variance_epsilon)  # noqa: E731
    return [("rmsnorm", f"{tokens} x {HIDDEN}", name, fn, (x,)) for name, fn in
            (("transformers", llama), ("modeling_diff", own), ("liger", liger))]


def rope_rows(tokens: int) -> list[tuple]:
    rows = []
    for q_heads in (32, 64):
        q = torch.randn(1, tokens, q_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        angle = torch.randn(1, tokens, HEAD_DIM // 2, device="cuda").repeat(1, 1, 2)
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        # (B, L, H, d) as the attention holds them; transformers and Liger take (B, H, L, d) views of the same
        reference = lambda q, k: apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # noqa: E731
        own = lambda q, k: apply_rope(q, k, cos, sin, True)  # noqa: E731
        liger = lambda q, k: liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # noqa: E731
        shape = f"{tokens} x ({q_heads} + {KV_HEADS}) x {HEAD_DIM}"
        rows += [("rope", shape, name, fn, (q, k)) for name, fn in
                 (("transformers", reference), ("modeling_diff", own), ("liger", liger))]
    return rows


def swiglu_rows(tokens: int) -> list[tuple]:
    gate, up = (torch.randn(tokens, MLP, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    eager = lambda a, b: F.silu(a) * b  # noqa: E731
    return [("swiglu", f"{tokens} x {MLP}", name, fn, (gate, up)) for name, fn in
            (("pytorch", eager), ("liger", liger_swiglu))]


def mlp_rows(tokens: int) -> list[tuple]:
    """The MLP as a module; its weights are inputs too, so that each timed backward starts from no gradients."""
    config = DiffLlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=32, num_key_value_heads=8)
    config._attn_implementation = "sdpa"  # DiffLlamaMLP takes its kernel on the fast implementations
    torch.manual_seed(0)
    modules = [cls(config).cuda().to(torch.bfloat16) for cls in (LlamaMLP, LigerSwiGLUMLP, DiffLlamaMLP)]
    for module in modules[1:]:
        module.load_state_dict(modules[0].state_dict())
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return [("mlp", f"{tokens} x {HIDDEN} -> {MLP}", name, lambda x, *weights, m=module: m(x),
             (x, *module.parameters())) for name, module in zip(("transformers", "liger", "modeling_diff"), modules)]


def loss_rows(tokens: int, chunk_budgets=(1,)) -> list[tuple]:
    """lm_head + loss: transformers' on materialised logits, Liger's fused one at each chunk budget (Liger's
    `chunk_mem_const`: a chunk's logits hold at most budget x tokens x hidden elements), and lm_head's product
    alone (its three matmuls: what any fused loss costs at least)."""
    hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, tokens), device="cuda")
    materialised = lambda h, w: ForCausalLMLoss(h @ w.T, labels, VOCAB)  # noqa: E731
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    rows = [("transformers", materialised)]
    for budget in chunk_budgets:
        name = "liger fused" + ("" if budget == 1 else f", chunk budget {budget}")
        rows.append((name, lambda h, w, budget=budget: liger_fused_linear_cross_entropy(
            h, w, shifted, chunk_mem_const=budget)))
    rows.append(("lm_head product alone", lambda h, w: h @ w.T))
    return [("lm_head + loss", f"{tokens} x {HIDDEN} -> {VOCAB}", name, fn, (hidden, weight)) for name, fn in rows]


OPS = {"rmsnorm": rms_norm_rows, "rope": rope_rows, "swiglu": swiglu_rows, "mlp": mlp_rows, "loss": loss_rows}


def peak_gib(fn, inputs) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(*inputs)
    out.backward(torch.ones_like(out) if out.dim() else None)  # a loss, or the MLP's output
    torch.cuda.synchronize()
    for t in inputs:
        t.grad = None
    torch.cuda.empty_cache()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    parser.add_argument("--chunk-budgets", type=int, nargs="+", default=[1],
                        help="Liger's chunk_mem_const values for the fused loss rows (1: Liger's default)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be >= 1")
    if min(args.chunk_budgets) < 1:
        parser.error("--chunk-budgets must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("liger_kernels.py needs a CUDA GPU")
    lines = ["| op | shape | implementation | forward ms | forward + backward ms | extra peak GiB (fwd + bwd) |",
             "|---|---|---|---|---|---|"]
    ops = dict(OPS, loss=functools.partial(loss_rows, chunk_budgets=args.chunk_budgets))
    for op, shape, name, fn, inputs in [row for op in args.ops for row in ops[op](args.tokens)]:
        forward, both = timed(fn, inputs, backward=False), timed(fn, inputs, backward=True)
        memory = f"{peak_gib(fn, inputs):.2f}" if op in ("mlp", "lm_head + loss") else ""
        lines.append(f"| {op} | {shape} | {name} | {forward:.3f} | {both:.3f} | {memory} |")
        print(lines[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
