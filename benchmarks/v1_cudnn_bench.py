"""V1's attention (both maps and the combine) of one layer, forward and forward + backward, on the flash-diff kernel
(`kernels/flash_diff.py`, V1's training path) against one cuDNN SDPA call with queries of d: Q1 and Q2 as 2h heads,
K1 and K2 as 2h_kv heads, V twice (2h_kv heads of 2d; GQA maps Q1 head j to K1 head j // G and Q2 head j to K2 head
j // G), then the fused combine; against the zero-padded queries of the plain path; and Llama's cuDNN attention (32
heads of 64, 8 kv heads: 1x the work where V1's is 1.5x). TFLOP/s count V1's own causal FLOPs.

    python benchmarks/v1_cudnn_bench.py [--shapes 4x2048 1x8192 1x32768] [--out $OUT/v1_cudnn.json]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from attention_bench import milliseconds
from bench import write_atomically
from modeling_diff.kernels.combine import v1_combine
from modeling_diff.kernels.flash_diff import flash_diff_attention

H, HKV, D = 16, 4, 64


def cudnn_split(query, key, value, lam, subln, scale, backend):
    b, l, h, _, d = query.shape
    q = query.permute(0, 3, 2, 1, 4).reshape(b, 2 * h, l, d)
    k = torch.cat(key.split(d, -1), dim=1)
    v = torch.cat([value, value], dim=1)
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # (B, 2h, L, 2d)
    pairs = o.view(b, 2, h, l, 2 * d).permute(0, 3, 2, 1, 4).reshape(b, l, 2 * h, 2 * d)
    return v1_combine(pairs, lam, subln, 0.8)


def cudnn_padded(query, key, value, lam, subln, scale, backend):
    b, l, h, _, d = query.shape
    halves = torch.eye(2, dtype=query.dtype, device=query.device)[:, :, None]
    q = (query.unsqueeze(-2) * halves).flatten(-2).flatten(2, 3).transpose(1, 2)  # (B, 2h, L, 2d)
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=True)
    return v1_combine(o.transpose(1, 2), lam, subln, 0.8)


def flash(query, key, value, lam, subln, scale, backend):
    return flash_diff_attention(query, key, value, None, lam, scale, subln, 0.8)


def llama(b, l):
    q = torch.randn(b, 32, l, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, 8, l, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, 8, l, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, 32, l, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(g)
    return step


def batch_by_length(text: str) -> tuple[int, int]:
    """`--shapes`' BATCHxLENGTH, e.g. 4x2048."""
    batch, _, length = text.partition("x")
    if not (batch.isdigit() and length.isdigit() and int(batch) > 0 and int(length) > 0):
        raise argparse.ArgumentTypeError(f"--shapes takes BATCHxLENGTH of positive ints (4x2048), got {text!r}")
    return int(batch), int(length)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", type=batch_by_length, default=[(4, 2048), (1, 8192), (1, 32768)])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for b, l in args.shapes:
        shape = f"{b}x{l}"
        torch.manual_seed(0)
        query = torch.randn(b, l, H, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        key = torch.randn(b, HKV, l, 2 * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        value = torch.randn(b, HKV, l, 2 * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lam = torch.tensor(0.3, device="cuda", requires_grad=True)
        subln = LlamaRMSNorm(2 * D, eps=1e-5).to("cuda", torch.bfloat16)
        grad = torch.randn(b, l, H, 2 * D, device="cuda", dtype=torch.bfloat16)
        scale = D ** -0.5
        # Causal FLOPs of V1 (fwd): QK over d and PV over 2d for 2h maps; x 3.5 for fwd + bwd
        flops = 2 * b * 2 * H * (l * l / 2) * (D + 2 * D) * 3.5
        ref = None
        row = dict(shape=shape)
        for name, fn, backend in [("flash", flash, None), ("cudnn_split", cudnn_split, SDPBackend.CUDNN_ATTENTION),
                                  ("flash2_split", cudnn_split, SDPBackend.FLASH_ATTENTION),
                                  ("efficient_split", cudnn_split, SDPBackend.EFFICIENT_ATTENTION),
                                  ("cudnn_padded", cudnn_padded, SDPBackend.CUDNN_ATTENTION)]:
            try:
                for t in (query, key, value, lam):
                    t.grad = None
                y = fn(query, key, value, lam, subln, scale, backend)
                y.backward(grad)
                grads = [t.grad.float().clone() for t in (query, key, value)] + [lam.grad.float().clone()]
                if ref is None:
                    ref = (y.float(), grads)
                err = max((y.float() - ref[0]).abs().max().item(),
                          *[((a - r).abs().max() / r.abs().max()).item() for a, r in zip(grads, ref[1])])

                def fwd():
                    with torch.no_grad():
                        fn(query, key, value, lam, subln, scale, backend)

                def train():
                    fn(query, key, value, lam, subln, scale, backend).backward(grad)
                f_ms, t_ms = milliseconds(fwd, 10), milliseconds(train, 10)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                train()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                row[name] = dict(fwd_ms=f_ms, train_ms=t_ms, tflops=flops / t_ms / 1e9, err=err, peak_gib=peak)
                print(f"{shape} {name:16} fwd {f_ms:7.3f} ms  fwd+bwd {t_ms:7.3f} ms ({flops / t_ms / 1e9:5.0f} TFLOP/s) "
                      f"err {err:.1e} extra peak {peak:.2f} GiB", flush=True)
            except RuntimeError as e:  # a backend that does not take these shapes
                print(f"{shape} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        lt = milliseconds(llama(b, l), 10)
        lflops = 2 * b * 32 * (l * l / 2) * (64 + 64) * 3.5
        row["llama_cudnn"] = dict(train_ms=lt, tflops=lflops / lt / 1e9)
        print(f"{shape} llama cudnn fwd+bwd {lt:7.3f} ms ({lflops / lt / 1e9:5.0f} TFLOP/s)", flush=True)
        rows.append(row)
    if args.out:
        write_atomically(args.out, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
