"""transformers' offloading StaticCache on a GPU, one model per process with faulthandler on: where generate's
compiled step crashes (benchmarks/RESULTS.md, "the offloaded StaticCache under generate's compile").

    python3 -X faulthandler benchmarks/offload_probe.py MODEL IMPLEMENTATION CACHE [OPTION]
    python3 -X faulthandler benchmarks/offload_probe.py llama sdpa offloaded_static     # transformers' Llama
    python3 -X faulthandler benchmarks/offload_probe.py v1 sdpa offloaded_static nocompile

MODEL: llama (transformers' LlamaForCausalLM, 2 layers) or v1 / v2 / dex (the tests' tiny models); CACHE: a
cache_implementation; OPTION: nocompile (disable_compile=True), compile (a compile_config: our model leaves an
offloading StaticCache uncompiled unless one asks) or scores (output_scores=True: transformers' loop rather than our
graphed greedy path). Prints whether the tokens equal the dynamic cache's.
"""

import faulthandler
import sys

import torch

sys.path.insert(0, "tests")
faulthandler.enable()
from conftest import tiny_model  # noqa: E402
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

which, implementation, cache = sys.argv[1], sys.argv[2], sys.argv[3]
option = sys.argv[4] if len(sys.argv) > 4 else ""
ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4)).cuda()
kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
if which == "llama":
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=implementation)
    model = LlamaForCausalLM(config).cuda()
else:
    model = tiny_model(which, attn_implementation=implementation).cuda()
extra = {"nocompile": dict(disable_compile=True), "compile": dict(compile_config=CompileConfig()),
         "scores": dict(output_scores=True), "": {}}[option]
out = model.generate(ids, cache_implementation=cache, **kw, **extra)
print(which, implementation, cache, sys.argv[4:], "equal:", torch.equal(out, model.generate(ids, **kw)), flush=True)
