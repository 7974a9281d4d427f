"""One attention layer of the ~1.1B models, forward and forward + backward, on one GPU: which path is faster.

    python benchmarks/attention_bench.py --seq 2048 8192

Rows: transformers' LlamaAttention (32 heads of 64, 8 kv heads; SDPA) as the reference; modeling_diff V1 and
V2 through the flash-diff kernel (`kernels/flash_diff.py`, attn_implementation "fused_diff") and through the
plain path (one SDPA call of the pairs, then the fused Triton combine). Projections, RoPE and the output
projection are included, as in the model. Tokens per batch: 8192 (4 x 2048, or 1 x 8192).
"""

import argparse
import sys

import torch
from tqdm import tqdm
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from modeling_diff import preset_config
from modeling_diff.diff_attention import ATTENTION_CLASSES


def layer(name: str):
    """(module, config) in bf16 on the GPU; name: llama, v1, v2, v1-plain or v2-plain."""
    if name == "llama":
        config = LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
        config._attn_implementation = "sdpa"
        module = LlamaAttention(config, layer_idx=0)
    else:
        mode = name.split("-")[0]
        config = preset_config(f"1.1b-{mode}")
        config._attn_implementation = "fused_diff"
        module = ATTENTION_CLASSES[mode](config, layer_idx=0)
        if name.endswith("plain"):
            module.flash_diff_applies = lambda *args: False
    return module.to("cuda", torch.bfloat16), config


def milliseconds(fn, repeats: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def measure(name: str, seq: int, tokens: int, repeats: int) -> dict:
    module, config = layer(name)
    batch = max(1, tokens // seq)
    x = torch.randn(batch, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq, device="cuda")[None].expand(batch, -1)
    rope = LlamaRotaryEmbedding(config, device="cuda")(x, positions)
    grad = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            module(x, rope, None)

    def train():
        out = module(x, rope, None)[0]
        out.backward(grad)

    return dict(model=name, seq=seq, forward_ms=milliseconds(forward, repeats), train_ms=milliseconds(train, repeats))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention_bench.py needs a CUDA GPU")
    names = ["llama", "v1", "v1-plain", "v2", "v2-plain"]
    rows = [measure(n, s, args.tokens, args.repeats) for s in args.seq for n in tqdm(names, desc="layers")]
    base = {r["seq"]: r for r in rows if r["model"] == "llama"}
    print("| seq | layer | forward ms | vs Llama | forward + backward ms | vs Llama |\n|---|---|---|---|---|---|")
    for r in rows:
        ref = base[r["seq"]]
        print(f"| {r['seq']} | {r['model']} | {r['forward_ms']:.3f} | {r['forward_ms'] / ref['forward_ms']:.2f}x | "
              f"{r['train_ms']:.3f} | {r['train_ms'] / ref['train_ms']:.2f}x |")


if __name__ == "__main__":
    main()
