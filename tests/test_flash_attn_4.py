"""FlashAttention-4 (the optional `flash-attn-4` package) for plain causal self-attention: which calls go to it (on
the CPU, with the package's function replaced by the formula); our call compiled for sm_90a by the installed package
on the CPU (fake tensors); and on a GPU with the package its outputs and gradients against the formula written here,
and the models on it against float32 eager."""

import os
import subprocess
import sys
import types

import pytest
import torch
from conftest import tiny_model

from modeling_diff import preset_config
from modeling_diff.diff_attention import ATTENTION_CLASSES
from modeling_diff.kernels import attention as attention_module, flash_attn_4
from modeling_diff.kernels.flash_attn_4 import flash_attn_4_attention, plain_causal_self_attention

GPU_WITH_FLASH_ATTN_4 = (
    torch.cuda.is_available()
    and flash_attn_4.flash_attn_4_installed()
    and torch.cuda.get_device_capability()[0] in (9, 10, 11)
)
needs_flash_attn_4 = pytest.mark.skipif(
    not GPU_WITH_FLASH_ATTN_4,
    reason="FlashAttention-4's kernels need a Hopper or Blackwell GPU and the flash-attn-4 package (none here); "
    "the CPU tests in this file check which calls go to it, and benchmarks/gpu_tests.sh runs these on the GPU",
)


def causal_attention(query, key, value, scaling):
    """softmax(Q K^T * scaling + causal mask) V per query head, query head j on kv head j // (Hq / Hkv), in float32:
    (B, Hq, L, d) x (B, Hkv, L, d / dv) -> (B, L, Hq, dv)."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.float().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.float() @ key.transpose(-1, -2) * scaling
    length = query.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    maps = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (maps @ value).transpose(1, 2)


def qkv(batch=2, length=16, heads=8, kv_heads=2, d=64, dtype=torch.bfloat16, device="cpu", grad=False):
    """Query (B, Hq, L, d), key and value (B, Hkv, L, d) as transformers passes them: (B, H, L, d) views of
    (B, L, H, d) tensors."""
    make = lambda h: torch.randn(batch, length, h, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_(grad)
    return make(heads), make(kv_heads), make(kv_heads)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_flash_attn_4_takes_only_plain_causal_self_attention():
    """No mask, as many keys as queries, no dropout, bf16 or fp16, kv heads dividing the query heads, heads of a
    multiple of 8 up to 128: anything else stays on SDPA."""
    query, key, value = qkv()
    assert plain_causal_self_attention(query, key, value, None, 0.0)
    assert plain_causal_self_attention(*(t.half() for t in (query, key, value)), None, 0.0)
    mask = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    assert not plain_causal_self_attention(query, key, value, mask, 0.0)  # padding, or a chunk after a cache
    assert not plain_causal_self_attention(query, key, value, None, 0.1)
    assert not plain_causal_self_attention(*(t.float() for t in (query, key, value)), None, 0.0)
    assert not plain_causal_self_attention(query[:, :, -1:], key, value, None, 0.0)  # one query against 16 keys
    assert not plain_causal_self_attention(*qkv(d=256), None, 0.0)
    assert not plain_causal_self_attention(*qkv(d=60), None, 0.0)
    assert not plain_causal_self_attention(*qkv(heads=8, kv_heads=3), None, 0.0)


def test_flash_attn_4_runs_nowhere_without_a_gpu_it_has_kernels_for():
    """On the CPU (and under Triton's interpreter, and with the package absent) nothing goes to it."""
    assert not flash_attn_4.flash_attn_4_runs_on(qkv()[0])


def test_our_call_compiles_flash_attn_4_s_hopper_kernels_on_the_cpu():
    """The call `flash_attn_4_attention` makes, as V2 (64 query heads of 64 over 8 kv heads) and DEX (32 over 8)
    make it, compiled for the H100 / H200 (sm_90a) by the installed package on the CPU: its tensors are fake
    (FakeTensorMode), and the package compiles for the architecture the environment names. The package is a beta
    (4.0.0b*): this is where a change of its API or of the shapes it takes shows up without a GPU. The dev extra
    (`make test`) installs it, so this runs wherever the tests do."""
    assert flash_attn_4.flash_attn_4_installed(), "flash-attn-4 is in the dev extra: pip install -e '.[dev]'"
    script = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from modeling_diff.kernels.flash_attn_4 import flash_attn_4_attention
with FakeTensorMode():
    for heads in (64, 32):
        query = torch.empty(1, 1024, heads, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        key = torch.empty(1, 1024, 8, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        print(tuple(flash_attn_4_attention(query, key, key, 0.125).shape))
"""
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90a", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["(1,", "1024,", "64,", "64)", "(1,", "1024,", "32,", "64)"]


def test_flash_attn_4_runs_on_a_gpu_with_its_kernels_but_not_under_torch_compile(monkeypatch):
    """Where the package and a GPU with its kernels are there (both pretended here), it runs in eager code, and not
    in code torch.compile traces (the package's autograd Function is not traceable: a compiled model keeps SDPA), nor
    with MODELING_DIFF_FLASH_ATTN_4=0."""
    monkeypatch.setattr(flash_attn_4, "flash_attn_4_installed", lambda: True)
    monkeypatch.setattr(flash_attn_4, "_device_has_kernels", lambda tensor: True)
    monkeypatch.setattr(flash_attn_4, "TRITON_INTERPRETING", False)
    query = torch.zeros(3)
    assert flash_attn_4.flash_attn_4_runs_on(query)
    traced = torch.compile(lambda x: x + 1 if flash_attn_4.flash_attn_4_runs_on(x) else x - 1, backend="eager")
    assert torch.equal(traced(query), query - 1)
    monkeypatch.setattr(flash_attn_4, "ENABLED", False)
    assert not flash_attn_4.flash_attn_4_runs_on(query)


def test_the_call_passes_the_layout_scale_and_determinism_flash_attn_4_expects(monkeypatch):
    """flash_attn_func gets (B, L, H, d) views of transformers' (B, H, L, d) tensors (no copy), the scale, causal,
    and `deterministic` as torch.use_deterministic_algorithms says; its output (B, L, Hq, dv) is returned as it is."""
    calls = []

    def flash_attn_func(q, k, v, **options):
        calls.append((q, k, v, options))
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), None

    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    query, key, value = qkv(length=48)
    out = flash_attn_4_attention(query, key, value, 0.125)
    q, k, v, options = calls[0]
    assert out.shape == (2, 48, 8, 64) and q.shape == (2, 48, 8, 64) and k.shape == (2, 48, 2, 64)
    assert q.data_ptr() == query.data_ptr() and q.is_contiguous() and v.data_ptr() == value.data_ptr()
    assert options == dict(softmax_scale=0.125, causal=True, deterministic=False)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        flash_attn_4_attention(query, key, value, 0.125)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert calls[1][3]["deterministic"] is True


@pytest.fixture
def flash_attn_4_here(monkeypatch):
    """FlashAttention-4 as if it ran here, its function replaced by the formula; the calls it got."""
    calls = []

    def formula(query, key, value, scaling):
        calls.append(query.shape)
        return causal_attention(query, key, value, scaling).to(query.dtype)

    monkeypatch.setattr(flash_attn_4, "flash_attn_4_runs_on", lambda query: True)
    monkeypatch.setattr(attention_module, "flash_attn_4_attention", formula)
    return calls


def test_diff_triton_sends_plain_causal_calls_to_flash_attn_4(flash_attn_4_here, monkeypatch):
    """`diff_triton` (what `sdpa` is on CUDA) calls FlashAttention-4 for a plain causal call, and SDPA for a
    non-causal one, one with an option FlashAttention-4 is not given (softcap), and one with a mask."""
    sdpa_calls = []
    monkeypatch.setattr(attention_module, "sdpa_attention_forward",
                        lambda module, query, *args, **kwargs: sdpa_calls.append(kwargs) or (query, None))
    module = torch.nn.Module()
    module.is_causal = True
    query, key, value = qkv(length=48, grad=True)  # a training step's (more rows than the decode kernel's)
    out, weights = attention_module.diff_triton_attention_forward(module, query, key, value, None, scaling=0.125)
    assert weights is None and flash_attn_4_here == [query.shape] and not sdpa_calls
    assert out.shape == (2, 48, 8, 64)
    assert rel_err(out, causal_attention(query, key, value, 0.125)) < 1e-2
    mask = torch.ones(2, 1, 48, 48, dtype=torch.bool).tril()
    for mask, options in ((None, dict(is_causal=False)), (None, dict(softcap=30.0)), (mask, {})):
        attention_module.diff_triton_attention_forward(module, query, key, value, mask, scaling=0.125, **options)
    assert len(flash_attn_4_here) == 1 and len(sdpa_calls) == 3


def test_without_gradients_flash_attn_4_takes_more_than_4096_queries(flash_attn_4_here, monkeypatch):
    """A prefill (no gradients) of up to 4096 queries stays where it was (SDPA here; V2's flash-diff kernel), where
    FlashAttention-4's forward measured slower; from 4097 on it goes to FlashAttention-4, and with gradients at
    every length."""
    monkeypatch.setattr(attention_module, "sdpa_attention_forward", lambda module, query, *a, **kw: (query, None))
    module = torch.nn.Module()
    module.is_causal = True
    for length, grad, expected in ((4096, False, 0), (4097, False, 1), (48, True, 2)):
        query, key, value = qkv(batch=1, length=length, heads=1, kv_heads=1, d=8, grad=grad)
        attention_module.diff_triton_attention_forward(module, query, key, value, None, scaling=0.125)
        assert len(flash_attn_4_here) == expected, (length, grad)


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_v2_takes_flash_attn_4_over_the_flash_diff_kernel_under_diff_triton(mode, monkeypatch):
    """Where FlashAttention-4 takes the call, V2 under `diff_triton` leaves the flash-diff kernel for one
    FlashAttention-4 call of its 2h heads and the fused combine; under `fused_diff` it keeps the kernel, and V1 keeps
    the kernel under both (its heads of 2 x d are one flash-diff program)."""
    config = preset_config(f"tiny-{mode}", hidden_size=128)
    module = ATTENTION_CLASSES[mode](config, layer_idx=0).train()
    d, heads, kv_heads = module.head_dim, config.num_attention_heads, config.num_key_value_heads
    pairs = torch.zeros(1, 16, heads, 2, d, dtype=torch.bfloat16, requires_grad=True)  # (B, L, h, 2, d)
    key_width = 2 * d if mode == "v1" else d  # V1's K1|K2
    key = torch.zeros(1, kv_heads, 16, key_width, dtype=torch.bfloat16)
    value = torch.zeros(1, kv_heads, 16, key_width, dtype=torch.bfloat16)

    def choices():
        return [module.flash_diff_applies(name, pairs, key, value, None, {}) for name in ("diff_triton", "fused_diff")]

    without = choices()
    monkeypatch.setattr(flash_attn_4, "flash_attn_4_runs_on", lambda query: True)
    expected = [False, without[1]] if mode == "v2" else without
    assert choices() == expected


@needs_flash_attn_4
@pytest.mark.parametrize("heads, kv_heads, length", [(64, 8, 1024), (32, 8, 2048), (16, 16, 333)])
def test_flash_attn_4_equals_the_formula_forward_and_backward(heads, kv_heads, length):
    """At V2's (64 query heads of 64 over 8 kv heads) and DEX's (32 over 8) shapes, and a length no tile divides:
    the output and the gradients of q, k and v against the formula in float32."""
    query, key, value = qkv(batch=2, length=length, heads=heads, kv_heads=kv_heads, device="cuda", grad=True)
    out = flash_attn_4_attention(query, key, value, 0.125)
    reference = causal_attention(query, key, value, 0.125)
    assert rel_err(out, reference) < 2e-2
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (query, key, value), grad)
    expected = torch.autograd.grad(reference, (query, key, value), grad.float())
    for name, g, e in zip("qkv", got, expected):
        assert rel_err(g, e) < 5e-2, name


@needs_flash_attn_4
@pytest.mark.parametrize("mode", ["v2", "dex"])
def test_models_on_flash_attn_4_train_as_float32_eager_and_prefill_as_without_it(mode, monkeypatch):
    """V2 and DEX (whose attention calls FlashAttention-4 takes under `sdpa` on CUDA): the loss and every gradient
    of a training step against eager in float32 on the same weights, and a prefill of 4160 tokens (which goes to
    FlashAttention-4) against the same model without it: the last position's logits."""
    calls = []
    original = attention_module.flash_attn_4_attention

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(attention_module, "flash_attn_4_attention", counted)
    shape = dict(head_dim=64, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                 max_position_embeddings=8192)
    fast = tiny_model(mode, attn_implementation="sdpa", **shape).to("cuda", torch.bfloat16).train()
    exact = tiny_model(mode, **shape).to("cuda", torch.float32).train()
    exact.load_state_dict(fast.state_dict())
    ids = torch.randint(3, fast.config.vocab_size, (2, 96), device="cuda")
    losses = [m(ids, labels=ids).loss for m in (exact, fast)]
    assert calls, "the training step did not call FlashAttention-4"
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 2e-2 * abs(losses[0].item())
    for (name, p_exact), p_fast in zip(exact.named_parameters(), fast.parameters()):
        if p_exact.grad is not None and p_exact.grad.norm() > 0:
            assert rel_err(p_fast.grad, p_exact.grad) < 5e-2, name
    fast.eval()
    calls.clear()
    prompt = torch.randint(3, fast.config.vocab_size, (1, 4160), device="cuda")  # beyond 4096: a prefill it takes
    with torch.no_grad():
        logits = fast(prompt).logits[:, -1]
        assert calls, "the prefill did not call FlashAttention-4"
        monkeypatch.setattr(flash_attn_4, "ENABLED", False)
        assert rel_err(logits, fast(prompt).logits[:, -1]) < 2e-2
