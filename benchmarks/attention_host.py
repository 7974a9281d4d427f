"""The host's microseconds for one attention call, forward and backward, FlashAttention-4 against SDPA, at the
2048 x 4 training shape (32 and 64 query heads of 64 over 8 kv heads: Llama / V1 / DEX, V2):

    python benchmarks/attention_host.py          (needs a GPU and the flash-attn-4 package)

Each call is made 30 times while the GPU sleeps (`torch.cuda._sleep`), so that the launches only queue and the wall
time is the host's: what a call costs where the step is bound by its host (benchmarks/RESULTS.md, "Every mode at
bf4b6bd on an H100", where the 2K step's host time goes)."""
import time

import torch
import torch.nn.functional as F
from flash_attn.cute import flash_attn_func

from profile_train import SLEEP_CYCLES


def host_us(run, n=30):
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = time.perf_counter()
    results = [run() for _ in range(n)]
    elapsed = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return elapsed, results


for heads in (32, 64):
    q = torch.randn(4, 2048, heads, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(4, 2048, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(4, 2048, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    calls = {"fa4": lambda: flash_attn_func(q, k, v, causal=True)[0],
             "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True, enable_gqa=True)}
    for name, call in calls.items():
        for _ in range(3):
            call().float().sum().backward()
        fwd, outs = host_us(call)
        grads = [torch.ones_like(o) for o in outs]
        torch.cuda.synchronize()
        it = iter(zip(outs, grads))
        bwd, _ = host_us(lambda: torch.autograd.backward(*next(it)))
        print(f"{name} heads {heads}: forward host {fwd:.0f} us, backward host {bwd:.0f} us")
