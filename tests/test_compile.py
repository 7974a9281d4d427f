"""torch.compile(fullgraph=True) of the decoding step with a StaticCache, for every mode.

On a CPU the graph is captured whole by Dynamo (backend "eager": a graph break fails the test, nothing is
code-generated, so it stays fast); on a GPU it is compiled by Inductor and the step runs through the
split-KV Triton kernel (a custom op). Either way the compiled steps must give the uncompiled logits.
"""

import pytest
import torch
from conftest import MODES, tiny_model
from transformers import StaticCache

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
BACKEND = "inductor" if GPU else "eager"


def greedy_steps(model, step, prompt, steps):
    """Prefill (uncompiled), then `steps` greedy decoding steps through `step`; returns their logits."""
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps)
    logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1]
    out = []
    for t in range(steps):
        token = logits.argmax(-1, keepdim=True)
        position = torch.full((prompt.shape[0], 1), prompt.shape[1] + t, device=DEVICE)
        logits = step(token, position, cache)
        out.append(logits)
    return torch.stack(out, 1)


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_compiled_static_cache_decoding_step_equals_eager(mode):
    torch._dynamo.reset()
    model = tiny_model(mode, attn_implementation="sdpa").to(DEVICE, DTYPE)

    def step(token, position, cache):
        return model(token, position_ids=position, past_key_values=cache).logits[:, -1]

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), device=DEVICE)
    reference = greedy_steps(model, step, prompt, 4)
    out = greedy_steps(model, compiled, prompt, 4)
    torch.testing.assert_close(out, reference, rtol=2e-2 if GPU else 1e-4, atol=2e-2 if GPU else 1e-4)
