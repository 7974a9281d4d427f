"""The Triton kernels and the fast attention paths against references written here from the formulas.

On a CPU (CI) the kernels run through Triton's interpreter (TRITON_INTERPRET=1) on tiny shapes in float32.
On a GPU the same tests run at the ~1.1B model's shapes in bfloat16 (`pytest tests/test_kernels.py` on the
accelerator machine); tolerances follow the dtype.
"""

import copy
import functools
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import MODES, tiny_config, tiny_model  # conftest sets TRITON_INTERPRET=1 where there is no GPU
from transformers import DynamicCache, StaticCache

from modeling_diff import preset_config
from modeling_diff.kernels import _triton
from modeling_diff.kernels._triton import next_power_of_2
from modeling_diff.kernels.combine import v1_combine_triton, v2_combine_projection_triton, v2_combine_triton
from modeling_diff.kernels.decode import decode_attention
from modeling_diff.kernels.flash_diff import flash_diff_attention
from modeling_diff.kernels.rmsnorm import rms_norm, rms_norm_kernel_applies
from modeling_diff.kernels.rope import apply_rope, rope_kernel_applies
from modeling_diff.kernels.swiglu import silu_mul, silu_mul_applies, swiglu_mlp, swiglu_mlp_applies

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = 2e-2 if GPU else 1e-5  # relative error ||out - ref|| / ||ref||
GRAD_TOL = 5e-2 if GPU else 1e-3  # gradients of a whole model: summation orders differ between backends
if GPU:  # the ~1.1B model's attention: V1 16 heads of 2*64 over 4 kv heads, V2 64 query heads of 64 over 8
    B, L, H, D = 4, 1024, 16, 128
else:
    B, L, H, D = 2, 5, 3, 16


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def rand(*shape, grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE).requires_grad_(grad)


def compiled_run(script: str, cwd=None) -> str:
    """The output of a Python script run in a fresh process with Triton compiling (TRITON_INTERPRET unset)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


class Norm(torch.nn.Module):  # what the kernel reads of LlamaRMSNorm: weight and variance_epsilon
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width, device=DEVICE, dtype=DTYPE))
        self.variance_epsilon = 1e-5


def test_v1_combine_forward_and_gradients_match_the_formula():
    torch.manual_seed(0)
    attn = rand(B, L, 2 * H, D, grad=True)
    lam = torch.tensor(0.37, device=DEVICE, requires_grad=True)
    norm, scale = Norm(D), 1 - 0.44
    grad_out = rand(B, L, H, D)

    out = v1_combine_triton(attn, lam, norm, scale)
    grads = torch.autograd.grad(out, (attn, lam, norm.weight), grad_out)

    # (1 - lambda_init) * RMSNorm_w(A1 V - lambda A2 V), each pair (2i, 2i+1); float64
    a64, lam64, w64 = (t.detach().double().requires_grad_() for t in (attn, lam, norm.weight))
    x = a64[:, :, 0::2] - lam64 * a64[:, :, 1::2]
    ref = scale * w64 * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    ref_grads = torch.autograd.grad(ref, (a64, lam64, w64), grad_out.double())

    assert out.shape == (B, L, H, D) and out.dtype == DTYPE
    assert rel_err(out, ref) < TOL
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOL


@pytest.mark.parametrize("width", [16, 64])
def test_v1_lambda_kernel_forward_and_gradients_match_the_formula(width):
    """V1's lambda in one launch each way against Eq. 2 in float64; on a GPU the module, as a model calls it, takes
    the kernel (on a CPU, the reference: an interpreted launch costs more than its few operations)."""
    from modeling_diff.diff_attention import DifferentialLambda
    from modeling_diff.kernels.combine import _DifferentialLambda, differential_lambda_triton

    torch.manual_seed(0)
    module = DifferentialLambda(width, lambda_init=0.44, std_dev=0.3).to(DEVICE, DTYPE)
    lam = differential_lambda_triton(module.vectors(), module.lambda_init)
    (2.5 * lam).backward()

    q1, k1, q2, k2 = (v.detach().double().requires_grad_() for v in module.vectors())
    ref = torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum()) + 0.44
    ref_grads = torch.autograd.grad(2.5 * ref, (q1, k1, q2, k2))
    assert lam.dtype == torch.float32 and lam.shape == ()
    assert abs(lam.item() - ref.item()) < 1e-5
    for vector, want in zip(module.vectors(), ref_grads):
        assert vector.grad.dtype == DTYPE
        assert rel_err(vector.grad, want) < TOL
    assert (type(module().grad_fn) is _DifferentialLambda._backward_cls) == GPU


def test_v1_lambda_takes_the_reference_for_vectors_the_kernel_does_not_cover():
    """A length that is not a power of 2, or a strided vector: the reference, the same value and gradients."""
    from modeling_diff.kernels.combine import differential_lambda, differential_lambda_reference

    torch.manual_seed(0)
    for vectors in ([0.3 * torch.randn(24, device=DEVICE) for _ in range(4)],
                    [(0.3 * torch.randn(32, device=DEVICE))[::2] for _ in range(4)]):
        vectors = [v.requires_grad_() for v in vectors]
        lam = differential_lambda(vectors, 0.2)
        assert lam.grad_fn.name() != "_DifferentialLambdaBackward"
        ref = differential_lambda_reference(vectors, 0.2)
        assert torch.equal(lam, ref)


def test_v2_combine_forward_and_gradients_match_the_formula():
    torch.manual_seed(1)
    attn = rand(B, L, 2 * H, D // 2, grad=True)
    weight = torch.sigmoid(rand(B, L, H)).detach().requires_grad_()
    grad_out = rand(B, L, H, D // 2)

    out = v2_combine_triton(attn, weight)
    grads = torch.autograd.grad(out, (attn, weight), grad_out)

    a64, w64 = (t.detach().double().requires_grad_() for t in (attn, weight))
    ref = a64[:, :, 0::2] - w64[..., None] * a64[:, :, 1::2]
    ref_grads = torch.autograd.grad(ref, (a64, w64), grad_out.double())

    assert rel_err(out, ref) < TOL
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOL


@pytest.mark.parametrize("bias", [False, True])
def test_v2_combine_and_o_proj_match_the_formula_and_keep_no_combined_heads(bias):
    """o_proj(signal - w * noise) in one autograd node: its output and the gradients of the pairs, w, o_proj's
    weight and bias, against the formula in float64; it keeps the pairs (the attention's output) and no
    (B, L, h, d) combined heads, which o_proj alone would keep."""
    torch.manual_seed(2)
    hidden = 48
    attn = rand(B, L, 2 * H, D // 2, grad=True)
    weight = torch.sigmoid(rand(B, L, H)).detach().requires_grad_()
    o_proj = torch.nn.Linear(H * D // 2, hidden, bias=bias, device=DEVICE, dtype=DTYPE)
    grad_out = rand(B, L, hidden)

    kept, out = saved_shapes(lambda: v2_combine_projection_triton(attn, weight, o_proj.weight, o_proj.bias))
    inputs = (attn, weight, *o_proj.parameters())
    grads = torch.autograd.grad(out, inputs, grad_out)

    a64, w64, *o64 = (t.detach().double().requires_grad_() for t in inputs)
    ref = torch.nn.functional.linear((a64[:, :, 0::2] - w64[..., None] * a64[:, :, 1::2]).flatten(-2), *o64)
    ref_grads = torch.autograd.grad(ref, (a64, w64, *o64), grad_out.double())

    assert out.shape == ref.shape and rel_err(out, ref) < TOL
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and rel_err(got, want) < TOL
    combined = B * L * H * D // 2
    assert not any(math.prod(shape) == combined for shape in kept)
    assert sum(math.prod(shape) == 2 * combined for shape in kept) == 1  # the pairs

    o_proj.requires_grad_(False)  # frozen (PEFT elsewhere): no gradient for it, the same for the rest
    frozen_out = v2_combine_projection_triton(attn, weight, o_proj.weight, o_proj.bias)
    frozen = torch.autograd.grad(frozen_out, (attn, weight), grad_out)
    assert all(rel_err(got, want) < TOL for got, want in zip(frozen, grads))
    assert all(p.grad is None for p in o_proj.parameters())


def test_v2_combine_and_o_proj_node_under_autocast_runs_o_proj_as_f_linear_does(monkeypatch):
    """Trainer's `bf16=True` on a float32 model: the attention's output in autocast's dtype, o_proj's parameters in
    float32. The node runs o_proj's product in autocast's dtype, as F.linear would, and gives each gradient in its
    tensor's own dtype; output and gradients against the formula in float64. (On the H200 at 7fa55fc the backward
    multiplied the bf16 gradient by the float32 weight: a RuntimeError in every such training step.) On the CPU
    the Triton kernels run under the interpreter, in float16 autocast: the interpreter computes no bfloat16."""
    import modeling_diff.kernels.combine as combine

    monkeypatch.setattr(combine, "_fused", lambda attn: True)
    node_calls, node = [], combine.v2_combine_projection_triton
    monkeypatch.setattr(combine, "v2_combine_projection_triton", lambda *a: node_calls.append(1) or node(*a))
    half = torch.bfloat16 if GPU else torch.float16
    torch.manual_seed(3)
    hidden = 48
    attn = torch.randn(B, L, 2 * H, D // 2, device=DEVICE).to(half).requires_grad_()
    weight = torch.sigmoid(torch.randn(B, L, H, device=DEVICE)).to(half).requires_grad_()
    o_proj = torch.nn.Linear(H * D // 2, hidden, device=DEVICE)  # float32
    with torch.autocast(DEVICE, dtype=half):
        out = combine.v2_combine_projected(attn, weight, o_proj)
    inputs = (attn, weight, *o_proj.parameters())
    grad_out = torch.randn(out.shape, device=DEVICE, dtype=half)
    grads = torch.autograd.grad(out, inputs, grad_out)

    a64, w64, *o64 = (t.detach().double().requires_grad_() for t in inputs)
    ref = torch.nn.functional.linear((a64[:, :, 0::2] - w64[..., None] * a64[:, :, 1::2]).flatten(-2), *o64)
    ref_grads = torch.autograd.grad(ref, (a64, w64, *o64), grad_out.double())
    assert node_calls == [1] and out.dtype == half and rel_err(out, ref) < 2e-2
    for tensor, got, want in zip(inputs, grads, ref_grads):
        assert got.dtype == tensor.dtype and rel_err(got, want) < 2e-2


@pytest.mark.parametrize("shared_positions", [False, True])  # cos, sin of batch 1, shared by the batch
def test_rope_kernel_forward_and_gradients_match_the_formula(shared_positions):
    """x * cos + rotate_half(x) * sin (Llama's half-split RoPE), rotate_half(x) = (-x2, x1); the query a strided
    view (B, L, Hq, d) of a (B, Hq, L, d) tensor, as a gradient reaches it."""
    torch.manual_seed(2)
    q_heads, kv_heads, dim = (64, 8, 64) if GPU else (6, 2, 16)
    query = rand(B, q_heads, L, dim).transpose(1, 2).detach().requires_grad_()
    key = rand(B, L, kv_heads, dim, grad=True)
    angles = torch.rand(1 if shared_positions else B, L, dim // 2, device=DEVICE, dtype=torch.float64) * 6.3
    cos, sin = (f(torch.cat([angles, angles], -1)).to(DTYPE) for f in (torch.cos, torch.sin))
    grads_out = rand(B, L, q_heads, dim), rand(B, L, kv_heads, dim)
    assert rope_kernel_applies(query, key, cos, sin)

    out = apply_rope(query, key, cos, sin, fused=True)
    grads = torch.autograd.grad(out, (query, key), grads_out)

    def formula(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos.double()[:, :, None] + torch.cat([-x2, x1], -1) * sin.double()[:, :, None]

    x64 = [t.detach().double().requires_grad_() for t in (query, key)]
    ref = [formula(x) for x in x64]
    ref_grads = torch.autograd.grad(ref, x64, [g.double() for g in grads_out])
    for got, want in zip((*out, *grads), (*ref, *ref_grads)):
        assert got.shape == want.shape and got.dtype == DTYPE
        assert rel_err(got, want) < TOL


def test_rope_kernel_promotes_like_the_formula():
    """A float32 cos and sin (transformers' rotary embedding under autocast) with lower-precision queries: the
    result is float32, as `q * cos` is, and the gradient comes back in the queries' dtype."""
    low = torch.bfloat16 if GPU else torch.float16
    query = torch.randn(B, L, 4, 16, device=DEVICE, dtype=low, requires_grad=True)
    key = torch.randn(B, L, 2, 16, device=DEVICE, dtype=low)
    cos, sin = torch.ones(1, L, 16, device=DEVICE), torch.zeros(1, L, 16, device=DEVICE)  # the identity rotation
    q_out, k_out = apply_rope(query, key, cos, sin, fused=True)
    (grad,) = torch.autograd.grad(q_out.sum(), query)
    assert q_out.dtype == k_out.dtype == torch.float32 and grad.dtype == low
    assert torch.equal(q_out, query.float()) and torch.equal(k_out, key.float())
    assert torch.equal(grad, torch.ones_like(grad))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # attention scaling != 1
    {"rope_type": "dynamic", "factor": 2.0},  # frequencies updated in the forward: transformers' own
])
def test_decoding_rope_cos_sin_equal_transformers_rotary_embedding(rope, monkeypatch):
    """A decoding step's cos and sin in one launch: transformers' LlamaRotaryEmbedding forward (the reference) for
    positions shared by the batch or per row, far ones too, in the step's dtype, with gradients recorded too (cos
    and sin are constants); more positions than a step's and RoPE types that update their frequencies take
    transformers' forward."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from modeling_diff.kernels import rope as rope_module
    from modeling_diff.modeling_diff_llama import DiffLlamaRotaryEmbedding

    launches = []
    monkeypatch.setattr(rope_module, "_rope_cos_sin", CountedKernel(rope_module._rope_cos_sin, launches))
    config = tiny_config("dex", rope_parameters={"rope_theta": 10000.0, **rope}, max_position_embeddings=128)
    config._attn_implementation = "sdpa" if GPU else "diff_triton"  # a fast implementation (on CUDA, sdpa)
    module = DiffLlamaRotaryEmbedding(config).to(DEVICE)
    # a model moved to bf16 (`model.to(torch.bfloat16)`) holds its frequencies in bf16: the kernel reads them as
    # transformers' forward does, upcast to float32
    converted = DiffLlamaRotaryEmbedding(config).to(DEVICE, torch.bfloat16)
    assert converted.inv_freq.dtype == torch.bfloat16
    with torch.no_grad():
        for positions in ([[7]], [[0], [3], [90], [127]], [[5, 6, 7], [60, 61, 62]], [[0] * 64]):
            positions = torch.tensor(positions, device=DEVICE)
            x = rand(*positions.shape, config.hidden_size)
            for rotary in (module, converted):
                got, want = rotary(x, positions), LlamaRotaryEmbedding.forward(rotary, x, positions)
                for g, w in zip(got, want):
                    assert g.shape == w.shape and g.dtype == w.dtype == x.dtype
                    torch.testing.assert_close(g, w)  # the dtype's tolerance: cos and sin within an ulp
        taken = 0 if rope["rope_type"] == "dynamic" else 8
        assert len(launches) == taken
        module(rand(1, 65, config.hidden_size), torch.arange(65, device=DEVICE)[None])  # more than a step's
        assert len(launches) == taken
    module(rand(1, 1, config.hidden_size).requires_grad_(), torch.zeros(1, 1, dtype=torch.long, device=DEVICE))
    assert len(launches) == taken + (rope["rope_type"] != "dynamic")  # cos and sin are constants: no node needed


@pytest.mark.parametrize("width", [2048, 576] if GPU else [32, 24])  # a power of two, and SmolLM2's 576
@pytest.mark.parametrize("tokens", [L + 3, 1100])  # 1100 x 2: more partial weight gradients than one load sums
def test_rms_norm_kernel_forward_and_gradients_match_the_formula(width, tokens):
    """w * x / sqrt(mean(x^2) + eps) over the last dim (LlamaRMSNorm), rows not a multiple of the kernel's."""
    from modeling_diff.kernels.rmsnorm import BACKWARD_ROWS, DW_SUM_BLOCK_P

    assert tokens == L + 3 or 2 * tokens > BACKWARD_ROWS * DW_SUM_BLOCK_P
    torch.manual_seed(3)
    x = rand(2, tokens, width, grad=True)
    weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width, device=DEVICE, dtype=DTYPE))
    grad_out = rand(2, tokens, width)
    assert rms_norm_kernel_applies(x, weight)

    out = rms_norm(x, weight, 1e-6)
    grads = torch.autograd.grad(out, (x, weight), grad_out)

    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    ref = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)
    ref_grads = torch.autograd.grad(ref, (x64, w64), grad_out.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert got.shape == want.shape and got.dtype == DTYPE
        assert rel_err(got, want) < TOL


def test_add_rms_norm_matches_the_add_then_the_formula():
    """residual + update (rounded to the dtype) and LlamaRMSNorm of it, in one pass; not where the shapes differ."""
    from modeling_diff.kernels.rmsnorm import add_rms_norm, add_rms_norm_applies

    torch.manual_seed(5)
    norm = Norm(48)
    residual, update = rand(B, L, 48), rand(B, L, 48)
    with torch.no_grad():
        assert add_rms_norm_applies(residual, update, norm.weight)
        total, normed = add_rms_norm(residual, update, norm.weight, norm.variance_epsilon)
        assert not add_rms_norm_applies(residual, update[:, :1], norm.weight)
    expected = residual + update
    x = expected.float()
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(DTYPE)
    assert torch.equal(total, expected)
    assert rel_err(normed, reference) < TOL
    # the decoder layer's call: a norm with a hook, of another class (Liger's class patch, a subclass) or with a
    # forward of its instance (Liger's instance patch, `apply_liger_kernel_to_diff_llama(model=...)`) keeps its forward
    from modeling_diff.modeling_diff_llama import DiffLlamaRMSNorm, add_and_norm

    class OtherNorm(DiffLlamaRMSNorm):
        def forward(self, hidden_states):
            seen.append("other")
            return super().forward(hidden_states)

    config = tiny_config("dex", hidden_size=48)
    config._attn_implementation = FAST
    seen = []
    hooked, other = DiffLlamaRMSNorm(config).to(DEVICE, DTYPE), OtherNorm(config).to(DEVICE, DTYPE)
    hooked.register_forward_hook(lambda *args: seen.append("hook"))
    patched = DiffLlamaRMSNorm(config).to(DEVICE, DTYPE)
    patched.forward = types.MethodType(
        lambda self, x: seen.append("patch") or DiffLlamaRMSNorm.forward(self, x), patched
    )
    with torch.no_grad():
        for module in (hooked, other, patched):
            total, normed = add_and_norm(module, residual, update, config)
            assert torch.equal(total, expected) and rel_err(normed, module(expected)) < TOL
    assert seen == ["hook", "hook", "other", "other", "patch", "patch"]


@pytest.mark.parametrize("sum_used", [True, False])
def test_add_rms_norm_gradients_match_the_formula(sum_used):
    """In training the sum and its norm are one node: the gradient of residual and of update is the sum's own
    gradient (the residual stream's; none where the sum is not used further, as before the final norm) plus the
    norm's, and the weight's is the norm's; against the formula in float64, rows not a multiple of the backward's."""
    from modeling_diff.kernels.rmsnorm import add_rms_norm, add_rms_norm_applies

    torch.manual_seed(6)
    width = 2048 if GPU else 48
    norm = Norm(width)
    residual, update = rand(B, L + 17, width, grad=True), rand(B, L + 17, width, grad=True)
    grad_total, grad_y = rand(*residual.shape), rand(*residual.shape)
    assert add_rms_norm_applies(residual, update, norm.weight)
    total, normed = add_rms_norm(residual, update, norm.weight, norm.variance_epsilon)
    outputs, grad_outputs = ((total, normed), (grad_total, grad_y)) if sum_used else ((normed,), (grad_y,))
    grads = torch.autograd.grad(outputs, (residual, update, norm.weight), grad_outputs)

    r64, u64, w64 = (t.detach().double().requires_grad_() for t in (residual, update, norm.weight))
    x64 = r64 + u64
    ref = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + norm.variance_epsilon)
    ref_outputs = (x64, ref) if sum_used else (ref,)
    ref_grads = torch.autograd.grad(ref_outputs, (r64, u64, w64), tuple(g.double() for g in grad_outputs))
    assert rel_err(normed, ref) < TOL
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and got.dtype == DTYPE
        assert rel_err(got, want) < TOL
    # a NaN in one row of the update stays in that row, forward and backward
    poisoned = update.detach().clone()
    poisoned[0, 1] = float("nan")
    total, normed = add_rms_norm(residual, poisoned, norm.weight, norm.variance_epsilon)
    grad = torch.autograd.grad(normed, residual, grad_y)[0]
    for out in (total, normed, grad):
        assert out[0, 1].isnan().all() and not out[0, 0].isnan().any() and not out[1].isnan().any()


def test_rms_norm_and_rope_kernels_take_zero_tokens():
    """An empty batch or prompt passes through with its shape (and empty gradients), as through the formulas."""
    weight = torch.nn.Parameter(torch.ones(32, device=DEVICE, dtype=DTYPE))
    x = rand(0, 3, 32, grad=True)
    out = rms_norm(x, weight, 1e-6)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))
    query, key, cos = rand(2, 0, 4, 16, grad=True), rand(2, 0, 2, 16), rand(2, 0, 16)
    q_out, k_out = apply_rope(query, key, cos, cos, fused=True)
    q_out.sum().backward()
    assert q_out.shape == query.shape and k_out.shape == key.shape and query.grad.shape == query.shape
    # the training nodes of the residual add with its norm, and of q, k, v
    from modeling_diff.kernels import add_rms_norm
    from modeling_diff.kernels._modules import shared_input_linears

    weight.grad = None
    total, normed = add_rms_norm(x, rand(0, 3, 32), weight, 1e-6)
    (total.sum() + normed.sum()).backward()
    assert normed.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))
    layers = [linear_layer(32, 8), linear_layer(32, 4, bias=True)]
    outputs = shared_input_linears(x, layers)
    sum(out.sum() for out in outputs).backward()
    assert [out.shape[-1] for out in outputs] == [8, 4] and not layers[1].bias.grad.any()


def swiglu_mlp_module(hidden=64 if GPU else 32, intermediate=8192 if GPU else 40, **overrides):
    """DiffLlamaMLP (transformers' LlamaMLP with the kernel's dispatch) on the test's device and dtype."""
    from modeling_diff.modeling_diff_llama import DiffLlamaMLP

    config = tiny_config("v1", hidden_size=hidden, intermediate_size=intermediate, **overrides)
    config._attn_implementation = FAST
    return DiffLlamaMLP(config).to(DEVICE, DTYPE)


def saved_shapes(fn) -> list[tuple]:
    """The shapes of the distinct tensors autograd keeps for the backward of fn()'s output (and the output)."""
    shapes, storages = [], set()

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in storages:
            storages.add(tensor.untyped_storage().data_ptr())
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return shapes, out


@pytest.mark.parametrize("tokens", [(B, L + 3), (0, 3)])
def test_swiglu_mlp_forward_and_gradients_match_the_formula(tokens):
    """down(silu(gate x) * up x) and its gradients, written here in float64, through the kernel's autograd node,
    with more elements than one program's and a count that is not a multiple of it; and an empty batch."""
    torch.manual_seed(4)
    mlp = swiglu_mlp_module()
    x = rand(*tokens, mlp.hidden_size, grad=True)
    grad_out = rand(*tokens, mlp.hidden_size)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert swiglu_mlp_applies(mlp, x)

    out = mlp(x)
    grads = torch.autograd.grad(out, (x, *weights), grad_out)

    x64, g64, u64, d64 = (t.detach().double().requires_grad_() for t in (x, *weights))
    gate, up = x64 @ g64.T, x64 @ u64.T
    ref = (gate * torch.sigmoid(gate) * up) @ d64.T
    ref_grads = torch.autograd.grad(ref, (x64, g64, u64, d64), grad_out.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert got.shape == want.shape and got.dtype == DTYPE
        if want.numel() and want.norm() > 0:
            assert rel_err(got, want) < TOL
        else:
            assert not got.any()


def test_swiglu_mlp_keeps_one_activation_fewer_than_llama_mlp():
    """transformers' LlamaMLP keeps gate(x), silu(gate(x)), up(x) and the product for the backward; the kernel's node
    keeps gate(x) and up(x) and recomputes the product: the same gradients, two (tokens x intermediate) tensors
    fewer (one fewer than Liger's SwiGLU MLP, which keeps gate(x), up(x) and the product)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(5)
    mlp = swiglu_mlp_module()
    llama = LlamaMLP(mlp.config).to(DEVICE, DTYPE)
    llama.load_state_dict(mlp.state_dict())
    x = rand(B, L, mlp.hidden_size, grad=True)
    activation = (B * L, mlp.intermediate_size)
    ours, out = saved_shapes(lambda: mlp(x))
    theirs, ref = saved_shapes(lambda: llama(x))
    assert sum(math.prod(s) == math.prod(activation) for s in theirs) == 4
    assert sum(math.prod(s) == math.prod(activation) for s in ours) == 2
    assert rel_err(out, ref) < TOL
    grads = torch.autograd.grad(out.sum(), (x, *mlp.parameters()))
    ref_grads = torch.autograd.grad(ref.sum(), (x, *llama.parameters()))
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOL


def test_swiglu_mlp_backward_is_one_activation_pass(monkeypatch):
    """The backward computes the product again in the pass that makes da and db (gate(x) and up(x) read once): one
    activation launch in the backward and none of the forward's; without down_proj's gradient it does not write the
    product."""
    from modeling_diff.kernels import swiglu

    launches = []

    class Counted:  # kernel[grid](...) as Triton's, the launch recorded with its constants
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, kwargs.get("RECOMPUTE")))
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(swiglu, "_swiglu_fwd", Counted("fwd", swiglu._swiglu_fwd))
    monkeypatch.setattr(swiglu, "_swiglu_bwd", Counted("bwd", swiglu._swiglu_bwd))
    torch.manual_seed(9)
    mlp = swiglu_mlp_module()
    x = rand(B, L, mlp.hidden_size, grad=True)
    out = mlp(x)
    assert launches == [("fwd", None)]
    out.sum().backward()
    assert launches == [("fwd", None), ("bwd", True)]
    mlp.down_proj.requires_grad_(False)
    launches.clear()
    mlp(x).sum().backward()
    assert launches == [("fwd", None), ("bwd", False)]


def test_swiglu_mlp_backward_runs_twice_and_skips_frozen_weights():
    """A graph kept with retain_graph=True runs backward again to the same gradients (the backward writes only its
    own buffers), and with frozen weights (PEFT's LoRA elsewhere in the model) only x gets a gradient."""
    torch.manual_seed(6)
    mlp = swiglu_mlp_module()
    x = rand(B, L, mlp.hidden_size, grad=True)
    out = mlp(x)
    first = torch.autograd.grad(out.sum(), (x, mlp.gate_proj.weight), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (x, mlp.gate_proj.weight))
    assert all(torch.equal(a, b) for a, b in zip(first, second))

    mlp.requires_grad_(False)
    assert swiglu_mlp_applies(mlp, x)
    out = mlp(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x)
    assert rel_err(grad_x, first[0]) < TOL and all(p.grad is None for p in mlp.parameters())


def test_silu_mul_matches_the_formula_and_keeps_its_inputs_only():
    """silu(a) * b (the activation of an MLP of wrapped layers) and its gradients against the formula in float64;
    it keeps a and b, not silu(a) (torch's act_fn(a) * b keeps all three); a retained graph runs backward twice."""
    torch.manual_seed(7)
    a, b = rand(B, L + 3, 40, grad=True), rand(B, L + 3, 40, grad=True)
    grad_out = rand(*a.shape)
    assert silu_mul_applies(a, b)
    with torch.no_grad():
        assert not silu_mul_applies(a, b)
    kept, out = saved_shapes(lambda: silu_mul(a, b))
    theirs, _ = saved_shapes(lambda: torch.nn.functional.silu(a) * b)
    assert len(kept) == 2 and len(theirs) == 3
    grads = torch.autograd.grad(out, (a, b), grad_out, retain_graph=True)
    again = torch.autograd.grad(out, (a, b), grad_out)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    ref = a64 * torch.sigmoid(a64) * b64
    ref_grads = torch.autograd.grad(ref, (a64, b64), grad_out.double())
    assert rel_err(out, ref) < TOL
    for got, repeated, want in zip(grads, again, ref_grads):
        assert rel_err(got, want) < TOL and torch.equal(got, repeated)


def test_swiglu_mlp_leaves_other_calls_to_the_projections_own_forward():
    """Inference, a bf16 MLP under float16 autocast, a bias, another activation, a LoRA-wrapped or hooked
    projection, a hooked activation: not the MLP's node (the projections' own forward, and `silu_mul` for the
    activation where it applies). Under bf16 autocast (Trainer's `bf16=True`) a bf16 or float32 MLP keeps it."""
    from peft import LoraConfig, get_peft_model

    mlp = swiglu_mlp_module()
    x = rand(B, L, mlp.hidden_size, grad=True)
    assert swiglu_mlp_applies(mlp, x)
    with torch.no_grad():
        assert not swiglu_mlp_applies(mlp, x)
    bf16_mlp, bf16_x = swiglu_mlp_module().to(torch.bfloat16), x.detach().bfloat16().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.float16):  # bf16 cast to float16: not what F.linear's autocast does
        assert not swiglu_mlp_applies(bf16_mlp, bf16_x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):  # a bf16 or float32 model under Trainer's bf16=True
        assert swiglu_mlp_applies(bf16_mlp, bf16_x) and swiglu_mlp_applies(mlp, x)
    assert not swiglu_mlp_applies(swiglu_mlp_module(mlp_bias=True), x)
    assert not swiglu_mlp_applies(swiglu_mlp_module(hidden_act="gelu"), x)
    lora = get_peft_model(swiglu_mlp_module(), LoraConfig(target_modules=["up_proj"], r=2)).base_model.model
    assert not swiglu_mlp_applies(lora, x)
    hooked = swiglu_mlp_module()
    hooked.down_proj.register_forward_hook(lambda *args: None)
    assert not swiglu_mlp_applies(hooked, x)
    hooked = swiglu_mlp_module()  # a hook on the activation: act_fn runs (silu_mul neither)
    hooked.act_fn.register_forward_hook(lambda *args: None)
    assert not swiglu_mlp_applies(hooked, x) and not hooked.activation_in_kernels()


class CountedKernel:
    """A Triton kernel that records its launches: `kernel[grid](...)` as the wrappers call it."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def recording_launcher(launches: list):
    """A launcher for `triton_decode._partial_softmaxes` (its `launcher` argument, or `_plain` patched), or a wrapper
    of one kernel (`recording_launcher(launches)(kernel)` patched over it), that runs each kernel and records its
    launch as (grid, keyword arguments) in `launches`."""

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs)) or self.kernel[grid](*args, **kwargs)

    return Recorded


class CutShortKernel:
    """A Triton kernel whose launch stops part-way, as an exception or an interrupt stops the interpreter between
    programs: the programs of `subgrid(grid)` run, then KeyboardInterrupt."""

    def __init__(self, kernel, subgrid):
        self.kernel, self.subgrid = kernel, subgrid

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[self.subgrid(grid)](*args, **kwargs)
            raise KeyboardInterrupt
        return launch


def linear_layer(width_in, width_out, bias=False):
    layer = torch.nn.Linear(width_in, width_out, bias=bias, device=DEVICE, dtype=DTYPE)
    torch.nn.init.normal_(layer.weight, std=width_in**-0.5)
    return layer


@pytest.mark.parametrize("tokens", [0, 1, 5, 33 if GPU else 17, 64])
def test_projections_of_a_decoding_step_match_the_formula(tokens, monkeypatch):
    """q, k, v, lambda_proj (and a fifth layer: a second launch) of a step in one launch each, every output x W^T;
    widths not a multiple of a program's rows; a LoRA-wrapped and a biased layer take their own forward, in order;
    a single plain layer stays on its forward too."""
    import modeling_diff.kernels.projection as projection
    from peft import LoraConfig, get_peft_model

    launches = []
    monkeypatch.setattr(projection, "_projections", CountedKernel(projection._projections, launches))
    torch.manual_seed(3)
    hidden = 2048 if GPU else 64
    widths = (hidden, hidden // 4, hidden // 4, 24, 40)
    layers = [linear_layer(hidden, n) for n in widths]
    x = rand(tokens, 1, hidden)  # (B, L = 1, hidden): a decoding step of `tokens` rows
    with torch.no_grad():
        outputs = projection.linear_maps(x, *layers, fused=True)
        assert len(launches) == 2
        for layer, out in zip(layers, outputs):
            assert out.shape == (tokens, 1, layer.out_features) and out.is_contiguous()  # each its own block
            assert tokens == 0 or rel_err(out, x.float() @ layer.weight.float().T) < TOL
        wrapped = get_peft_model(torch.nn.Sequential(layers[1]), LoraConfig(target_modules=["0"], r=2))
        torch.nn.init.normal_(wrapped.base_model.model[0].lora_B.default.weight)  # a LoRA update that shows
        mixed = (layers[0], wrapped.base_model.model[0], linear_layer(hidden, 8, bias=True), layers[2])
        outputs = projection.linear_maps(x, *mixed, fused=True)
        assert len(launches) == 3  # layers 0 and 3 in one launch
        for layer, out in zip(mixed, outputs):
            assert out.shape == layer(x).shape and (tokens == 0 or rel_err(out, layer(x)) < TOL)
        if tokens > 1:  # a NaN token stays in its own row, as in x W^T
            poisoned = x.clone()
            poisoned[0] = float("nan")
            out = projection.linear_maps(poisoned, *layers[:3], fused=True)[0]
            assert out[0].isnan().all() and rel_err(out[1:], x[1:].float() @ layers[0].weight.float().T) < TOL
        launched = len(launches)
        projection.linear_maps(x, *layers, fused=False)
        projection.linear_maps(rand(65, 1, hidden), *layers, fused=True)  # more rows than a step's
        projection.linear_maps(x, layers[0], wrapped.base_model.model[0], fused=True)  # one plain weight: cuBLAS
    projection.linear_maps(x, *layers, fused=True)  # gradients recorded
    assert len(launches) == launched


def test_training_projections_are_one_node_whose_gradients_match_each_layers(monkeypatch):
    """In training the plain q, k, v (and a biased layer) of one input are one autograd node: outputs and every
    gradient as each layer's own F.linear gives them, with an output left unused and a frozen weight; x's gradient
    is summed in the products (no add kernel: counted on the CPU as the ops autograd runs). A LoRA-wrapped layer,
    a bf16 input under float16 autocast or a single layer keep the layers' own forward."""
    import modeling_diff.kernels.projection as projection
    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(4)
    hidden = 256 if GPU else 32
    widths = (hidden, hidden // 4, hidden // 4)
    layers = [linear_layer(hidden, n) for n in widths] + [linear_layer(hidden, 8, bias=True)]
    layers[2].weight.requires_grad_(False)
    x = rand(3, 70, hidden, grad=True)  # more rows than a decoding step's
    grad_outputs = [rand(3, 70, layer.out_features) for layer in layers]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    ops = []
    outputs = projection.linear_maps(x, *layers, fused=True)
    assert type(outputs[0].grad_fn).__name__ == "_SharedInputLinearsBackward" and len({o.grad_fn for o in outputs}) == 1
    with Ops():
        grads = torch.autograd.grad(outputs[:3], [x] + [p for layer in layers for p in layer.parameters()
                                                     if p.requires_grad], grad_outputs[:3], allow_unused=True)
    assert not [op for op in ops if op.startswith("add.")]  # mm and addmm only
    plain = [layer(x) for layer in layers]
    references = torch.autograd.grad(plain[:3], [x] + [p for layer in layers for p in layer.parameters()
                                                       if p.requires_grad], grad_outputs[:3], allow_unused=True)
    for got, want in zip(outputs, plain):
        assert rel_err(got, want) < TOL
    for got, want in zip(grads, references):
        assert (got is None) == (want is None) and (got is None or rel_err(got, want) < TOL)
    wrapped = get_peft_model(torch.nn.Sequential(linear_layer(hidden, 8)), LoraConfig(target_modules=["0"], r=2))
    for others in ((layers[0], wrapped.base_model.model[0]), (layers[0],)):
        assert not any(type(o.grad_fn).__name__ == "_SharedInputLinearsBackward"
                       for o in projection.linear_maps(x, *others, fused=True))
    bf16_layers, bf16_x = [copy.deepcopy(layer).bfloat16() for layer in layers[:3]], x.detach().bfloat16()
    with torch.autocast(DEVICE, dtype=torch.float16):  # bf16 cast to float16: not what F.linear's autocast does
        outputs = projection.linear_maps(bf16_x.requires_grad_(), *bf16_layers, fused=True)
        assert type(outputs[0].grad_fn).__name__ != "_SharedInputLinearsBackward"
    with torch.autocast(DEVICE, dtype=torch.bfloat16):  # a bf16 or float32 model under Trainer's bf16=True
        for inputs, linears in ((bf16_x, bf16_layers), (x, layers)):
            outputs = projection.linear_maps(inputs, *linears, fused=True)
            assert type(outputs[0].grad_fn).__name__ == "_SharedInputLinearsBackward"
            assert all(out.dtype == torch.bfloat16 for out in outputs)


def test_kernel_mask_views_a_bool_mask_without_a_copy():
    """Eagerly a bool mask reaches the kernels as its own bytes viewed as uint8 (no copy kernel per layer and step),
    a broadcast batch with stride 0; other dtypes are converted."""
    from modeling_diff.kernels.masks import kernel_mask

    mask = torch.rand(1, 1, 3, 7, device=DEVICE) > 0.5
    viewed, strides = kernel_mask(mask, mask)
    assert viewed.dtype == torch.uint8 and viewed.data_ptr() == mask.data_ptr() and strides == (0, 7, 1)
    assert torch.equal(viewed.bool(), mask)
    converted, _ = kernel_mask(mask.float(), mask)
    assert converted.dtype == torch.uint8 and torch.equal(converted.bool(), mask)
    assert kernel_mask(None, mask) == (mask, (0, 0, 0))


def test_kernel_mask_traced_outside_dynamo_converts_a_bool_mask():
    """Traced with fake tensors outside Dynamo, as Inductor traces the decode op's implementation, a bool mask is
    converted, not viewed: the H200's torch 2.11 failed to lower the bool -> uint8 bit view in the compiled
    StaticCache step (tests/test_compile.py), and `is_compiling()` need not be set in such a trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from modeling_diff.kernels.masks import kernel_mask

    mask = torch.rand(2, 1, 3, 7, device=DEVICE) > 0.5
    graph = make_fx(lambda m: kernel_mask(m, m)[0], tracing_mode="fake")(mask)
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert torch.ops.aten.view.dtype not in targets and targets  # a conversion (_to_copy), no bit view
    assert torch.equal(graph(mask), mask.to(torch.uint8))


@pytest.mark.parametrize("batch, length, cos_batch, programs_per_sm", [
    (1, 1, 1, None), (4, 1, 4, None), (2, 3, 1, None), (16, 1, 16, None), (32, 1, 32, None), (1, 1, 1, 0),
    (1, 1, 1, 10**6),
])
def test_rotated_projections_match_the_products_and_transformers_rope(batch, length, cos_batch, programs_per_sm,
                                                                      monkeypatch):
    """q, k, v (and V2's lambda_proj) of a step as split products, summed and rotated in one pass: each x W^T, with
    transformers' apply_rotary_pos_emb on every head of q and k (V1's 2d-wide kv heads too: each d-wide half); cos
    and sin shared by the batch or per row; a NaN token stays in its own row; up to 16 tokens,
    ROTATED_SPLIT_MANY_PROGRAMS's launch configuration where SPLIT_FEW_TOKENS's programs (row blocks of 64 x parts)
    are more than FEW_TOKENS_PROGRAMS_PER_SM a multiprocessor (the CPU's 4: more; the GPU's: fewer; 0 and 10**6
    force either).
    Not taken: more than 32 tokens, cos of another dtype or width, a hooked layer, recorded gradients."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from modeling_diff.kernels import projection

    if programs_per_sm is not None:
        monkeypatch.setattr(projection, "FEW_TOKENS_PROGRAMS_PER_SM", programs_per_sm)
    launched = []
    launch = projection.launch_projections
    monkeypatch.setattr(projection, "launch_projections", lambda *a, **k: launched.append(a[3:5]) or launch(*a, **k))
    torch.manual_seed(6)
    width, d = 2048, 64 if GPU else 16  # split_config: 4 parts of 512 (2 of 1024 above FEW_TOKENS)
    layers = [linear_layer(width, n) for n in (8 * d, 4 * d, 4 * d, 6)]  # q, k (2 kv heads of 2d), v, lambda_proj
    x = rand(batch, length, width)
    cos, sin = rand(cos_batch, length, d), rand(cos_batch, length, d)
    expected = [x.float() @ layer.weight.float().T for layer in layers]
    heads = (batch, length, -1, d)
    rope = apply_rotary_pos_emb(expected[0].to(DTYPE).view(heads), expected[1].to(DTYPE).view(heads), cos, sin, 2)
    expected[:2] = [t.flatten(-2) for t in rope]
    assert projection.split_config(width, batch * length)[2] > 1  # the products split along K
    with torch.no_grad():
        assert projection.rotated_projections_apply(x, layers, cos, sin, d)
        out = projection.rotated_projections(x, layers, cos, sin, d)
        for got, ref in zip(out, expected):
            assert got.shape == ref.shape and got.is_contiguous() and rel_err(got, ref) < TOL
        if batch * length <= projection.FEW_TOKENS:  # (rows a program, K step)
            programs = sum(-(-layer.out_features // 64) for layer in layers) * 4  # SPLIT_FEW_TOKENS: 4 parts of 512
            one_wave = programs <= projection.FEW_TOKENS_PROGRAMS_PER_SM * _triton.sm_count(torch.device(DEVICE))
            assert launched[-1] == ((64, 512) if one_wave else (64, 256))
        poisoned = x.clone()
        poisoned[0, 0] = float("nan")
        out = projection.rotated_projections(poisoned, layers, cos, sin, d)
        for got, ref in zip(out, expected):
            assert got[0, 0].isnan().all() and not got.flatten(0, 1)[1:].isnan().any()
        assert not projection.rotated_projections_apply(rand(33, 1, width), layers, cos[:, :1], sin[:, :1], d)
        assert not projection.rotated_projections_apply(x, layers, cos.double(), sin.double(), d)
        assert not projection.rotated_projections_apply(x, layers, cos[..., :-2], sin[..., :-2], d - 2)
        assert not projection.rotated_projections_apply(x, layers[:1], cos, sin, d)
        handle = layers[2].register_forward_hook(lambda *args: None)
        assert not projection.rotated_projections_apply(x, layers, cos, sin, d)
        handle.remove()
    assert not projection.rotated_projections_apply(x, layers, cos, sin, d)  # gradients recorded


@pytest.mark.parametrize("tokens", [0, 1, 16])
def test_split_linear_matches_the_formula_and_adds_the_residual(tokens):
    """A Linear map alone (o_proj, down_proj of a step) as float32 partial products over parts of its input width,
    summed: x W^T, and residual + x W^T, at 1, 2, 4 and 8 parts (the block sizes of the H200 and smaller ones); a NaN
    token stays in its own row. Bad inputs are not taken: a residual of another shape or dtype, a layer with a hook,
    recorded gradients."""
    from modeling_diff.kernels import projection

    torch.manual_seed(5)
    width, rows = (8192, 2048) if GPU else (256, 48)
    layer = linear_layer(width, rows)
    x, residual = rand(tokens, 1, width), rand(tokens, 1, rows)
    reference = x.float() @ layer.weight.float().T
    with torch.no_grad():
        for split, step in ((1, 64), (2, 64), (4, 32), (8, 32)):
            y = torch.empty(tokens, 1, rows, dtype=DTYPE, device=DEVICE)
            if tokens:
                projection.launch_split_linear(x.view(tokens, width), layer.weight, y, None, 32, step, split, 2)
                assert rel_err(y, reference) < TOL
                projection.launch_split_linear(x.view(tokens, width), layer.weight, y, residual.view(tokens, rows),
                                               16, step, split, 2)
                assert rel_err(y, residual.float() + reference) < TOL
        assert projection.split_linear_applies(x, layer, residual)
        out = projection.split_linear(x, layer, residual)  # the block sizes of split_config
        assert out.shape == residual.shape and (tokens == 0 or rel_err(out, residual.float() + reference) < TOL)
        launches = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(projection, "_projections", CountedKernel(projection._projections, launches))
            assert projection.linear_maps(x, layer, fused=True)[0].shape == (tokens, 1, rows)
            assert len(launches) == (tokens > 0)  # the products and their sum in one launch
            projection.linear_maps(rand(17, 1, width), layer, fused=True)  # more tokens: the layer's own forward
            assert len(launches) == (tokens > 0)
        if tokens:  # every row block's ticket is back to 0 for the next launch
            assert not _triton._TICKETS[id(layer.weight)][layer.weight.device].any()
            with pytest.raises(ValueError, match="`out` and `tickets` go together"):  # a sum without its tickets
                projection.launch_projections(x.view(tokens, width), [layer.weight], y, 32, 64, 2, out=y)
        if tokens > 1:
            poisoned = x.clone()
            poisoned[0] = float("nan")
            out = projection.split_linear(poisoned, layer)
            assert out[0].isnan().all() and rel_err(out[1:], reference[1:]) < TOL
        assert not projection.split_linear_applies(rand(17, 1, width), layer)  # more tokens than it measured faster at
        assert not projection.split_linear_applies(x, layer, residual[..., :-1])  # not the output's shape
        assert not projection.split_linear_applies(x, layer, residual.double())
        handle = layer.register_forward_hook(lambda *args: None)
        assert not projection.split_linear_applies(x, layer)
        handle.remove()
    assert not projection.split_linear_applies(x, layer)  # gradients recorded


def test_a_split_launch_cut_short_leaves_no_ticket_taken(monkeypatch):
    """A split launch that stops part-way (every row block's first part ran and took its ticket, then an
    interrupt) puts the tickets back to 0, so that the next launch's sums come from its last programs and are
    x W^T."""
    from modeling_diff.kernels import projection

    torch.manual_seed(7)
    width, rows = 2048, 2048 if GPU else 48  # 4 parts of 512
    layer, x = linear_layer(width, rows), rand(2, 1, width)
    counters = projection.row_block_tickets([layer.weight], projection.SMALLEST_BLOCK_N)  # the weight's own
    with torch.no_grad():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(projection, "_projections",
                          CutShortKernel(projection._projections, lambda grid: (grid[0], 1)))
            with pytest.raises(KeyboardInterrupt):
                projection.split_linear(x, layer)
        assert projection.split_config(width, x.numel() // width)[2] > 1 and not counters.any()
        assert rel_err(projection.split_linear(x, layer), x.float() @ layer.weight.float().T) < TOL


def test_tickets_are_one_zeroed_counter_per_owner_and_device(monkeypatch):
    """The kernels' tickets (`_triton.tickets_of`): zeros on first use, the same tensor on every later call (a
    captured graph keeps its address), refused when a launch asks more than the first allocation, dropped with
    their owner; a first use inside a CUDA graph capture is refused (its zeros would be captured, not run)."""
    import gc

    owner = torch.zeros(3)
    counters = _triton.tickets_of(owner, 8, torch.device("cpu"))
    assert counters.dtype == torch.int32 and counters.shape == (8,) and not counters.any()
    assert _triton.tickets_of(owner, 4, torch.device("cpu")) is counters
    with pytest.raises(ValueError, match="tickets: 9 asked of a counter of 8"):
        _triton.tickets_of(owner, 9, torch.device("cpu"))
    key = id(owner)
    del owner, counters
    gc.collect()
    assert key not in _triton._TICKETS
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        _triton.tickets_of(torch.zeros(1), 1, torch.device("cuda", 0))


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("width", [2048, 8192, 48, 96])
def test_split_config_divides_the_width(width, tokens):
    """Every part of K a whole number of steps (the kernel's loop has no mask), at most 8 parts."""
    from modeling_diff.kernels.projection import split_config

    block_n, step, split = split_config(width, tokens)
    assert block_n == 64 and 1 <= split <= 8 and width % (split * step) == 0 and step & (step - 1) == 0


def test_steps_of_more_than_few_tokens_take_their_own_split_launch(monkeypatch):
    """The split products' launch by the step's tokens: SPLIT_FEW_TOKENS up to FEW_TOKENS, SPLIT_MORE_TOKENS above
    (here four 16-wide steps a part where the few-token launch takes one 64-wide), and q, k, v at 17 tokens so launched
    equal the formula."""
    from modeling_diff.kernels import projection

    monkeypatch.setattr(projection, "SPLIT_FEW_TOKENS", (64, 64, 8))
    monkeypatch.setattr(projection, "SPLIT_MORE_TOKENS", (64, 16, 4))
    width, d = 256, 16
    assert projection.split_config(width, projection.FEW_TOKENS) == (64, 64, 4)
    assert projection.split_config(width, projection.FEW_TOKENS + 1) == (64, 16, 4)
    torch.manual_seed(7)
    layers = [linear_layer(width, n) for n in (4 * d, 2 * d, 2 * d)]
    x = rand(projection.FEW_TOKENS + 1, 1, width)
    cos = torch.ones(1, 1, d, device=DEVICE, dtype=DTYPE)  # RoPE at position 0: the identity
    sin = torch.zeros(1, 1, d, device=DEVICE, dtype=DTYPE)
    launches = []
    monkeypatch.setattr(projection, "_projections", recording_launcher(launches)(projection._projections))
    with torch.no_grad():
        assert projection.rotated_projections_apply(x, layers, cos, sin, d)
        out = projection.rotated_projections(x, layers, cos, sin, d)
    (grid, kwargs), = launches
    assert kwargs["BLOCK_K"] == 16 and kwargs["SPLIT"] == 4 and grid[1] == 4
    for got, layer in zip(out, layers):
        assert rel_err(got, x.float() @ layer.weight.float().T) < TOL


def test_decode_chunks_are_at_most_the_programs_that_fit_at_once(monkeypatch):
    """The split-KV kernel's chunks aim at PROGRAMS_PER_SM(_FEW_TOKENS) programs a multiprocessor, and at no more than
    fit in its shared memory at once (each program's bytes and the 1 KiB the GPU reserves): V1's 128-key programs
    at 4 stages take 200 KiB of the H200's 228, so one fits, and more chunks would run in a second wave."""
    from modeling_diff.kernels import triton_decode

    device = torch.device(DEVICE)
    h200 = 228 * 1024
    monkeypatch.setattr(triton_decode, "_sm_shared_memory", lambda device: h200)
    assert triton_decode.programs_per_sm(1, 204800, device) == 1  # V1, batch 1: 128 keys, 4 stages
    assert triton_decode.programs_per_sm(1, 53248, device) == 3  # V2, DEX, batch 1: 4 fit, 3 aimed at
    assert triton_decode.programs_per_sm(32, 71680, device) == 2  # V1, batch 32: 3 fit, 2 aimed at
    assert triton_decode.programs_per_sm(1, h200, device) == 1  # never none

    launches = []
    sms = _triton.sm_count(device)
    kv_length = 64 * 6 * sms
    query, key, value = rand(1, 4, 1, 16), rand(1, 2, kv_length, 16), rand(1, 2, kv_length, 16)
    program = triton_decode.partial_shared_memory(16, 64, 4, 16, 16, DTYPE.itemsize)
    with torch.no_grad():
        for fit in (3, 1):  # programs of this launch that fit in a multiprocessor
            monkeypatch.setattr(triton_decode, "_sm_shared_memory", lambda device: fit * (program + 1024))
            triton_decode._partial_softmaxes(query, key, value, None, 0.25, recording_launcher(launches))
    # 2 kv heads: 3 programs a multiprocessor, then the 1 that fits
    assert [grid[1] for grid, _ in launches] == [3 * sms // 2, sms // 2]


@pytest.mark.parametrize("device_shared_memory", [232448, 166912, 101376])  # H200 / H100, A100, most other GPUs
def test_projection_pipelines_fit_the_devices_shared_memory(device_shared_memory, monkeypatch):
    """Loads in flight: 4 where they fit, fewer where x's and the weights' tiles would overflow a device's shared
    memory (a 64-token step asks 384 KiB at 4 stages of 512-wide tiles), never below one."""
    import modeling_diff.kernels.projection as projection

    monkeypatch.setattr(projection, "shared_memory", lambda device: device_shared_memory)
    x = torch.zeros(1, dtype=torch.bfloat16)
    for block_m, rows, width in ((16, 32, 512), (64, 32, 512), (64, 64, 256), (64, 128, 128), (64, 64, 1024)):
        stages = projection.pipeline_stages(block_m, rows, width, x)
        stage_bytes = (block_m + rows) * width * 2
        assert 1 <= stages <= 4
        assert stages == 1 or stages * stage_bytes <= device_shared_memory
        assert stages == 4 or (stages + 1) * stage_bytes > 0.9 * device_shared_memory


@pytest.mark.parametrize("tokens", [0, 1, 33 if GPU else 17])
def test_gated_projection_matches_llama_mlp(tokens):
    """silu(gate(x)) * up(x) in one launch against LlamaMLP's activation (ACT2FN["silu"], each step rounded to the
    dtype), and the MLP's output in a decoding step."""
    from transformers.activations import ACT2FN

    from modeling_diff.kernels.projection import gated_projection, gated_projection_applies

    torch.manual_seed(4)
    mlp = swiglu_mlp_module()
    x = rand(tokens, 1, mlp.hidden_size)
    with torch.no_grad():
        assert gated_projection_applies(x, mlp.gate_proj, mlp.up_proj)
        out = gated_projection(x, mlp.gate_proj, mlp.up_proj)
        ref = ACT2FN["silu"](mlp.gate_proj(x)) * mlp.up_proj(x)
        assert out.shape == ref.shape and (tokens == 0 or rel_err(out, ref) < TOL)
        assert tokens == 0 or rel_err(mlp(x), mlp.down_proj(ref)) < TOL  # the module's decoding path
        assert not gated_projection_applies(x, mlp.gate_proj, linear_layer(mlp.hidden_size, 8))  # shapes differ
        assert not gated_projection_applies(rand(65, 1, mlp.hidden_size), mlp.gate_proj, mlp.up_proj)
    assert not gated_projection_applies(x, mlp.gate_proj, mlp.up_proj)  # gradients recorded: training's node


def test_launch_arithmetic_next_power_of_2():
    """The smallest power of two >= n, for ints and for int-like values (what torch.compile traces: SymInts)."""

    class IntLike(int):  # not `int` itself: takes the branch SymInts take
        pass

    for n in (1, 2, 3, 15, 16, 17, 1000, 4096, 4097, 2**33 + 5):
        want = 2 ** math.ceil(math.log2(n))
        assert next_power_of_2(n) == want and next_power_of_2(IntLike(n)) == want


def causally_visible(length, kv_length, masked):
    """(L, S) bool: the keys each query sees before any padding. Without a mask, transformers calls SDPA with
    is_causal = L > 1, which torch aligns top-left (query i sees keys 0..i: a StaticCache prefill from empty,
    whose buffer is longer than the prompt); a mask transformers builds is causal with the queries last."""
    keys = torch.arange(kv_length, device=DEVICE)[None, :]
    queries = torch.arange(length, device=DEVICE)[:, None]
    if masked or length == 1:
        return keys <= kv_length - length + queries
    return keys <= queries


def attention_formula(q, k, v, visible, scale):
    """Per query head j: softmax(q_j k_{j // G}^T scale, masked where not visible) v_{j // G}; float64.
    q (B, Hq, L, Dq), k (B, Hkv, S, Dq), v (B, Hkv, S, Dv), visible (B, L, S) -> (B, L, Hq, Dv)."""
    groups = q.shape[1] // k.shape[1]
    out = []
    for j in range(q.shape[1]):
        scores = q[:, j].double() @ k[:, j // groups].double().transpose(-1, -2) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.softmax(scores, dim=-1) @ v[:, j // groups].double())
    return torch.stack(out, dim=2)


# (query heads, kv heads, query tokens, cached tokens, q width, v width): V1-like (q = v = 2d), V2-like (2h
# query heads), plain GQA (DEX), a short chunked prefill, and a cache longer than the split chunks
DECODE_CASES = (
    [(32, 4, 1, 2048, 128, 128), (64, 8, 1, 4096, 64, 64), (32, 8, 1, 8192, 64, 64), (32, 8, 2, 1000, 64, 64)]
    if GPU
    else [(8, 2, 1, 37, 32, 32), (6, 2, 1, 300, 16, 32), (4, 4, 3, 70, 16, 16), (2, 1, 1, 200, 16, 16)]
)


@pytest.mark.parametrize("q_heads,kv_heads,length,kv_length,q_dim,v_dim", DECODE_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_matches_the_formula(q_heads, kv_heads, length, kv_length, q_dim, v_dim, masked):
    torch.manual_seed(2)
    batch = 3
    q = rand(batch, q_heads, length, q_dim)
    k, v = rand(batch, kv_heads, kv_length, q_dim), rand(batch, kv_heads, kv_length, v_dim)
    # Unmasked: causal as transformers' SDPA call. Masked: each row also left-padded and with a few random holes
    # (a static cache's empty tail looks the same); the first row hides whole chunks of the sequence.
    visible = causally_visible(length, kv_length, masked).expand(batch, length, kv_length).clone()
    mask = None
    if masked:
        visible &= torch.rand(batch, length, kv_length, device=DEVICE) > 0.2
        visible[0, :, : kv_length * 2 // 3] = False
        visible[1, :, : kv_length // 3] = False
        visible[:, :, -1] = True
        mask = visible[:, None]  # (B, 1, L, S) bool, as transformers' sdpa mask
    scale = 1 / math.sqrt(q_dim // 2)

    out = decode_attention(q, k, v, mask, scale)

    assert out.shape == (batch, length, q_heads, v_dim)
    assert rel_err(out, attention_formula(q, k, v, visible, scale)) < TOL


def test_decode_kernel_launch_in_steps_of_at_most_16_tokens():
    """The split-KV kernel's launch: 4 pipeline stages in steps of at most 16 tokens (faster at batch 1 on the H200),
    3 above (4 made V1's batch-32 step slower); chunks for 3 programs per multiprocessor there, 2 above (3 made
    V1's batch-32 step slower)."""
    from modeling_diff.kernels import triton_decode

    launches = []
    recorded = recording_launcher(launches)
    sms = _triton.sm_count(torch.device(DEVICE))
    with torch.no_grad():
        for batch, length in ((1, 1), (16, 1), (4, 4), (17, 1), (8, 4)):
            query, key, value = rand(batch, 4, length, 16), rand(batch, 2, 24, 16), rand(batch, 2, 24, 16)
            triton_decode._partial_softmaxes(query, key, value, None, 0.25, recorded)
        assert [kwargs["num_stages"] for _, kwargs in launches] == [4, 4, 4, 3, 3]
        launches.clear()
        kv_length = 64 * 6 * sms  # chunks of whole 64-key tiles for 2 kv heads at 2 and 3 programs per SM
        for length in (16, 17):
            query, key, value = rand(1, 4, length, 16), rand(1, 2, kv_length, 16), rand(1, 2, kv_length, 16)
            triton_decode._partial_softmaxes(query, key, value, None, 0.25, recorded)
    assert [grid[1] for grid, _ in launches] == [3 * sms // 2, 2 * sms // 2]


@pytest.mark.parametrize("device_shared_memory", [232448, 166912, 101376])  # H200 / H100, A100, most other GPUs
def test_decode_kernel_tiles_fit_the_devices_shared_memory(device_shared_memory, monkeypatch):
    """Keys a tile and stages of the split-KV kernel: 128 keys at 3 stages for V1's 2d-wide values in steps of at most
    16 tokens, 64 keys above (3 stages) and for narrower values (4 stages in steps of at most 16 tokens); fewer keys,
    then fewer stages, where a program would take more than 90% of the device's shared memory
    (`partial_shared_memory`: at 64 query rows a buffer for every stage)."""
    from modeling_diff.kernels import triton_decode

    monkeypatch.setattr(triton_decode, "shared_memory", lambda device: device_shared_memory)
    device = torch.device(DEVICE)
    # (tokens, query rows a program, K width, V width) -> (keys, stages) at the H200's / the A100's / a 99 KiB
    # device's shared memory
    expected = {
        (1, 16, 128, 128): [(128, 3), (128, 3), (64, 3)],  # V1 (2d = 128): 2 tiles of 128 keys are 128 KiB
        (16, 16, 128, 128): [(128, 3), (128, 3), (64, 3)],
        (17, 16, 128, 128): [(64, 3), (64, 3), (64, 3)],
        (16, 64, 128, 128): [(64, 3), (64, 3), (64, 2)],  # a prefill of 8 tokens: 3 tiles at 3 stages
        (1, 16, 64, 64): [(64, 4), (64, 4), (64, 4)],  # V2, DEX
        (32, 16, 64, 64): [(64, 3), (64, 3), (64, 3)],
    }
    column = [232448, 166912, 101376].index(device_shared_memory)
    for (tokens, rows, k_dim, v_dim), wanted in expected.items():
        block_n, stages = triton_decode.partial_tiles(tokens, rows, k_dim, v_dim, 2, device)
        assert (block_n, stages) == wanted[column]
        taken = triton_decode.partial_shared_memory(rows, block_n, stages, k_dim, v_dim, 2)
        assert stages == 2 or taken <= 0.9 * device_shared_memory  # 2 stages: the fewest


def test_decode_kernel_shared_memory_bounds_what_triton_allocates_for_the_h200():
    """`partial_shared_memory` against the split-KV kernel compiled for sm_90a on this machine (no GPU): at 16 and 64
    query rows (at 64 Triton keeps a buffer for every stage), 64 and 128 keys, V1's and V2's widths, with and without
    a mask (its tiles are pipelined too: a StaticCache step passes one); and the
    configurations `partial_tiles` picks at the H200's shared memory fit in it."""
    pytest.importorskip("triton.backends.nvidia", reason="triton's CUDA backend (and its ptxas) is not installed")
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    script = (
        "import kernel_registers as k\n"
        "from modeling_diff.kernels.triton_decode import _decode_partial, partial_shared_memory\n"
        "for rows, n, stages, dq, dk, mask in ((16, 128, 4, 64, 128, 0), (64, 128, 4, 64, 128, 0),\n"
        "                                      (64, 64, 4, 64, 128, 0), (16, 64, 4, 64, 64, 0),\n"
        "                                      (16, 128, 4, 64, 128, 1), (16, 64, 4, 64, 64, 1)):\n"
        "    c = dict(SCALE=0.125, HAS_MASK=bool(mask), BLOCK_N=n, FIRST_N=0, PDL=True, G=8,\n"
        "             BLOCK_R=rows, DQ=dq, DK=dk, DV=dk, PAIRED=dk == 2 * dq, PRECISION=\"tf32\")\n"
        "    shared = k.compile_sm90(_decode_partial, c, 4, stages).metadata.shared\n"
        "    print(shared, partial_shared_memory(rows, n, stages, dk, dk, 2, bool(mask)))\n"
    )
    pairs = [tuple(map(int, line.split())) for line in compiled_run(script, benchmarks).split("\n") if line]
    assert len(pairs) == 6 and all(0 < shared <= bound for shared, bound in pairs), pairs
    assert pairs[0][0] <= 232448 and pairs[2][0] <= 232448  # V1's batch-1 step, a prefill's 64 rows: what runs
    assert pairs[1][0] > 232448  # 128 keys at 64 rows and 4 stages: what failed on the H200, and is not picked


def test_decode_attention_reads_strided_cache_views():
    """V1 hands the kernel views of the cache (key = K1|K2 slices are not copied)."""
    torch.manual_seed(3)
    cache = rand(2, 2, 64, 2 * 32)
    q = rand(2, 4, 1, 32)
    k, v = cache[..., :32], cache[..., 32:]
    visible = torch.ones(2, 1, 64, dtype=torch.bool, device=DEVICE)
    assert rel_err(decode_attention(q, k, v, None, 0.2), attention_formula(q, k, v, visible, 0.2)) < TOL


def test_a_float32_decoding_step_computes_in_float32_unless_torch_allows_tf32():
    """The decode kernel's products for float32 operands in full precision, as torch's float32 matmuls, not Triton's
    default TF32 (10 bits of mantissa; with it a float32 model's generate logits lay 8e-4 off eager's on an H100);
    TF32 where torch allows it (`torch.set_float32_matmul_precision("high")` or the newer
    `torch.backends.cuda.matmul.fp32_precision = "tf32"`), as for torch's. On the CPU the interpreter
    computes float32 either way: there only the choice is checked."""
    from modeling_diff.kernels._triton import dot_precision

    torch.manual_seed(4)
    q, k, v = (torch.randn(*shape, device=DEVICE) for shape in ((2, 8, 1, 64), (2, 2, 300, 64), (2, 2, 300, 64)))
    visible = torch.ones(2, 1, 300, dtype=torch.bool, device=DEVICE)
    reference = attention_formula(q, k, v, visible, 0.125)
    assert dot_precision(torch.bfloat16) == "tf32"  # (no choice for 16-bit operands: Triton's default)
    assert dot_precision(torch.float32) == "ieee" and rel_err(decode_attention(q, k, v, None, 0.125), reference) < 1e-5
    matmul = torch.backends.cuda.matmul
    # torch's two ways to allow TF32, each put back by its own (a mix of the two makes torch's older getters raise)
    legacy, newer = torch.get_float32_matmul_precision(), matmul.fp32_precision
    for allow, put_back in ((lambda: torch.set_float32_matmul_precision("high"),
                             lambda: torch.set_float32_matmul_precision(legacy)),
                            (lambda: setattr(matmul, "fp32_precision", "tf32"),
                             lambda: setattr(matmul, "fp32_precision", newer))):
        allow()
        try:
            assert dot_precision(torch.float32) == "tf32"
            assert rel_err(decode_attention(q, k, v, None, 0.125), reference) < 2e-3
        finally:
            put_back()
        assert dot_precision(torch.float32) == "ieee" and torch.get_float32_matmul_precision() == legacy


# ---- flash-diff: both maps of a differential head and the combine in one kernel ------------------------------


def flash_diff_formula(q, k, v, visible, mu, scale, norm_weight=None, eps=1e-5, norm_scale=1.0):
    """DIFF Transformer attention per differential head i (kv head i // G), float64, from the definitions:
    O_m = softmax(Q_m K_m^T scale, masked) V for the maps m = 1, 2, with K1|K2 the halves of the key (V1) or
    K1 = K2 the key (V2); V1: norm_scale * RMSNorm_w(O1 - lambda O2); V2: O1 - w O2 with a per-token w.
    q (B, L, h, 2, Dqk), k (B, h_kv, S, 2 Dqk or Dqk), v (B, h_kv, S, Dv), visible (B, L, S) -> (B, L, h, Dv).
    A query that sees no key gets 0 from each map."""
    dqk = q.shape[-1]
    k1, k2 = (k[..., :dqk], k[..., dqk:]) if k.shape[-1] == 2 * dqk else (k, k)
    groups = q.shape[2] // k.shape[1]
    heads = []
    for i in range(q.shape[2]):
        maps = []
        for m, key in ((0, k1), (1, k2)):
            scores = q[:, :, i, m].double() @ key[:, i // groups].double().transpose(-1, -2) * scale
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
            maps.append(probs @ v[:, i // groups].double())  # (B, L, Dv)
        if norm_weight is None:
            heads.append(maps[0] - mu[:, :, i, None].double() * maps[1])
        else:
            x = maps[0] - mu.double() * maps[1]
            heads.append(norm_scale * norm_weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))
    return torch.stack(heads, dim=2)


# (mode, heads, kv heads, query tokens, keys, q/k width): V1 (h differential heads of 2 x Dqk), V2 (2h query
# heads of Dqk); training (L = S) and a chunked prefill after a cache (L < S)
FLASH_CASES = (
    [("v1", 16, 4, 1024, 1024, 64), ("v2", 32, 8, 1024, 1024, 64), ("v1", 16, 4, 300, 1324, 64),
     ("v2", 32, 8, 300, 1324, 64)]
    if GPU
    else [("v1", 4, 2, 20, 20, 16), ("v2", 4, 2, 20, 20, 16), ("v1", 2, 1, 5, 23, 16), ("v2", 2, 2, 5, 23, 16),
          ("v2", 3, 1, 17, 33, 32), ("v1", 6, 2, 1, 19, 16)]  # a group of 3; one query with gradients
)


def assert_flash_diff_equals_the_formula(mode, q, k, v, visible, mask=None, scale=0.3, grad_tol=TOL):
    """flash_diff_attention of q, k, v (with V1's lambda and subln, or V2's noise weight, drawn here) against
    flash_diff_formula: the output (within TOL), and the gradients of every input (within grad_tol)."""
    batch, length, heads = q.shape[:3]
    dv = v.shape[-1]
    if mode == "v1":
        norm = Norm(dv)
        mu = torch.tensor(0.37, device=DEVICE, requires_grad=True)
        out = flash_diff_attention(q, k, v, mask, mu, scale, norm, 0.56)
        ref = flash_diff_formula(q, k, v, visible, mu, scale, norm.weight, norm.variance_epsilon, 0.56)
        inputs = (q, k, v, mu, norm.weight)
    else:
        mu = torch.sigmoid(rand(batch, length, heads)).detach().requires_grad_()
        out = flash_diff_attention(q, k, v, mask, mu, scale)
        ref = flash_diff_formula(q, k, v, visible, mu, scale)
        inputs = (q, k, v, mu)
    grad_out = rand(*out.shape)

    assert out.shape == (batch, length, heads, dv) and out.dtype == DTYPE
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out.double())
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < grad_tol


def random_flash_diff_case(mode, heads, kv_heads, length, kv_length, dqk, masked, batch=2):
    """(q, k, v, visible, mask) of random inputs: causal, and with `masked` a bool mask that also pads the second
    row on the left (its first queries see no key at all)."""
    dv = 2 * dqk if mode == "v1" else dqk
    q = rand(batch, length, heads, 2, dqk, grad=True)
    k = rand(batch, kv_heads, kv_length, 2 * dqk if mode == "v1" else dqk, grad=True)
    v = rand(batch, kv_heads, kv_length, dv, grad=True)
    visible = causally_visible(length, kv_length, masked).expand(batch, length, kv_length).clone()
    mask = None
    if masked:
        visible[1, :, : kv_length - length + 3] = False
        mask = visible[:, None]
    return q, k, v, visible, mask


@pytest.mark.parametrize("mode,heads,kv_heads,length,kv_length,dqk", FLASH_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_flash_diff_forward_and_gradients_match_the_formula(mode, heads, kv_heads, length, kv_length, dqk, masked):
    torch.manual_seed(4)
    assert_flash_diff_equals_the_formula(
        mode, *random_flash_diff_case(mode, heads, kv_heads, length, kv_length, dqk, masked)
    )


# Tiles (queries x keys) of unequal sides, as the GPU's picks are (V1's dK/dV 32 x 64, its forward 128 x 64), where
# the interpreter's one config is square; and (mode, L, S, masked): a whole number of query tiles, a bool mask, a
# chunked prefill (L < S)
UNEQUAL_TILES = [(64, 128), (128, 64)] if GPU else [(16, 32), (32, 16)]
UNEQUAL_TILE_CASES = (
    [("v1", 512, 512, False), ("v2", 300, 300, True), ("v2", 300, 1324, False), ("v1", 300, 1324, True)]
    if GPU
    else [("v1", 64, 64, False), ("v2", 40, 40, True), ("v2", 37, 101, False), ("v1", 37, 101, True)]
)


@pytest.mark.parametrize("block_m,block_n", UNEQUAL_TILES)
@pytest.mark.parametrize("mode,length,kv_length,masked", UNEQUAL_TILE_CASES)
def test_flash_diff_matches_the_formula_with_tiles_of_unequal_sides(mode, length, kv_length, masked, block_m,
                                                                    block_n, monkeypatch):
    """The kernels' causal bounds mix a tile's two sides (the forward's and dQ's keys seen by every query of a tile,
    dK/dV's first query tile of a key tile and the first that sees all its keys). All three kernels launched at
    block_m queries x block_n keys, output and gradients against the formula."""
    import modeling_diff.kernels.flash_diff as flash_diff
    import modeling_diff.kernels.triton_flash_diff as kernels

    # on a GPU at 8 warps, as the kernels' candidates of these sizes
    fixed = dict(BLOCK_M=block_m, BLOCK_N=block_n, **(dict(num_warps=8, num_stages=2) if GPU else {}))
    for launcher, kernel, config in (("flash_diff_fwd", kernels._flash_diff_fwd, "FWD_FIXED"),
                                     ("flash_diff_bwd_dkdv", kernels._flash_diff_bwd_dkdv, "DKDV_FIXED"),
                                     ("flash_diff_bwd_dq", kernels._flash_diff_bwd_dq, "DQ_FIXED")):
        monkeypatch.setattr(flash_diff, launcher, kernel)  # the kernel itself, not its autotuner (on a GPU)
        monkeypatch.setattr(flash_diff, config, fixed)
    monkeypatch.setattr(flash_diff, "DKDV_WHOLE_TILES_OF", block_m)
    torch.manual_seed(5)
    heads, kv_heads, dqk = (4, 2, 64) if GPU else (4, 2, 16)
    assert_flash_diff_equals_the_formula(
        mode, *random_flash_diff_case(mode, heads, kv_heads, length, kv_length, dqk, masked)
    )


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_flash_diff_keeps_a_sequences_nan_keys_out_of_the_others(mode):
    """The forward and dQ kernels read keys and values through TMA as one matrix of every sequence's tokens (the
    projections' layout, key (B, S, h_kv, d) seen as (B, h_kv, S, d)): a last tile that reaches past S holds the
    next sequence's first keys. With NaN keys and values in sequence 1 (the attack), sequence 0's output and
    gradients equal those of sequence 0 alone, and are finite. S = 20 is no whole number of tiles (16 under the
    interpreter, 64 on a GPU with 1000)."""
    torch.manual_seed(6)
    batch, length, heads, kv_heads, dqk = 2, 20 if not GPU else 1000, 4, 2, 16 if not GPU else 64
    dv = 2 * dqk if mode == "v1" else dqk
    q = rand(batch, length, heads, 2, dqk)
    k = rand(batch, length, kv_heads, 2 * dqk if mode == "v1" else dqk)
    v = rand(batch, length, kv_heads, dv)
    k[1], v[1] = float("nan"), float("nan")
    norm = Norm(dv) if mode == "v1" else None
    mu = torch.tensor(0.37, device=DEVICE) if mode == "v1" else torch.sigmoid(rand(batch, length, heads))
    grad_out = rand(batch, length, heads, dv)

    def first_sequence(q, k, v, mu):  # output and gradients of sequence 0, from keys laid out (B, S, h_kv, d)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_diff_attention(q, k.transpose(1, 2), v.transpose(1, 2), None, mu, 0.3, norm, 0.56)
        grads = torch.autograd.grad(out, (q, k, v), grad_out[: len(out)])
        return [t[0] for t in (out, *grads)]

    together = first_sequence(q, k, v, mu)
    alone = first_sequence(q[:1], k[:1], v[:1], mu if mode == "v1" else mu[:1])
    for got, want in zip(together, alone):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_flash_diff_forward_is_exact_when_later_keys_outscore_earlier_ones_by_far(mode):
    """The forward's online softmax rescales what it has summed whenever a key tile raises a row's maximum. Keys in
    three segments of whole tiles: in the second every query's score (base 2) is 5 above the first's, in the third
    200 above, where a sum left at the first tiles' maximum would overflow float32 (2^200). Output and gradients
    against the formula. On the GPU the gradients within 10%: every query's dQ = scale dS K sums keys that share a
    large common part (what raises the scores), whose sum cancels (the rows of dS sum to 0), and the dS the kernel
    multiplies is rounded to bfloat16 (as every FlashAttention backward's), which leaves its rows' sums off 0: the
    formula in float64 with dS alone rounded so is off by 2.6% in dQ (the GPU case's shapes, V2, on the CPU); the
    kernels' dQ was off by 5.0% (V1) and 4.8% (V2) on the H200 at 7fa55fc, failing the 2% it was held to then. A
    forward that skipped the rescale would be off by far more, or not finite."""
    torch.manual_seed(5)
    segment, dqk, heads, kv_heads = (128, 64, 4, 2) if GPU else (16, 16, 2, 1)
    scale, length = 0.3, 3 * segment
    dv = 2 * dqk if mode == "v1" else dqk
    base2 = scale * math.log2(math.e)  # a score's base-2 exponent per unit of Q.K
    # every query (a, a, ..., a); the segments' keys a little noise plus (c, c, ..., c): scores dqk a c base2 above
    # the first segment's. a = c in the third, so that no factor is large (bf16's dS times a large key would lose
    # the gradients' digits in the cancellation of dQ = dS K's rows)
    a = math.sqrt(200.0 / (base2 * dqk))
    q = torch.full((1, length, heads, 2, dqk), a, device=DEVICE)
    k = 0.1 * torch.randn(1, kv_heads, length, 2 * dqk if mode == "v1" else dqk, device=DEVICE)
    for first, rise in ((segment, 5.0), (2 * segment, 200.0)):
        k[:, :, first:first + segment] += rise / (base2 * a * dqk)
    v = torch.randn(1, kv_heads, length, dv, device=DEVICE)
    q, k, v = (t.to(DTYPE).requires_grad_() for t in (q, k, v))
    visible = causally_visible(length, length, False)[None]
    # on the CPU (float32) the largest scores, 200 / log2(e) = 139, are rounded to a float32 ulp there (1.5e-5), an
    # error every probability's exponent inherits: the gradients within 4 such ulps (Triton's interpreter gave
    # 1.04e-5 in V1's dQ with numpy 2.4.6, 3e-6 to 8e-6 in the other gradients)
    score_ulp = torch.finfo(torch.float32).eps * 2 ** math.floor(math.log2(200 / math.log2(math.e)))
    assert_flash_diff_equals_the_formula(mode, q, k, v, visible, scale=scale, grad_tol=0.1 if GPU else 4 * score_ulp)


def test_kernels_loop_over_bounds_known_at_run_time_as_on_the_gpu():
    """The kernels' loops run over bounds computed in the program (a causal key range), under the interpreter as on
    a GPU: the interpreter's scalars are arrays of one element, which NumPy 2.4 refuses to turn into a loop bound
    (`int`) unmended (`_triton.interpreter_takes_runtime_loop_bounds`, idempotent). The kernel sums 0 .. n - 1 for a
    program's n = 3 + its id."""
    import triton
    import triton.language as tl

    @triton.jit
    def sum_below(Out):
        n = 3 + tl.program_id(0)
        total = 0
        for i in range(0, n):
            total += i
        tl.store(Out + tl.program_id(0), total)

    _triton.interpreter_takes_runtime_loop_bounds()  # again: already mended at import under the interpreter
    out = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    sum_below[(4,)](out)
    assert out.tolist() == [sum(range(3 + p)) for p in range(4)]


TRITON_ATTACKS = {
    # a triton that reports 3.3
    "older": "real = importlib.metadata.version\n"
             "importlib.metadata.version = lambda name: '3.3.0' if name == 'triton' else real(name)\n",
    # no triton at all: neither its metadata nor its import
    "none": "sys.modules['triton'] = None\n"
            "real = importlib.metadata.version\n"
            "def version(name):\n"
            "    if name == 'triton':\n"
            "        raise importlib.metadata.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "importlib.metadata.version = version\n",
}


@pytest.mark.parametrize("attack", list(TRITON_ATTACKS))
def test_an_older_triton_or_none_leaves_the_model_on_its_pytorch_paths(attack):
    """The kernels need triton >= 3.4 (host tensor descriptors' `load`). A triton that reports 3.3, or none (the
    attacks, in a fresh process), is not taken: the package imports, no kernel module is, and every mode trains a
    step and generates with a StaticCache on the PyTorch paths."""
    assert _triton.triton_is_recent("3.4.0") and _triton.triton_is_recent("3.6.0+git1a2b3c")
    assert not _triton.triton_is_recent("3.3.1") and not _triton.triton_is_recent("2.3.0")
    script = (
        "import importlib.metadata, sys, torch\n"
        + TRITON_ATTACKS[attack]
        + "from modeling_diff import DiffLlamaForCausalLM, preset_config\n"
        "from modeling_diff.kernels import _triton\n"
        "for mode in ('v1', 'v2', 'dex'):\n"
        "    model = DiffLlamaForCausalLM(preset_config(f'tiny-{mode}', hidden_size=64))\n"
        "    ids = torch.randint(3, model.config.vocab_size, (1, 12))\n"
        "    model(ids, labels=ids).loss.backward()\n"
        "    model.eval().generate(ids, max_new_tokens=3, do_sample=False, cache_implementation='static')\n"
        "print(_triton.TRITON_AVAILABLE, 'modeling_diff.kernels.triton_flash_diff' in sys.modules)\n"
    )
    assert compiled_run(script).split() == ["False", "False"]


def test_flash_diff_reads_the_projections_key_layout_as_it_is_and_copies_others():
    """Keys as the projections give them ((B, S, h_kv, d) transposed, also a slice of a wider fused row) go to the
    TMA descriptors as they are; head-major keys, or keys off TMA's 16-byte alignment, are copied into that layout
    (equal values)."""
    from modeling_diff.kernels.flash_diff import _tokens_as_rows, _with_tokens_as_rows

    batch, tokens, heads, d = 2, 20, 3, 16
    projected = torch.randn(batch, tokens, heads, d).transpose(1, 2)
    fused_row = torch.randn(batch, tokens, 5 * heads * d)[..., : heads * d].view(batch, tokens, heads, d).transpose(1, 2)
    head_major = torch.randn(batch, heads, tokens, d)
    off_alignment = torch.randn(batch * tokens * heads * d + 1)[1:].view(batch, tokens, heads, d).transpose(1, 2)
    for key in (projected, fused_row):
        assert _tokens_as_rows(key) and _with_tokens_as_rows(key) is key
    for key in (head_major, off_alignment):
        copied = _with_tokens_as_rows(key)
        assert not _tokens_as_rows(key) and _tokens_as_rows(copied) and torch.equal(copied, key)


def test_the_flash_diff_autotuners_tune_once_a_power_of_4_of_keys(monkeypatch):
    """Every launch of the three flash-diff kernels passes KEYS_BUCKET, which the autotuners key on (on a GPU):
    ceil(log2(keys)) // 2, so 2049-8192 keys share one tuning, 8193-32768 the next; a prefill's chunk against the
    cache's keys takes the bucket of the keys."""
    import modeling_diff.kernels.flash_diff as flash_diff
    import modeling_diff.kernels.triton_flash_diff as kernels

    for keys in (2, 3, 4, 5, 1000, 1024, 1025, 2048, 2049, 4096, 8192, 8193, 32768, 32769, 65536, 131072):
        assert kernels.keys_bucket(keys) == math.ceil(math.log2(keys)) // 2, keys
    assert kernels.keys_bucket(1) == 0
    for tuned in (kernels.flash_diff_fwd, kernels.flash_diff_bwd_dkdv, kernels.flash_diff_bwd_dq):
        if hasattr(tuned, "keys"):  # an autotuner (on a GPU; the interpreter launches one config)
            assert "KEYS_BUCKET" in tuned.keys

    buckets = []
    for name in ("flash_diff_fwd", "flash_diff_bwd_dkdv", "flash_diff_bwd_dq"):
        kernel = getattr(flash_diff, name)

        class Recorded:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    buckets.append((name, kwargs["KEYS_BUCKET"]))
                    return kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(flash_diff, name, Recorded())
    torch.manual_seed(5)
    queries, keys, heads, dqk = 16, 48, 2, 16  # a chunk of 16 queries against 48 keys (32 cached)
    q = rand(1, queries, heads, 2, dqk, grad=True)
    k, v = rand(1, 1, keys, dqk, grad=True), rand(1, 1, keys, dqk, grad=True)
    mask = torch.ones(1, 1, queries, keys, dtype=torch.bool, device=DEVICE).tril(keys - queries)
    out = flash_diff_attention(q, k, v, mask, rand(1, queries, heads).sigmoid(), 0.25)
    out.backward(rand(*out.shape))
    assert buckets == [(name, math.ceil(math.log2(keys)) // 2)
                       for name in ("flash_diff_fwd", "flash_diff_bwd_dkdv", "flash_diff_bwd_dq")]


def test_flash_diff_programs_start_longest_first(monkeypatch):
    """Under causal masking the programs of a flash-diff launch have unequal work: a query block sees the keys up to
    its last query, a key block is seen by the queries from its first key on. The GPU starts programs in the order
    of their ids, grid axis 0 fastest. In that order no program of the forward, dK/dV or dQ launch has more work
    than one started before it, so no long program starts in a launch's last wave (the tail that left the dK/dV
    kernel's SMs idle). Each program's block is read as the kernel reads it, from the rows its tiles get, under
    Triton's interpreter: on a GPU machine the test runs again in a process that sees no GPU."""
    if GPU:
        test = f"{__file__}::test_flash_diff_programs_start_longest_first"
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                             cwd=Path(__file__).parent, env=env, capture_output=True, text=True)
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]
        return
    import inspect

    import modeling_diff.kernels.triton_flash_diff as kernels
    from triton.runtime.interpreter import interpreter_builder

    first_rows = {}  # (tile function, program ids) -> the first query (forward, dQ) or key (dK/dV) of its block
    for name, rows in (("_fwd_tile", "m"), ("_dq_tile", "m"), ("_dkdv_tile", "n")):
        tile = getattr(kernels, name)

        def recorded(*args, tile=tile, name=name, rows=rows, **kwargs):
            block = inspect.signature(tile.fn).bind(*args, **kwargs).arguments[rows]
            first_rows[name, interpreter_builder.grid_idx] = int(block.handle.data.min())
            return tile(*args, **kwargs)

        monkeypatch.setattr(kernels, name, recorded)
    torch.manual_seed(4)
    batch, length, heads, kv_heads, dqk = 2, 40, 4, 2, 16  # 3 query and 3 key blocks of 16
    q = rand(batch, length, heads, 2, dqk, grad=True)
    k, v = rand(batch, kv_heads, length, 2 * dqk, grad=True), rand(batch, kv_heads, length, 2 * dqk, grad=True)
    out = flash_diff_attention(q, k, v, None, torch.tensor(0.4, device=DEVICE), 0.3, Norm(2 * dqk))
    out.backward(rand(*out.shape))

    for name, work in (("_fwd_tile", lambda first: first), ("_dq_tile", lambda first: first),
                       ("_dkdv_tile", lambda first: length - first)):
        programs = {ids: first for (tile, ids), first in first_rows.items() if tile == name}
        grid = [max(ids[axis] for ids in programs) + 1 for axis in (0, 1)]
        assert len(programs) == grid[0] * grid[1] and sorted(set(programs.values())) == [0, 16, 32], name
        started = [work(programs[x, y, 0]) for y in range(grid[1]) for x in range(grid[0])]  # axis 0 fastest
        assert started == sorted(started, reverse=True), (name, started)


@pytest.mark.parametrize("mode", ["v1", "v2"])
@pytest.mark.parametrize("bias", [False, True])
def test_flash_diff_with_o_proj_matches_the_formula_and_keeps_no_combined_heads(mode, bias):
    """o_proj in the kernel's autograd node: o_proj(formula) and the gradients of q, k, v, the coefficient, the
    norm and o_proj in float64; the node keeps the pairs and no (B, L, h, DV) combined heads (what a separate o_proj
    would keep); a frozen o_proj gets no gradient and the rest the same. A gradient is within TOL of the formula's,
    or no further from it than twice the same gradient through the kernel and a separate o_proj: in bf16 V1's
    lambda gradient, one sum over every element, cancels (0.037 off the formula on the H200 with a bias)."""
    torch.manual_seed(5)
    batch, length, heads, kv_heads, dqk, hidden = 2, 20, 4, 2, 16, 40
    dv = 2 * dqk if mode == "v1" else dqk
    q = rand(batch, length, heads, 2, dqk, grad=True)
    k = rand(batch, kv_heads, length, 2 * dqk if mode == "v1" else dqk, grad=True)
    v = rand(batch, kv_heads, length, dv, grad=True)
    o_proj = torch.nn.Linear(heads * dv, hidden, bias=bias, device=DEVICE, dtype=DTYPE)
    visible = causally_visible(length, length, False).expand(batch, length, length)
    if mode == "v1":
        norm, mu = Norm(dv), torch.tensor(0.37, device=DEVICE, requires_grad=True)
        call = lambda o_proj=o_proj: flash_diff_attention(q, k, v, None, mu, 0.3, norm, 0.56, o_proj=o_proj)  # noqa: E731
        combined = flash_diff_formula(q, k, v, visible, mu, 0.3, norm.weight, norm.variance_epsilon, 0.56)
        inputs = (q, k, v, mu, norm.weight)
    else:
        mu = torch.sigmoid(rand(batch, length, heads)).detach().requires_grad_()
        call = lambda o_proj=o_proj: flash_diff_attention(q, k, v, None, mu, 0.3, o_proj=o_proj)  # noqa: E731
        combined = flash_diff_formula(q, k, v, visible, mu, 0.3)
        inputs = (q, k, v, mu)
    weights = tuple(o_proj.parameters())
    ref = torch.nn.functional.linear(combined.flatten(-2), *(w.double() for w in weights))
    kept, out = saved_shapes(call)
    grad_out = rand(*out.shape)

    assert out.shape == (batch, length, hidden) and rel_err(out, ref) < TOL
    grads = torch.autograd.grad(out, inputs + weights, grad_out)
    ref_grads = torch.autograd.grad(ref, inputs + weights, grad_out.double())
    separate = torch.autograd.grad(o_proj(call(None).flatten(-2)), inputs + weights, grad_out)
    for got, want, apart in zip(grads, ref_grads, separate):
        assert got.shape == want.shape and rel_err(got, want) < max(TOL, 2 * rel_err(apart, want))
    rows = batch * length * heads
    combined_shapes = {(batch, length, heads * dv), (batch, length, heads, dv), (rows, dv)}
    assert not combined_shapes & set(kept) and (rows, 2, dv) in kept  # the pairs, not the combined heads

    o_proj.requires_grad_(False)
    frozen = torch.autograd.grad(call(), inputs, grad_out)
    assert all(rel_err(got, want) < TOL for got, want in zip(frozen, grads))
    assert all(w.grad is None for w in weights)


# (mode, heads, kv heads, query tokens, cached tokens, q/k width): decoding steps of V1 (16 heads of 2 x 64 over 4
# kv heads of 128), V2 (64 query heads over 8) and DEX (32 heads over 8); a few tokens at once; a GQA group of 6
COMBINED_DECODE_CASES = (
    [("v1", 16, 4, 1, 2048, 64), ("v2", 32, 8, 1, 4096, 64), ("dex", 32, 8, 1, 4096, 64), ("v1", 16, 4, 2, 1000, 64)]
    if GPU
    else [("v1", 4, 2, 1, 37, 16), ("v2", 4, 2, 1, 300, 16), ("dex", 4, 2, 1, 150, 16), ("v1", 2, 2, 3, 70, 16),
          ("v2", 3, 1, 2, 50, 32), ("dex", 6, 1, 2, 40, 32), ("v1", 2, 2, 1, 300, 64)]  # the last: 128-key tiles
)


def combined_decode_step(mode, heads, kv_heads, length, kv_length, dqk, visible, anneal_steps):
    """A combined decoding step's inputs and its reference from the definitions: (q, k, v, combine, ref).
    visible (B, L, S); V2, DEX anneal at t = 10 of T = anneal_steps (0: annealing off)."""
    from modeling_diff.kernels import DexCombine, V1Combine, V2Combine

    batch, dv = visible.shape[0], 2 * dqk if mode == "v1" else dqk
    q_heads = heads if mode == "dex" else 2 * heads
    q = rand(batch, length, q_heads, dqk).transpose(1, 2)  # (B, Hq, L, Dqk): a view, as the modules pass it
    k = rand(batch, kv_heads, kv_length, 2 * dqk if mode == "v1" else dqk)
    v = rand(batch, kv_heads, kv_length, dv)
    step = torch.tensor(10.0, device=DEVICE)
    fraction = 10.0 / anneal_steps if anneal_steps else 1.0  # t / T
    pairs = q.transpose(1, 2).unflatten(2, (-1, 2))  # (B, L, h, 2, Dqk) for V1's and V2's formula
    if mode == "v1":
        norm = Norm(dv)
        vectors = [0.1 * torch.randn(dqk, device=DEVICE) for _ in range(4)]  # lambda_q1, lambda_k1, lambda_q2, ..k2
        lam = (vectors[0].double() @ vectors[1].double()).exp() - (vectors[2].double() @ vectors[3].double()).exp() + 0.44
        combine = V1Combine(tuple(vectors), 0.44, norm.weight, norm.variance_epsilon, 0.56)
        ref = flash_diff_formula(pairs, k, v, visible, lam, 0.3, norm.weight, norm.variance_epsilon, 0.56)
    elif mode == "v2":
        logits = rand(batch, length, heads)
        combine = V2Combine(logits, step, anneal_steps)
        ref = flash_diff_formula(pairs, k, v, visible, torch.sigmoid(logits.double()) * min(1.0, fraction), 0.3)
    else:
        operator = 0.2 * rand(dv, dv)
        head_mask = (torch.arange(heads, device=DEVICE) % 3 != 1).to(DTYPE)  # some heads without the operator
        learn = torch.tensor(0.3, device=DEVICE)
        a = min(1.0, fraction)
        lam = (1 - a) * fraction * 0.44 + a * 0.3
        combine = DexCombine(operator, head_mask, learn, step, anneal_steps, 0.44)
        heads_out = attention_formula(q, k, v, visible, 0.3).nan_to_num(0.0)  # (B, L, h, Dv); no key seen: 0
        ref = heads_out - lam * head_mask.double()[:, None] * (heads_out @ operator.double().T)
    return q, k, v, combine, ref


@pytest.mark.parametrize("mode,heads,kv_heads,length,kv_length,dqk", COMBINED_DECODE_CASES)
@pytest.mark.parametrize("masked", [False, True])
@torch.no_grad()
def test_combined_decode_attention_matches_the_formula(mode, heads, kv_heads, length, kv_length, dqk, masked,
                                                     monkeypatch):
    """The decode kernel with each mode's differential term in its reduce, the coefficients computed in the kernel
    (V1's lambda from its vectors, V2's noise weight from the logits, DEX's lambda(t)) against the definitions.
    V1 at 2d = 128 in steps of at most 16 tokens takes 128-key tiles (on the CPU too: its float32 tiles fit here)."""
    from modeling_diff.kernels import combined_decode_attention, triton_decode

    if not GPU:
        monkeypatch.setattr(triton_decode, "shared_memory", lambda device: 1 << 20)
    dv = 2 * dqk if mode == "v1" else dqk
    block_n, _ = triton_decode.partial_tiles(3 * length, 16, dv if mode == "v1" else dqk, dv, DTYPE.itemsize,
                                             torch.device(DEVICE))
    assert block_n == (128 if 3 * length <= 16 and dv >= 128 else 64)  # steps of at most 16 tokens

    torch.manual_seed(5)
    batch = 3
    visible = causally_visible(length, kv_length, masked).expand(batch, length, kv_length).clone()
    mask = None
    if masked:  # left padding, and the first row hides most chunks
        visible[0, :, : kv_length * 2 // 3] = False
        visible[1, :, :5] = False
        mask = visible[:, None]
    # V2, DEX: annealing at t = 10 of T = 40 with a mask, off without (T = 0)
    q, k, v, combine, ref = combined_decode_step(
        mode, heads, kv_heads, length, kv_length, dqk, visible, 40 if masked else 0
    )
    out = combined_decode_attention(q, k, v, mask, 0.3, combine)
    assert out.shape == (batch, length, heads, ref.shape[-1]) and out.dtype == DTYPE
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
@pytest.mark.parametrize("programs, prefetched", [(3, 128), (3, 64), (2, 256)])
@torch.no_grad()
def test_combined_decode_after_the_projections_write_reads_the_new_positions(mode, programs, prefetched, monkeypatch):
    """Where the projections' launch stored the step's keys and values (`advance`: the layer's length before the
    step), the kernel reads the first keys of each chunk before its wait, all but the step's positions, and those
    after it (FIRST_N), then advances the length: the output equals the definitions wherever the new positions fall
    (the first tile of a chunk, a later one, the cache's last positions), and the length grows by the step's tokens.
    Chunks of 128 keys read whole before the wait, or 64 then a tile in the loop; chunks of 192 keys and 256 read
    before the wait (past the chunk: not counted twice). A corrupted length (negative, past the cache) reads the
    same keys, split otherwise between the two reads."""
    from modeling_diff.kernels import combined_decode_attention, triton_decode

    torch.manual_seed(7)
    batch, heads, kv_heads, length, kv_length, dqk = 2, 4, 2, 2, 300, 16
    assert _triton.sm_count(torch.device(DEVICE)) == 4 or GPU  # on the CPU: 4 multiprocessors
    monkeypatch.setattr(triton_decode, "PROGRAMS_PER_SM_FEW_TOKENS", programs)  # chunks of 128 (3) or 192 (2) keys
    key_bytes = 2 * (2 * dqk if mode == "v1" else dqk) * DTYPE.itemsize  # a key's and its value's
    monkeypatch.setattr(triton_decode, "PREFETCH_MAX_BYTES", prefetched * key_bytes)
    launches = []
    monkeypatch.setattr(triton_decode, "_plain", recording_launcher(launches))
    # a corrupted length (negative, past the cache) moves the split between the two reads, never what is read
    for written in (0, 63, 64, 130, kv_length - length, -5, kv_length + 10):
        last = min(max(written, 0), kv_length - length)  # the step's first position, for the mask
        position = last + torch.arange(length, device=DEVICE)
        visible = (torch.arange(kv_length, device=DEVICE)[None, :] <= position[:, None]).expand(batch, -1, -1)
        q, k, v, combine, ref = combined_decode_step(mode, heads, kv_heads, length, kv_length, dqk, visible, 0)
        advance = torch.tensor([written], device=DEVICE)
        out = combined_decode_attention(q, k, v, visible[:, None], 0.3, combine, advance=advance)
        assert rel_err(out, ref) < TOL, written
        assert advance.item() == written + length
    # the partial kernel's launches (the reduce's have no FIRST_N); on another GPU without PDL: 0
    assert {kwargs["FIRST_N"] for _, kwargs in launches if "FIRST_N" in kwargs} == {prefetched} or GPU


@pytest.mark.parametrize("chunks, warps", [(3, 1), (4, 1), (5, 4), (10, 4)])
@torch.no_grad()
def test_the_combined_reduce_takes_one_warp_where_it_merges_few_chunks(chunks, warps, monkeypatch):
    """A differential mode's reduce runs one warp a program where it merges at most REDUCE_FEW_SPLITS chunks a row
    (batch 32's steps: faster on the H200), REDUCE_NUM_WARPS where more (batch 1: a warp would hold every chunk's
    output), and the output is the definitions' either way."""
    from modeling_diff.kernels import combined_decode_attention, triton_decode

    monkeypatch.setattr(triton_decode, "PARTIAL_BLOCK_N", 16)
    for name in ("PROGRAMS_PER_SM", "PROGRAMS_PER_SM_FEW_TOKENS"):  # a chunk per 16 keys
        monkeypatch.setattr(triton_decode, name, 1 << 20)
    launches = []
    monkeypatch.setattr(triton_decode, "_decode_reduce_combined",
                        recording_launcher(launches)(triton_decode._decode_reduce_combined))
    torch.manual_seed(9)
    visible = causally_visible(1, 16 * chunks, False).expand(2, 1, 16 * chunks)
    q, k, v, combine, ref = combined_decode_step("v1", 2, 1, 1, 16 * chunks, 16, visible, 0)
    out = combined_decode_attention(q, k, v, None, 0.3, combine)
    assert rel_err(out, ref) < TOL
    (_, kwargs), = launches
    assert kwargs["num_warps"] == warps and triton_decode.REDUCE_NUM_WARPS == 4


# (mode, heads, kv heads, query tokens, cached tokens, q/k width); mode None: plain attention of `heads` query
# heads. Cut into chunks of 16 keys, each row merges 9 to 10 chunks (MAX_SPLITS 16: dead chunks too).
MANY_SPLITS_CASES = [
    (None, 6, 2, 1, 150, 16), (None, 4, 4, 3, 130, 32), ("v1", 6, 2, 1, 150, 16), ("v2", 3, 1, 2, 140, 16),
    ("dex", 6, 2, 1, 150, 16),
]


@pytest.mark.parametrize("mode,heads,kv_heads,length,kv_length,dqk", MANY_SPLITS_CASES)
@pytest.mark.parametrize("masked", [False, True])
@torch.no_grad()
def test_decode_attention_merges_many_splits(mode, heads, kv_heads, length, kv_length, dqk, masked, monkeypatch):
    """The reduce's merge of many chunks: the split-KV kernel's chunks at their shortest (16 keys, the smallest
    tile) and as many as the cache has. Masked: whole chunks hidden at the start (first row) and in the middle
    (second row), and a row that sees no key at all (third row), whose output is 0."""
    import modeling_diff.kernels.triton_decode as triton_decode
    from modeling_diff.kernels import combined_decode_attention

    monkeypatch.setattr(triton_decode, "PARTIAL_BLOCK_N", 16)
    for name in ("PROGRAMS_PER_SM", "PROGRAMS_PER_SM_FEW_TOKENS"):  # a chunk per BLOCK_N keys
        monkeypatch.setattr(triton_decode, name, 1 << 20)
    torch.manual_seed(6)
    batch = 3
    visible = causally_visible(length, kv_length, masked).expand(batch, length, kv_length).clone()
    mask = None
    if masked:
        visible[0, :, : kv_length * 2 // 3] = False
        visible[1, :, 32:80] = False  # chunks 2 to 4
        visible[1] &= torch.rand(length, kv_length, device=DEVICE) > 0.2
        visible[2] = False
        mask = visible[:, None]
    if mode is None:
        q = rand(batch, heads, length, dqk)
        k, v = rand(batch, kv_heads, kv_length, dqk), rand(batch, kv_heads, kv_length, dqk)
        out = decode_attention(q, k, v, mask, 0.3)
        ref = attention_formula(q, k, v, visible, 0.3).nan_to_num(0.0)
    else:
        q, k, v, combine, ref = combined_decode_step(mode, heads, kv_heads, length, kv_length, dqk, visible, 40)
        out = combined_decode_attention(q, k, v, mask, 0.3, combine)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < TOL
    if masked:
        assert out[2].abs().max() == 0


# ---- the model on the fast paths --------------------------------------------------------------------------


def model_pair(mode, fast_implementation, **config):
    """The same weights twice: eager (the reference) and the fast implementation; `config`: more config fields."""
    if GPU:  # two layers of the ~1.1B shape
        overrides = dict(preset_config(f"1.1b-{mode}").to_diff_dict(), num_hidden_layers=2, vocab_size=1000)
        overrides = {k: v for k, v in overrides.items() if k not in ("model_type", "transformers_version")}
    else:  # heads of 16, the kernels' smallest tile
        overrides = dict(head_dim=16)
    overrides.update(config)
    eager = tiny_model(mode, **overrides).to(DEVICE, DTYPE)
    fast = tiny_model(mode, attn_implementation=fast_implementation, **overrides).to(DEVICE, DTYPE)
    fast.load_state_dict(eager.state_dict())
    return eager, fast


def padded_batch(vocab, batch=2, length=12, pad=4):
    ids = torch.randint(3, vocab, (batch, length), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding
    ids[1, :pad] = 0
    return ids, mask


FAST = "sdpa" if GPU else "diff_triton"  # what a model on CUDA gets by default


@pytest.fixture
def without_flash_attn_4(monkeypatch):
    """FlashAttention-4 turned off (`MODELING_DIFF_FLASH_ATTN_4=0`'s switch), for tests of where the flash-diff kernel
    runs: where the package is installed, V2's and DEX's plain causal calls go to it instead (test_flash_attn_4.py)."""
    from modeling_diff.kernels import flash_attn_4

    monkeypatch.setattr(flash_attn_4, "ENABLED", False)


BEYOND_V2_KEYS = "beyond V2's flash_diff_max_keys"  # the default where V2 takes no kernel: more keys, no training


@pytest.mark.parametrize(
    "mode, implementation",
    [(mode, implementation) for implementation in (FAST, "fused_diff") for mode in MODES] + [("v2", BEYOND_V2_KEYS)],
)
def test_fast_path_forward_and_gradients_equal_eager(mode, implementation, monkeypatch, without_flash_attn_4):
    """The fast paths equal eager: by default V1 through the flash-diff kernel, V2 too in training and up to 4096
    keys, and otherwise (here with both of V2's rules off, as in inference beyond 4096 keys) through one SDPA call
    and the fused combine, DEX through SDPA; `fused_diff` puts V1 and V2 on the kernel. RoPE, the decoder's RMSNorm
    and the MLP take their Triton kernels on all of them. Without FlashAttention-4 (where it is installed, V2 and DEX
    take it instead: test_flash_attn_4.py checks those models against eager)."""
    import modeling_diff.diff_attention as attention

    import modeling_diff.kernels.rope as rope
    import modeling_diff.modeling_diff_llama as modeling

    kernel_calls, rope_calls, norm_calls, add_norm_calls, mlp_calls = [], [], [], [], []
    kernel, rotate, norm, mlp = attention.flash_diff_attention, rope._rotate, modeling.rms_norm, modeling.swiglu_mlp
    add_norm = modeling.add_rms_norm
    monkeypatch.setattr(attention, "flash_diff_attention", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(rope, "_rotate", lambda *a, **k: rope_calls.append(1) or rotate(*a, **k))
    monkeypatch.setattr(modeling, "rms_norm", lambda *a: norm_calls.append(1) or norm(*a))
    monkeypatch.setattr(modeling, "add_rms_norm", lambda *a: add_norm_calls.append(1) or add_norm(*a))
    deferred = recorded_deferrals(monkeypatch)
    monkeypatch.setattr(modeling, "swiglu_mlp", lambda *a: mlp_calls.append(1) or mlp(*a))
    on_kernel = mode in ("v1", "v2")
    if implementation == BEYOND_V2_KEYS:  # these lengths' keys count as more than the kernel takes, training too
        monkeypatch.setattr(attention.DiffAttentionV2, "flash_diff_max_keys", 0)
        monkeypatch.setattr(attention.DiffAttentionV2, "flash_diff_with_gradients", False)
        implementation, on_kernel = FAST, False
    eager, fast = model_pair(mode, implementation)
    eager.train(), fast.train()
    ids, mask = padded_batch(eager.config.vocab_size, length=256 if GPU else 12)
    for use_mask in (None, mask):
        # No loss predicted from a padded position (its output is arbitrary under every backend).
        labels = ids if use_mask is None else ids.masked_fill(use_mask.roll(1, dims=1) == 0, -100)
        losses = [m(ids, attention_mask=use_mask, labels=labels).loss for m in (eager, fast)]
        for loss, model in zip(losses, (eager, fast)):
            model.zero_grad()
            loss.backward()
        assert abs(losses[0].item() - losses[1].item()) < TOL * abs(losses[0].item())
        for (name, p_eager), p_fast in zip(eager.named_parameters(), fast.parameters()):
            if p_eager.grad is not None and p_eager.grad.norm() > 0:
                assert rel_err(p_fast.grad, p_eager.grad) < GRAD_TOL, name
    assert len(kernel_calls) == (2 * eager.config.num_hidden_layers if on_kernel else 0)
    layers = eager.config.num_hidden_layers
    assert len(rope_calls) == 2 * 2 * layers  # two steps: q and k in one launch, forward and backward
    # two steps: the first layer's input norm alone; every other norm (two a layer and the final one) with the
    # residual add before it, the model's loop handing each layer's last add on (`defers_residual_adds`)
    assert len(norm_calls) == 2 and len(add_norm_calls) == 2 * 2 * layers
    assert deferred == [True] * 4  # eager's loop asks too (its adds and norms then run as two ops each)
    assert len(mlp_calls) == 2 * layers  # two steps, one MLP per layer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads", [(6, 3), (3, 3)], ids=lambda h: f"h{h[0]}-kv{h[1]}")
def test_odd_gqa_groups_on_the_fast_path_equal_eager(mode, heads):
    """README: any h_kv dividing h. The kernels take the query heads of a kv head as one group (V2's pairs, V1's
    heads of 2 x d): groups of 2 and of 1 (6 heads over 3 kv heads, 3 over 3), in training (loss and gradients) and
    in a decoding step after a prefill into a DynamicCache and a StaticCache, against eager."""
    shape = dict(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=64 if GPU else 16)
    eager = tiny_model(mode, **shape).to(DEVICE, DTYPE).train()
    fast = tiny_model(mode, attn_implementation=FAST, **shape).to(DEVICE, DTYPE).train()
    # The reference: eager on the same weights in float32. In bfloat16 the tiny models' V1 lambda gradients are sums
    # that nearly cancel: on an H100 (6 heads over 3 kv heads) bfloat16 eager missed lambda_q1's float32 gradient
    # 10x and the kernels' changed its sign, while the kernels in float32 gave it to four digits. Such a gradient,
    # which bfloat16 eager misses too, says nothing about the kernels and is left out.
    exact = tiny_model(mode, **shape).to(DEVICE, torch.float32).train()
    exact.load_state_dict(fast.state_dict())
    ids, _ = padded_batch(eager.config.vocab_size, length=64 if GPU else 12)
    losses = [m(ids, labels=ids).loss for m in (exact, eager, fast)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[2].item()) < TOL * abs(losses[0].item())
    for (name, p_exact), p_eager, p_fast in zip(exact.named_parameters(), eager.parameters(), fast.parameters()):
        if p_exact.grad is not None and p_exact.grad.norm() > 0 and rel_err(p_eager.grad, p_exact.grad) < GRAD_TOL:
            assert rel_err(p_fast.grad, p_exact.grad) < GRAD_TOL, name
    eager.eval(), fast.eval()
    with torch.no_grad():
        expected = eager(ids).logits[:, -1]
        for cache in (DynamicCache(config=fast.config),
                      StaticCache(config=fast.config, max_cache_len=ids.shape[1] + 4)):
            fast(ids[:, :-1], past_key_values=cache, use_cache=True)
            step = fast(ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
            assert rel_err(step, expected) < TOL, type(cache).__name__


@pytest.mark.parametrize("mode, keys, training, grads, on_kernel", [
    ("v2", 4096, False, False, True), ("v2", 4097, False, False, False), ("v2", 65536, True, True, True),
    ("v2", 65536, False, True, True), ("v2", 65536, True, False, False), ("v1", 8192, True, False, True),
])
def test_the_default_fast_path_takes_the_flash_diff_kernel_up_to_the_modes_key_count(
    mode, keys, training, grads, on_kernel, without_flash_attn_4
):
    """`diff_triton` (`sdpa` on CUDA) puts V2 on the flash-diff kernel at every length where gradients are recorded
    and otherwise up to 4096 keys, on one SDPA call beyond (a prefill's chunks against more keys measured slower on
    the kernel on the H200), V1 at every length; `fused_diff` takes the kernel for both. The module's training mode
    does not decide: a model built from its config is in training mode for inference too. Without
    FlashAttention-4 (where it is installed, V2 takes it instead: test_flash_attn_4.py)."""
    from modeling_diff.diff_attention import ATTENTION_CLASSES

    config = preset_config(f"tiny-{mode}", hidden_size=128)  # heads of 16: widths the kernel covers
    module = ATTENTION_CLASSES[mode](config, layer_idx=0).train(training)
    d, heads, kv_heads = module.head_dim, config.num_attention_heads, config.num_key_value_heads
    dtype = torch.bfloat16 if GPU else torch.float32
    pairs = torch.zeros(1, 16, heads, 2, d, dtype=dtype, device=DEVICE, requires_grad=grads)  # (B, L, h, 2, d)
    key_width = 2 * d if mode == "v1" else d  # V1's K1|K2
    key = torch.zeros(1, kv_heads, keys, key_width, dtype=dtype, device=DEVICE)
    value = torch.zeros(1, kv_heads, keys, key_width, dtype=dtype, device=DEVICE)
    assert module.flash_diff_applies("diff_triton", pairs, key, value, None, {}) is on_kernel
    assert module.flash_diff_applies("fused_diff", pairs, key, value, None, {})
    with torch.no_grad():  # nothing recorded: the key count decides
        assert module.flash_diff_applies("diff_triton", pairs, key, value, None, {}) is (keys <= 4096 or mode == "v1")


def test_dex_folded_weight_and_its_gradients_match_the_formula():
    """W'_h = W_h - W_h G_h^T on each head's columns of o_proj's weight, and the gradients of W and G, against the
    formula written per head in float64; a gradient that arrives transposed; under autocast the fold is made in
    the weight's dtype."""
    from modeling_diff.kernels import dex_folded_weight

    torch.manual_seed(8)
    hidden, h, d = (2048, 32, 64) if GPU else (24, 4, 8)
    weight = (rand(hidden, h * d) * 0.05).requires_grad_()
    operator = (rand(h, d, d) * 0.1).requires_grad_()
    grad_out = rand(h * d, hidden).t()  # (hidden, h * d), not contiguous
    folded = dex_folded_weight(weight, operator)
    grads = torch.autograd.grad(folded, (weight, operator), grad_out)

    w64, g64 = (t.detach().double().requires_grad_() for t in (weight, operator))
    reference = torch.cat([w64[:, i * d:(i + 1) * d] - w64[:, i * d:(i + 1) * d] @ g64[i].T for i in range(h)], 1)
    reference_grads = torch.autograd.grad(reference, (w64, g64), grad_out.double())
    assert folded.shape == weight.shape and folded.is_contiguous() and folded.dtype == DTYPE
    for got, want in zip((folded, *grads), (reference, *reference_grads)):
        assert rel_err(got, want) < TOL
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        float_weight = weight.detach().float().requires_grad_()
        assert dex_folded_weight(float_weight, operator).dtype == torch.float32
    # a weight that is not contiguous (a transposed view, as some loading paths give) folds to the same
    transposed = weight.detach().t().contiguous().t().requires_grad_()
    assert not transposed.is_contiguous()
    assert torch.equal(dex_folded_weight(transposed, operator), folded)


@pytest.mark.parametrize("anneal", [None, 0.3, 2.0])
def test_dex_folded_projection_and_its_gradients_match_the_formula(anneal):
    """The fold kernels (lambda(t) inside them): W'_h = W_h - lambda_h W_h F with lambda_h = lambda(t) mask_h,
    lambda(t) = (1 - a) (t/T) lambda_init + a lambda_learn, a = min(1, t/T) (lambda_learn where annealing is off),
    and the gradients of W, F and lambda_learn, against the formula written here in float64: annealing off, under
    way and over; hidden rows that fill no whole block or split; a selection of heads."""
    from modeling_diff.kernels import DexCombine, dex_folded_projection, dex_folded_projection_applies

    torch.manual_seed(9)
    hidden, h, d = (2048, 32, 64) if GPU else (200, 3, 16)
    weight = (rand(hidden, h * d) * 0.05).requires_grad_()
    operator = (rand(d, d) * 0.1).requires_grad_()
    lambda_learn = torch.full((1,), 0.6, device=DEVICE, dtype=DTYPE, requires_grad=True)
    head_mask = torch.ones(h, device=DEVICE)
    head_mask[1] = 0.0
    steps, t, lambda_init = (0, 0, 0.2) if anneal is None else (100, round(100 * anneal), 0.2)
    combine = DexCombine(operator, head_mask, lambda_learn, torch.tensor(t, device=DEVICE), steps, lambda_init)
    assert dex_folded_projection_applies(weight, combine)
    grad_out = rand(h * d, hidden).t()  # (hidden, h * d), not contiguous
    folded = dex_folded_projection(weight, combine)
    grads = torch.autograd.grad(folded, (weight, operator, lambda_learn), grad_out)

    w64, f64, l64 = (x.detach().double().requires_grad_() for x in (weight, operator, lambda_learn))
    a = 1.0 if anneal is None else min(anneal, 1.0)
    lam = (1 - a) * (t / max(steps, 1)) * lambda_init + a * l64
    reference = torch.cat([w64[:, i * d:(i + 1) * d] - lam * head_mask[i].item() * w64[:, i * d:(i + 1) * d] @ f64
                           for i in range(h)], 1)
    reference_grads = torch.autograd.grad(reference, (w64, f64, l64), grad_out.double())
    assert folded.shape == weight.shape and folded.is_contiguous() and folded.dtype == DTYPE
    for got, want in zip((folded, *grads), (reference, *reference_grads)):
        assert rel_err(got, want) < TOL
    # shapes the kernels do not take: d below the tensor cores' 16, a weight of another dtype than f_D's
    small = DexCombine(operator[:8, :8], head_mask, lambda_learn, combine.anneal_step, steps, lambda_init)
    assert not dex_folded_projection_applies(weight[:, :h * 8], small)
    assert not dex_folded_projection_applies(weight.detach().half(), combine)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_training_nodes_under_autocast_equal_the_modules_path(mode, model_dtype, monkeypatch):
    """Trainer's `bf16=True` runs the forward under bf16 autocast (accelerate wraps it). The MLP's node and the q, k, v
    node apply there, to a bf16 model (nothing to cast) and to a float32 one (x and the weights cast to bf16 first,
    as F.linear under autocast casts them): loss and every gradient are as close to the step without autocast as
    the same step through the modules' own forward under the same autocast is (within twice its error, or 5%).
    V1's lambda vectors are left out: their gradients are sums that cancel, which bf16 rounding moves by 1-260% on
    either path (tiny models of seeds 0-5, the nodes' error above twice the modules' for seed 0 and below for
    others); the float32 comparisons with eager check them."""
    import modeling_diff.kernels.projection as projection
    import modeling_diff.modeling_diff_llama as modeling

    mlp_calls, projection_calls = [], []
    mlp, shared = modeling.swiglu_mlp, projection.shared_input_linears
    monkeypatch.setattr(modeling, "swiglu_mlp", lambda *a: mlp_calls.append(1) or mlp(*a))
    monkeypatch.setattr(projection, "shared_input_linears", lambda *a: projection_calls.append(1) or shared(*a))
    overrides = {} if GPU else dict(head_dim=16)
    model = tiny_model(mode, attn_implementation=FAST, **overrides).to(DEVICE, model_dtype).train()
    ids = torch.randint(3, model.config.vocab_size, (2, 24), device=DEVICE)
    losses, grads = [], []
    for autocast, nodes in ((False, True), (True, True), (True, False)):  # exact, the nodes, the modules' forward
        if not nodes:
            monkeypatch.setattr(modeling, "swiglu_mlp_applies", lambda *a: False)
            monkeypatch.setattr(projection, "shared_input_linears_apply", lambda *a: False)
        model.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            losses.append(model(ids, labels=ids).loss)
        losses[-1].backward()
        grads.append([p.grad.float() for name, p in model.named_parameters()
                      if p.grad is not None and "diff_lambda" not in name])
        assert all(p.grad.dtype == model_dtype for p in model.parameters() if p.grad is not None)
    layers = model.config.num_hidden_layers
    assert len(mlp_calls) == len(projection_calls) == 2 * layers  # without autocast and with it
    exact, with_nodes, modules = losses
    error = abs(with_nodes.item() - exact.item())
    assert error <= max(2e-2 * abs(exact.item()), 2 * abs(modules.item() - exact.item()))
    for want, got, reference in zip(*grads):
        if want.norm() > 0:
            assert rel_err(got, want) <= max(5e-2, 2 * rel_err(reference, want))


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_trainer_bf16_takes_the_training_nodes(model_dtype, tmp_path, monkeypatch):
    """Through Trainer's own path: `TrainingArguments(bf16=True)` runs each forward under bf16 autocast
    (accelerate), and on a bf16 or float32 model the MLP's node and the q, k, v node run in every layer of every
    step."""
    from transformers import Trainer, TrainingArguments

    import modeling_diff.kernels.projection as projection
    import modeling_diff.modeling_diff_llama as modeling

    seen = []  # (node, autocast on) per call
    mlp, shared = modeling.swiglu_mlp, projection.shared_input_linears
    monkeypatch.setattr(modeling, "swiglu_mlp", lambda *a: seen.append(("mlp", torch.is_autocast_enabled(
        DEVICE))) or mlp(*a))
    monkeypatch.setattr(projection, "shared_input_linears", lambda *a: seen.append(("qkv", torch.is_autocast_enabled(
        DEVICE))) or shared(*a))
    overrides = {} if GPU else dict(head_dim=16)
    model = tiny_model("dex", attn_implementation=FAST, **overrides).to(DEVICE, model_dtype)
    ids = torch.randint(3, model.config.vocab_size, (4, 16))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=not GPU, bf16=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0, max_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-3)
    loss = Trainer(model=model, args=args, train_dataset=data).train().training_loss
    layers = model.config.num_hidden_layers
    assert math.isfinite(loss)
    assert sorted(seen) == [("mlp", True)] * (2 * layers) + [("qkv", True)] * (2 * layers)


@pytest.mark.parametrize("dex_heads", [None, [[0, 3], [1]]])
def test_dex_operator_folded_into_o_proj_equals_eager(dex_heads, monkeypatch):
    """With more tokens than o_proj has rows, the fast path folds DEX's operator into o_proj's weight: forward and
    gradients (f_D's, lambda's, o_proj's) on every head and on a selection of heads, against eager in float32;
    on the GPU in bf16, within twice eager bf16's own error, and lambda's within 0.1: its gradient is a sum over
    every token (eager) or every weight of o_proj (folded) that cancels to ~1e-3, and bf16 rounding leaves eager's
    own 2-8% from float32 on this model (measured on the H200), the fold's 0.2-6%."""
    import modeling_diff.diff_attention as attention

    folds = []
    fold = attention.DexAttention.o_proj_with_operator
    monkeypatch.setattr(attention.DexAttention, "o_proj_with_operator", lambda *a: folds.append(1) or fold(*a))
    overrides = {} if GPU else dict(head_dim=16)
    reference = tiny_model("dex", dex_heads=dex_heads, **overrides).to(DEVICE).train()
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.dex_lambda.lambda_learn.fill_(0.7)
    eager = copy.deepcopy(reference).to(DTYPE)
    fast = copy.deepcopy(eager)
    fast.set_attn_implementation(FAST)
    ids = torch.randint(3, reference.config.vocab_size, (2, 40), device=DEVICE)  # 80 tokens > hidden 64
    losses = []
    for model in (reference, eager, fast):
        losses.append(model(ids, labels=ids).loss)
        losses[-1].backward()
    assert abs(losses[2].item() - losses[0].item()) < TOL * abs(losses[0].item())
    for (name, p_ref), p_eager, p_fast in zip(reference.named_parameters(), eager.parameters(), fast.parameters()):
        if p_ref.grad is not None and p_ref.grad.norm() > 0:
            bound = max(GRAD_TOL, 2 * rel_err(p_eager.grad, p_ref.grad), 0.1 if GPU and "lambda" in name else 0)
            assert rel_err(p_fast.grad, p_ref.grad) < bound, name
    assert len(folds) == reference.config.num_hidden_layers
    assert fast.model.layers[0].self_attn.dex_lambda.lambda_learn.grad.abs().sum() > 0


@torch.no_grad()  # as in generate(); the kernel has no backward
def decode(model, cache_class, ids, mask, steps):
    """Last-position logits of the prefill and of each decoding step (B, 1 + steps, vocab)."""
    if cache_class is StaticCache:
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps.shape[1] + 3)
    else:
        cache = DynamicCache(config=model.config)
    logits = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(steps.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits.append(model(steps[:, t : t + 1], attention_mask=mask, past_key_values=cache).logits[:, -1])
    return torch.stack(logits, 1)


def test_v1_refuses_a_static_cache_of_head_dim_wide_keys_on_the_kernel_path():
    """V1 caches K1|K2, 2 x head_dim wide. A StaticCache whose layers were made head_dim wide (as transformers'
    ExecuTorch export makes them) gets the reason before the projections' launch or the decode kernel touches it,
    as on the eager path (tests/test_modeling.py), not a shape error from inside the write."""
    _, model = model_pair("v1", FAST)
    config, ids = model.config, torch.randint(3, model.config.vocab_size, (1, 4), device=DEVICE)
    cache = StaticCache(config=config, max_cache_len=16)
    narrow = torch.zeros(1, config.num_key_value_heads, 1, config.head_dim, device=DEVICE, dtype=DTYPE)
    for layer in cache.layers:
        layer.lazy_initialization(narrow, narrow)
    assert cache.layers[0].keys.shape[-1] == config.head_dim
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache holds keys \d+ wide: V1 caches keys and values 2 x"):
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    assert not cache.layers[0].keys.any()  # nothing written


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cache_class", [DynamicCache, StaticCache])
def test_decoding_steps_on_the_kernel_equal_eager(mode, cache_class, monkeypatch):
    """Prefill, then decoding steps through the split-KV kernel with the differential term in it, the
    projections' kernels (q, k, v and V2's lambda_proj split along their input, summed and rotated in the same
    launch, the MLP's gate and up in one, o_proj and down_proj split along their input and summed, down_proj's with the
    residual add), the residual add with the norm after it in one pass, a StaticCache's write in the projections'
    launch (the decode kernel advancing its length), the step's cos and sin in one launch,
    with left padding, dynamic and static caches. The keys and values that reach the cache are contiguous: a DynamicCache concatenates them with its cache, and torch.cat's fast CUDA
    kernel takes only contiguous inputs (a column view of the projections' output took the slow one)."""
    import modeling_diff.diff_attention as attention
    import modeling_diff.kernels.projection as projection

    import modeling_diff.modeling_diff_llama as modeling

    kernel_calls, projections, gated, added = [], [], [], []
    kernel, add_norm = attention.combined_decode_attention, modeling.add_rms_norm
    monkeypatch.setattr(attention, "combined_decode_attention", lambda *a: kernel_calls.append(1) or kernel(*a))
    monkeypatch.setattr(modeling, "add_rms_norm", lambda *a: added.append(1) or add_norm(*a))
    monkeypatch.setattr(projection, "_projections", CountedKernel(projection._projections, projections))
    monkeypatch.setattr(projection, "_gated_projection", CountedKernel(projection._gated_projection, gated))
    import modeling_diff.kernels.cache_write as cache_write
    import modeling_diff.kernels.rope as rope

    angles = []
    monkeypatch.setattr(rope, "_rope_cos_sin", CountedKernel(rope._rope_cos_sin, angles))

    layouts, update, writes, prewritten = [], attention.update_cache, [], []
    written = attention.written_layer
    monkeypatch.setattr(attention, "written_layer", lambda *a: (lambda layer: layer is not None and prewritten.append(
        1) or layer)(written(*a)))
    monkeypatch.setattr(attention, "update_cache", lambda cache, i, k, v, kwargs: layouts.append(
        (k.shape[-2], k.is_contiguous(), v.is_contiguous())) or update(cache, i, k, v, kwargs))
    monkeypatch.setattr(cache_write, "_static_cache_write", CountedKernel(cache_write._static_cache_write, writes))
    eager, fast = model_pair(mode, FAST)
    ids, mask = padded_batch(eager.config.vocab_size, length=40)  # prefill: SDPA (more rows than the kernel's)
    steps = torch.randint(3, eager.config.vocab_size, (ids.shape[0], 2), device=DEVICE)
    logits = [decode(model, cache_class, ids, mask, steps) for model in (eager, fast)]
    assert rel_err(logits[1], logits[0]) < TOL
    assert len(kernel_calls) == steps.shape[1] * eager.config.num_hidden_layers  # every decoding step
    assert len(gated) == len(kernel_calls)  # the prefill's 80 tokens take cuBLAS
    assert len(angles) == 1 + steps.shape[1]  # cos and sin in one launch: each step's, and the prefill's 40 positions
    # one launch each: q, k, v (and lambda_proj) split along their input, summed and rotated; o_proj split and
    # summed; down_proj split and summed with the residual add
    assert len(projections) == 3 * len(kernel_calls)
    # the add before the MLP's norm in every forward; the prefill's MLP (cuBLAS) leaves its add to the next norm's
    # pass too (the final norm's for the last layer), where each step's is in down_proj's last pass
    assert len(added) == (2 + steps.shape[1]) * eager.config.num_hidden_layers
    # a StaticCache takes each step's keys and values in the projections' launch (`kernels/cache_write.py`), and the
    # write kernel's launch (steps of more than 16 tokens) is not needed
    assert len(writes) == 0
    assert len(prewritten) == (len(kernel_calls) if cache_class is StaticCache else 0)
    # a DynamicCache step's (batch > 1): a column view of the projections would not be contiguous (the prefill's are
    # transposed); a StaticCache's steps do not reach update_cache
    steps_layouts = {layout for layout in layouts if layout[0] == 1}
    assert ids.shape[0] > 1 and steps_layouts == ({(1, True, True)} if cache_class is DynamicCache else set())


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_static_cache_steps_of_more_than_16_tokens_equal_eager(mode, monkeypatch):
    """Steps of 17 to 32 tokens (batch 17): q, k and v split, summed, rotated and stored into the StaticCache in one
    launch (ROTATED_MAX_TOKENS), the decode kernel advancing the length; o_proj and down_proj on cuBLAS (more than
    SPLIT_MAX_TOKENS), whose residual add is left to the next norm's pass (the input norm of the next layer, the
    final norm after the last). The logits equal eager's."""
    import modeling_diff.diff_attention as attention
    import modeling_diff.kernels.projection as projection
    import modeling_diff.modeling_diff_llama as modeling

    prewritten, rotated, split, added = [], [], [], []
    add_norm = modeling.add_rms_norm
    monkeypatch.setattr(modeling, "add_rms_norm", lambda *a: added.append(1) or add_norm(*a))
    written, rotate, split_applies = attention.written_layer, projection.rotated_projections, attention.split_linear_applies
    monkeypatch.setattr(attention, "written_layer", lambda *a: (lambda layer: layer is not None and prewritten.append(
        1) or layer)(written(*a)))
    monkeypatch.setattr(attention, "rotated_projections", lambda *a: rotated.append(1) or rotate(*a))
    monkeypatch.setattr(attention, "split_linear_applies", lambda *a: (lambda ok: ok and split.append(1) or ok)(
        split_applies(*a)))
    eager, fast = model_pair(mode, FAST)
    ids, mask = padded_batch(eager.config.vocab_size, batch=17, length=6)
    steps = torch.randint(3, eager.config.vocab_size, (ids.shape[0], 2), device=DEVICE)
    logits = [decode(model, StaticCache, ids, mask, steps) for model in (eager, fast)]
    assert rel_err(logits[1], logits[0]) < TOL
    layers_steps = steps.shape[1] * eager.config.num_hidden_layers
    assert len(rotated) == len(prewritten) == layers_steps and not split
    # two adds a layer in the prefill and in every step: the attention's with the MLP's norm, the MLP's with the next
    assert len(added) == 2 * (1 + steps.shape[1]) * eager.config.num_hidden_layers


@torch.no_grad()
def test_a_step_that_declines_the_decode_kernel_after_the_projections_wrote_the_cache_equals_eager(monkeypatch):
    """The projections store a StaticCache step's keys and values before the attention knows its path; where the
    decode kernel then declines (V1 with a hook on subln), `Cache.update` stores them again at the same positions
    and advances the length: the logits equal eager's."""
    import modeling_diff.diff_attention as attention

    marked = []
    mark = attention.mark_written
    monkeypatch.setattr(attention, "mark_written", lambda *a: marked.append(1) or mark(*a))
    eager, fast = model_pair("v1", FAST)
    for model in (eager, fast):
        model.model.layers[0].self_attn.subln.register_forward_hook(lambda *args: None)
    ids, mask = padded_batch(eager.config.vocab_size)
    steps = torch.randint(3, eager.config.vocab_size, (ids.shape[0], 2), device=DEVICE)
    logits = [decode(model, StaticCache, ids, mask, steps) for model in (eager, fast)]
    assert rel_err(logits[1], logits[0]) < TOL
    assert len(marked) == steps.shape[1] * eager.config.num_hidden_layers  # layer 0's too


def recorded_deferrals(monkeypatch) -> list[bool]:
    """The model loops' decisions to defer the residual adds (`defers_residual_adds`), one a forward, in order."""
    import modeling_diff.modeling_diff_llama as modeling

    deferred = []
    defers = modeling.defers_residual_adds
    monkeypatch.setattr(modeling, "defers_residual_adds", lambda layers: (lambda d: deferred.append(d) or d)(
        defers(layers)))
    return deferred


@torch.no_grad()
def test_hidden_states_asked_for_are_the_layers_sums_where_the_adds_are_deferred(monkeypatch):
    """Without gradients the model's loop leaves each layer's last residual add to the next norm's pass
    (`defers_residual_adds`); where hidden states are asked for, transformers records each layer's output through
    a hook, and then the layers run as modules and return their sums: every hidden state equals eager's, and the
    last hidden state (the final norm's) does with and without them."""
    deferred = recorded_deferrals(monkeypatch)
    eager, fast = model_pair("v1", FAST)
    ids, mask = padded_batch(eager.config.vocab_size, batch=17, length=6)
    plain = fast(ids, attention_mask=mask).logits
    assert deferred == [True]
    outputs = [model(ids, attention_mask=mask, output_hidden_states=True) for model in (eager, fast)]
    assert deferred[1:] == [False, False]  # the hooks stay once installed
    assert len(outputs[1].hidden_states) == eager.config.num_hidden_layers + 1
    real = mask.bool()  # left padding: the padded positions' states are nobody's
    for state, reference in zip(outputs[1].hidden_states, outputs[0].hidden_states):
        assert rel_err(state[real], reference[real]) < TOL
    for logits in (plain, outputs[1].logits):
        assert rel_err(logits[real], outputs[0].logits[real]) < TOL


@torch.no_grad()
def test_a_hook_on_a_decoder_layer_sees_its_sum_and_no_add_is_deferred(monkeypatch):
    """A forward hook on one decoder layer: the model's loop calls every layer as a module (nothing deferred), the
    hook sees the layer's own output, residual + update, equal to eager's; without the hook the adds are deferred
    again and the logits are the same."""
    deferred = recorded_deferrals(monkeypatch)
    eager, fast = model_pair("dex", FAST)
    ids, mask = padded_batch(eager.config.vocab_size, batch=17, length=6)
    seen = {}
    handles = [model.model.layers[0].register_forward_hook(
        lambda module, args, out, name=name: seen.__setitem__(name, out)) for name, model in (("eager", eager),
                                                                                             ("fast", fast))]
    logits = [model(ids, attention_mask=mask).logits for model in (eager, fast)]
    assert deferred == [False, False]  # eager's loop asks too
    real = mask.bool()
    assert rel_err(seen["fast"][real], seen["eager"][real]) < TOL
    assert rel_err(logits[1][real], logits[0][real]) < TOL
    for handle in handles:
        handle.remove()
    unhooked = fast(ids, attention_mask=mask).logits
    assert deferred[-1] is True and rel_err(unhooked[real], logits[0][real]) < TOL


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_output_attentions_on_the_fast_path_warns_as_sdpa_does(mode):
    """The kernels return no maps (decode kernel, flash-diff, FlashAttention-4, SDPA), as transformers' sdpa returns
    none: asked for them, the fast path says so once, as sdpa does, and points at eager, which returns the
    differential maps of every step; the tokens are eager's."""
    from transformers.testing_utils import CaptureLogger

    from modeling_diff import diff_attention

    eager, fast = model_pair(mode, FAST)
    ids, mask = padded_batch(eager.config.vocab_size)
    ask = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, output_attentions=True,
               return_dict_in_generate=True)
    diff_attention.logger.warning_once.cache_clear()
    with CaptureLogger(diff_attention.logger) as captured:
        fast_out = fast.generate(ids, **ask)
    assert "does not support `output_attentions=True`" in captured.out and "`eager`" in captured.out
    assert all(step is None or len(step) == 0 or step[0] is None for step in fast_out.attentions)
    with CaptureLogger(diff_attention.logger) as captured:
        eager_out = eager.generate(ids, **ask)
    assert captured.out == ""
    assert [len(step) for step in eager_out.attentions] == [eager.config.num_hidden_layers] * 3
    assert torch.equal(fast_out.sequences, eager_out.sequences)


@pytest.mark.parametrize("mode", MODES)
def test_a_global_module_hook_sees_every_module_call_of_eager_on_the_fast_path(mode):
    """torch's global module hooks (FlopCounterMode's module tracker, activation steering) are called for every
    module call, so with one registered the fast paths take no module's work (norms with their residual add, the
    MLP in a decoding step, the layers' deferred adds): in a training step and in generate, every module of the
    model is called as often as in eager."""
    from collections import Counter

    eager, fast = model_pair(mode, FAST)
    ids = torch.randint(3, eager.config.vocab_size, (2, 6), device=DEVICE)
    calls = {}
    for name, model in (("eager", eager), ("fast", fast)):
        names = {module: module_name for module_name, module in model.named_modules()}
        calls[name] = Counter()
        count = lambda module, args, out, seen=calls[name]: seen.update([names.get(module)])  # noqa: E731
        handle = torch.nn.modules.module.register_module_forward_hook(count)
        try:
            model.train()(ids, labels=ids).loss.backward()
            # (min_new_tokens: in bf16 the two may pick other tokens, and an end-of-text token would end one early)
            model.eval().generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        finally:
            handle.remove()
        del calls[name][None]  # transformers' own function wrappers (eager's RoPE), not the model's modules
    assert calls["fast"] == calls["eager"]
    assert calls["fast"]["model.layers.0.input_layernorm"] == 1 + 3  # the step, the prompt and two decoding steps


# (mode, the module hooked, config.dex_heads): the modules whose work the kernels take by reading their parameters
DIFFERENTIAL_MODULES = [("v1", "subln", None), ("v1", "diff_lambda", None), ("dex", "dex_lambda", None),
                        ("dex", "dex_proj", [[0, 1], [2]])]


@pytest.mark.parametrize("peft_copy", [False, True], ids=["module", "peft_copy"])
@pytest.mark.parametrize("mode, hooked, dex_heads", DIFFERENTIAL_MODULES)
def test_a_hook_changing_a_differential_module_changes_the_fast_path_as_eager(monkeypatch, mode, hooked, dex_heads,
                                                                              peft_copy):
    """The combine, the flash-diff and decode kernels and DEX's fold read V1's subln and lambda, DEX's lambda and
    f_D in place of calling them, where those modules are plain. With a forward hook that changes a module's output,
    on the module or on the copy that PEFT's `modules_to_save` wrapper runs (`lora_config` trains them so), the
    module is called as often as in eager (a training step, the prompt, two decoding steps) and the loss, gradients
    and logits follow eager's. Before d4f8848 and its successor every case but f_D's PEFT copy failed: V1's
    combine read a hooked subln's weight (on CUDA only: the CPU run forces the combine's Triton path), V1's and
    DEX's decode kernels read a hooked lambda, DEX's fold applied a hooked f_D to I where eager (heads selected)
    applies it to O, and the wrapper hid its copy's hooks. On the GPU, in bfloat16: 64 tokens (at 6, bfloat16 eager's
    own lambda gradient lay 2.8 times its norm off float32's, of the opposite sign, while the fast path in float32 gave
    float32's to 1e-4), and the new tokens chosen for both (greedy picks differed at a near tie, and every logit
    after it)."""
    from collections import Counter

    from peft import get_peft_model

    import modeling_diff.kernels.combine as combine
    from modeling_diff.lora import lora_config

    if not GPU:
        monkeypatch.setattr(combine, "_fused", lambda attn: True)
    eager, fast = model_pair(mode, FAST, dex_heads=dex_heads)
    # f_D's case: on the CPU more tokens than the hidden size (64), where DEX folds f_D into o_proj
    length = 40 if hooked == "dex_proj" else 64 if GPU else 6
    ids = torch.randint(3, eager.config.vocab_size, (2, length), device=DEVICE)
    chosen = torch.randint(3, eager.config.vocab_size, (2, 3)).tolist()  # the new tokens, the same for both
    choose = lambda row, tokens: [chosen[row][len(tokens) - length]]  # noqa: E731
    calls, results = {}, {}
    for name, model in (("eager", eager), ("fast", fast)):
        if peft_copy:
            torch.manual_seed(1)  # the same LoRA weights in both
            model = get_peft_model(model, lora_config(lora_dropout=0.0))
        calls[name] = Counter()
        suffix = f"{hooked}.modules_to_save.default" if peft_copy else hooked
        hooked_modules = [(n, m) for n, m in model.named_modules() if n.endswith(suffix)]
        assert len(hooked_modules) == eager.config.num_hidden_layers
        for module_name, module in hooked_modules:
            module.register_forward_hook(lambda m, args, out, key=module_name, seen=calls[name]:
                                         seen.update([key]) or out * 1.5 + 0.05)
        loss = model.train()(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out = model.eval().generate(ids, max_new_tokens=3, do_sample=False, prefix_allowed_tokens_fn=choose,
                                    output_logits=True, return_dict_in_generate=True)
        assert out.sequences[:, length:].tolist() == chosen
        results[name] = loss.detach(), grads, torch.stack(out.logits, 1)
    assert calls["fast"] == calls["eager"]
    assert set(calls["fast"].values()) == {1 + 3}  # each layer's: the step, the prompt, two decoding steps
    (loss, grads, logits), (eager_loss, eager_grads, eager_logits) = results["fast"], results["eager"]
    assert rel_err(loss, eager_loss) < TOL and rel_err(logits, eager_logits) < TOL
    assert grads.keys() == eager_grads.keys()
    for name in grads:  # (LoRA's A gets no gradient while its B is zero)
        if eager_grads[name].any():
            assert rel_err(grads[name], eager_grads[name]) < GRAD_TOL, name
        else:
            assert not grads[name].any(), name


def test_decoding_steps_with_a_hook_on_the_mlp_show_it_the_mlps_own_output():
    """The residual add joins down_proj's last pass only where nothing watches the MLP: with a forward hook on it,
    the hook runs in every step and sees mlp(x), not residual + mlp(x), and the logits stay eager's."""
    eager, fast = model_pair("v1", FAST)
    seen = {}
    for name, model in (("eager", eager), ("fast", fast)):
        mlp = model.model.layers[0].mlp
        mlp.register_forward_hook(lambda module, args, out, name=name: seen.setdefault(name, []).append(
            (out, module.down_proj(module.act_fn(module.gate_proj(args[0])) * module.up_proj(args[0])))))
    ids, mask = padded_batch(eager.config.vocab_size)
    steps = torch.randint(3, eager.config.vocab_size, (ids.shape[0], 2), device=DEVICE)
    with torch.no_grad():
        logits = [decode(model, DynamicCache, ids, mask, steps) for model in (eager, fast)]
    assert rel_err(logits[1], logits[0]) < TOL
    assert len(seen["fast"]) == len(seen["eager"]) == 1 + steps.shape[1]  # the prefill and every step
    for out, own in seen["fast"]:
        assert rel_err(out, own) < TOL


def test_dependent_launch_only_where_it_exists(monkeypatch):
    """PDL only for steps of at most 32 tokens (16 for the decode kernel and its reduce) on NVIDIA GPUs of compute
    capability 9.0+: never on CPU tensors (the interpreter), on older GPUs, on ROCm (whose devices report capabilities
    of their own), or when turned off."""
    from modeling_diff.kernels import _triton

    class FakeCuda:  # a tensor's two attributes that the decision reads
        is_cuda = True

        def get_device(self):
            return 0

    assert not _triton.dependent_launch(torch.zeros(1), 1)
    # (hip, capability, tokens, the decode kernel's tokens, PDL_ENABLED, expected for both)
    for hip, capability, tokens, decode_tokens, enabled, expected in [
        (None, (9, 0), 1, 1, True, True), (None, (9, 0), 32, 16, True, True), (None, (9, 0), 33, 17, True, False),
        (None, (8, 0), 1, 1, True, False), ("6.2", (9, 4), 1, 1, True, False), (None, (10, 0), 1, 1, False, False),
    ]:
        _triton._has_dependent_launch.cache_clear()
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, capability=capability: capability)
        monkeypatch.setattr(_triton, "PDL_ENABLED", enabled)
        assert _triton.dependent_launch(FakeCuda(), tokens) is expected
        assert _triton.dependent_launch(FakeCuda(), decode_tokens, _triton.DECODE_PDL_MAX_TOKENS) is expected
    _triton._has_dependent_launch.cache_clear()


def test_modeling_diff_pdl_0_in_the_environment_turns_dependent_launches_off():
    """README: `MODELING_DIFF_PDL=0` turns PDL off (the flag is read once, as the package is imported)."""
    code = "from modeling_diff.kernels import _triton; print(_triton.PDL_ENABLED)"
    for value, expected in ((None, "True"), ("0", "False"), ("1", "True")):
        env = {k: v for k, v in os.environ.items() if k != "MODELING_DIFF_PDL"}
        env.update({} if value is None else {"MODELING_DIFF_PDL": value})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.stdout.strip() == expected, out.stderr[-2000:]


def test_dependent_launches_change_no_bit_of_a_decoding_step(monkeypatch):
    """PDL only lets a kernel start earlier; every kernel waits for its inputs: the steps' logits with it equal
    those without it bit for bit (dynamic and static caches, the decoding graphs included), in steps of a few tokens
    (every kernel under it) and of 17 (the norms and projections, not the decode kernel). On the H200 the first
    run launches with PDL; on the CPU (the interpreter) and GPUs before compute capability 9.0 neither does, and
    switching it must change nothing there either."""
    from modeling_diff.kernels import _triton

    _, fast = model_pair("dex", FAST)
    for batch, length in ((2, 40), (17, 6)):
        ids, mask = padded_batch(fast.config.vocab_size, batch=batch, length=length)
        steps = torch.randint(3, fast.config.vocab_size, (ids.shape[0], 4), device=DEVICE)
        with torch.no_grad():
            for cache_class in (DynamicCache, StaticCache):
                runs = []
                for enabled in (True, False):
                    monkeypatch.setattr(_triton, "PDL_ENABLED", enabled)
                    runs.append(decode(fast, cache_class, ids, mask, steps))
                assert torch.equal(runs[0], runs[1])


def assert_peft_gradients_equal_eager(model, ids, bound=lambda name: GRAD_TOL) -> dict:
    """One loss backward of the PEFT `model` on FAST attention and one of its float32 copy on eager attention: the
    same parameters get gradients, and each nonzero one of the copy's is the model's within bound(name) (relative
    error); returns the copy's, by parameter name."""
    reference = copy.deepcopy(model).float()
    reference.base_model.model.set_attn_implementation("eager")
    model.base_model.model.set_attn_implementation(FAST)
    grads = []
    for peft_model in (reference, model):
        peft_model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        if grad.norm() > 0:
            assert rel_err(grads[1][name], grad) < bound(name), name
    return grads[0]


def test_lora_model_on_the_flash_diff_kernel_equals_eager(monkeypatch):
    """Under PEFT, V1's subln is a ModulesToSaveWrapper: the kernel must read the trained copy's weight, and the
    MLP of LoRA layers takes the activation kernel. The
    reference is the same LoRA model on eager attention in float32 (on a GPU the kernel runs in bfloat16, and
    lambda's gradient, a sum with much cancellation, would otherwise be measured against eager's own rounding)."""
    import modeling_diff.diff_attention as attention
    from modeling_diff.lora import get_lora_model, lora_config

    import modeling_diff.modeling_diff_llama as modeling

    kernel_calls, activation_calls = [], []
    kernel, activation = attention.flash_diff_attention, modeling.silu_mul
    monkeypatch.setattr(attention, "flash_diff_attention", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(modeling, "silu_mul", lambda *a: activation_calls.append(1) or activation(*a))
    eager, _ = model_pair("v1", FAST)
    model = get_lora_model(eager, lora_config(lora_dropout=0.0)).train()  # no RNG stream to keep aligned
    ids = torch.randint(3, eager.config.vocab_size, (2, 24), device=DEVICE)
    grads = assert_peft_gradients_equal_eager(model, ids)
    assert len(kernel_calls) == len(activation_calls) == eager.config.num_hidden_layers  # LoRA on the MLP too
    assert any("subln.modules_to_save" in n for n in grads)


def test_v2_trained_through_peft_beyond_its_key_limit_takes_the_flash_diff_kernel_and_equals_eager(
    monkeypatch, without_flash_attn_4
):
    """Plain PEFT (LoRA on V2's projections) trains on more keys than V2's default takes the kernel for without
    gradients (`flash_diff_max_keys`: 4096 on the GPU, at 4352 tokens; under the interpreter the limit is lowered to
    16 and the sequence has 24 tokens, the same rule at a length it can run): autograd records the attention, so
    every layer takes the flash-diff kernel, and the LoRA gradients equal those of the same PEFT model on eager
    attention in float32. Without FlashAttention-4 (where it is installed, V2 takes it instead)."""
    from peft import LoraConfig, get_peft_model

    import modeling_diff.diff_attention as attention

    if GPU:
        tokens = 4352
    else:
        tokens = 24
        monkeypatch.setattr(attention.DiffAttentionV2, "flash_diff_max_keys", 16)
    assert tokens > attention.DiffAttentionV2.flash_diff_max_keys
    kernel_calls = []
    kernel = attention.flash_diff_attention
    monkeypatch.setattr(attention, "flash_diff_attention", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    eager, _ = model_pair("v2", FAST)  # on the GPU two layers of the ~1.1B shape (up to 8192 positions)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(eager, config).train()
    ids = torch.randint(3, eager.config.vocab_size, (1, tokens), device=DEVICE)
    grads = assert_peft_gradients_equal_eager(model, ids)
    assert len(kernel_calls) == eager.config.num_hidden_layers
    assert len(grads) == 8 * eager.config.num_hidden_layers  # lora_A and lora_B of four projections a layer


def test_lora_on_attention_only_keeps_the_mlp_node_and_the_dex_fold(monkeypatch):
    """Plain PEFT with LoRA on q_proj and v_proj (DEX's f_D and lambda trained in full): the MLP's node runs on the
    frozen MLP weights and the DEX fold reads f_D's trained copy; the gradients are those of the same PEFT model on
    eager attention in float32."""
    from peft import LoraConfig, get_peft_model

    import modeling_diff.diff_attention as attention
    import modeling_diff.modeling_diff_llama as modeling
    from modeling_diff.lora import DIFFERENTIAL_MODULES

    calls = []
    fold, mlp = attention.DexAttention.o_proj_with_operator, modeling.swiglu_mlp
    monkeypatch.setattr(attention.DexAttention, "o_proj_with_operator", lambda *a: calls.append("fold") or fold(*a))
    monkeypatch.setattr(modeling, "swiglu_mlp", lambda *a: calls.append("mlp") or mlp(*a))
    eager, _ = model_pair("dex", FAST)
    config = LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                        modules_to_save=list(DIFFERENTIAL_MODULES))
    model = get_peft_model(eager, config).train()
    length = eager.config.hidden_size // 2 + 8  # 2 x length tokens > hidden: the fold applies
    ids = torch.randint(3, eager.config.vocab_size, (2, length), device=DEVICE)
    grads = assert_peft_gradients_equal_eager(  # lambda's bound: see the DEX fold test
        model, ids, bound=lambda name: max(GRAD_TOL, 0.1 if GPU and "lambda" in name else 0)
    )
    layers = eager.config.num_hidden_layers
    assert calls.count("fold") == layers and calls.count("mlp") == layers
    assert any("dex_proj.modules_to_save" in n for n in grads)


@pytest.mark.parametrize("mode", MODES)
def test_lora_model_decoding_on_the_kernel_equals_eager(mode, monkeypatch):
    """Under PEFT the differential modules are trained copies (`modules_to_save`): V1's decode kernel reads the copy's
    subln weight, V2's the copy's lambda_proj output, DEX's the copies of f_D and lambda_learn. Greedy decoding with
    the adapter active equals eager decoding of the same LoRA model."""
    import modeling_diff.diff_attention as attention
    from modeling_diff.lora import get_lora_model, lora_config

    kernel_calls = []
    kernel = attention.combined_decode_attention
    monkeypatch.setattr(attention, "combined_decode_attention", lambda *a: kernel_calls.append(1) or kernel(*a))
    eager, _ = model_pair(mode, FAST)
    model = get_lora_model(eager, lora_config(lora_dropout=0.0)).eval()
    with torch.no_grad():  # a trained adapter and trained copies: none of them at their initial values
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.05 * torch.randn_like(p))
    ids, mask = padded_batch(eager.config.vocab_size, length=40)  # prefill: SDPA (more rows than the kernel's)
    steps = torch.randint(3, eager.config.vocab_size, (ids.shape[0], 2), device=DEVICE)
    logits = []
    for implementation in ("eager", FAST):
        model.base_model.model.set_attn_implementation(implementation)
        logits.append(decode(model, DynamicCache, ids, mask, steps))
    assert rel_err(logits[1], logits[0]) < TOL
    assert len(kernel_calls) == steps.shape[1] * eager.config.num_hidden_layers


def test_a_lora_on_dex_s_operator_decodes_on_the_kernels_as_eager():
    """PEFT's own `LoraConfig(target_modules="all-linear")` wraps f_D (`dex_proj`) in a LoRA layer, whose `weight` is
    its base layer's: the decode kernel read that and dropped the adapter's term, so every step of up to 16 tokens
    computed the base model's f_D (greedy tokens differed from the third on). Such an f_D takes the plain path."""
    from peft import LoraConfig, get_peft_model

    eager, _ = model_pair("dex", FAST)
    model = get_peft_model(eager, LoraConfig(target_modules="all-linear", lora_dropout=0.0)).eval()
    assert type(model.base_model.model.model.layers[0].self_attn.dex_proj).__name__ == "Linear"  # PEFT's LoRA layer
    with torch.no_grad():  # a trained adapter: its term in f_D non-zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.3 * torch.randn_like(p))
    ids, mask = padded_batch(eager.config.vocab_size, length=6)
    steps = torch.randint(3, eager.config.vocab_size, (ids.shape[0], 2), device=DEVICE)
    logits = []
    for implementation in ("eager", FAST):
        model.base_model.model.set_attn_implementation(implementation)
        logits.append(decode(model, DynamicCache, ids, mask, steps))
    with model.disable_adapter():
        model.base_model.model.set_attn_implementation("eager")
        base = decode(model, DynamicCache, ids, mask, steps)
    assert rel_err(logits[0], base) > 10 * TOL  # the adapter on f_D changes the logits
    assert rel_err(logits[1], logits[0]) < TOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [5, 40])  # the decode kernel; the flash-diff kernel (V1) or SDPA
def test_static_cache_prefill_without_mask_equals_eager(mode, length):
    """A StaticCache prefill gets no mask from transformers although the keys are the whole (longer) buffer."""
    eager, fast = model_pair(mode, FAST)
    ids = torch.randint(3, eager.config.vocab_size, (2, length), device=DEVICE)
    with torch.no_grad():
        logits = [
            model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=length + 24), use_cache=True).logits
            for model in (eager, fast)
        ]
    assert rel_err(logits[1], logits[0]) < TOL


# ---- flash_attention_2, through a stand-in with flash_attn's call signature ---------------------------------


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn 2's contract: (B, L, Hq, D) inputs, GQA by head count, causal aligned bottom-right."""
    batch, length, kv_length = q.shape[0], q.shape[1], k.shape[1]
    visible = torch.ones(length, kv_length, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(kv_length - length)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = attention_formula(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible.expand(batch, -1, -1), scale)
    return out.to(q.dtype)


def _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            deterministic=False, return_attn_probs=False, block_table=None):
    """Packed sequences (total tokens, H, D), sequence i at cu_seqlens[i]:cu_seqlens[i + 1]."""
    outs = []
    for i in range(len(cu_seqlens_q) - 1):
        qs, ks = slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]), slice(cu_seqlens_k[i], cu_seqlens_k[i + 1])
        outs.append(_flash_attn_func(q[None, qs], k[None, ks], v[None, ks], dropout_p, softmax_scale, causal)[0])
    return torch.cat(outs)


@pytest.fixture
def flash_attn_stand_in(monkeypatch):
    import transformers.modeling_flash_attention_utils as fa_utils

    calls = []

    def recorded(name, fn):  # keeps fn's signature: transformers reads it to decide which arguments to pass
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    package = types.ModuleType("flash_attn")
    package.flash_attn_func = recorded("dense", _flash_attn_func)
    package.flash_attn_varlen_func = recorded("varlen", _flash_attn_varlen_func)
    package.flash_attn_with_kvcache = None
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = fa_utils._pad_input, fa_utils._unpad_input
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)
    yield calls
    fa_utils._loaded_implementation = None


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_flash_attention_2_call_contract(mode, flash_attn_stand_in):
    """V1 and V2 through transformers' flash_attention_2 integration (padded and unpadded) equal eager."""
    eager = tiny_model(mode).to(DEVICE, DTYPE)
    flash = tiny_model(mode).to(DEVICE, DTYPE)
    flash.config._attn_implementation = "flash_attention_2"
    ids, mask = padded_batch(eager.config.vocab_size)
    for use_mask, call in ((None, "dense"), (mask, "varlen")):
        with torch.no_grad():
            ref, out = (m(ids, attention_mask=use_mask).logits for m in (eager, flash))
        keep = torch.ones_like(ids, dtype=torch.bool) if use_mask is None else use_mask.bool()
        assert rel_err(out[keep], ref[keep]) < TOL
        assert flash_attn_stand_in[-1] == call


def test_readme_gpu_snippet_runs():
    """The python block of the README's GPU section (on a CPU: the kernel through the interpreter)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("<!-- section:gpu -->")[1].split("<!-- /section:gpu -->")[0]
    blocks = section.split("```python\n")[1:]
    assert blocks, "README's GPU section has no python block"
    for block in blocks:
        exec(compile(block.split("```")[0], "README.md", "exec"), {})


def test_kernel_registers_compiles_the_flash_diff_kernels_for_the_h200_without_a_gpu():
    """benchmarks/kernel_registers.py's promise (README): the dK/dV kernel compiled for sm_90a on this machine, at
    V1's and V2's shapes (`--mode`), with ptxas's registers (at most 255 a thread) and spill bytes; the config that
    spills nothing on the H200 (16 x 32 keys, 4 warps, 2 stages, `results_h200_flash_diff_backward_sweep.md`) spills
    nothing here either, in both modes. `--kernel dq` and `--kernel fwd` compile too, and each has its two tile loops
    (the keys every query sees, the diagonal), each with tensor-core products (HGMMA) and the probabilities'
    exponentials (MUFU)."""
    pytest.importorskip("triton.backends.nvidia", reason="triton's CUDA backend (and its ptxas) is not installed")
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    script = (
        "import kernel_registers as k\n"
        "for mode in ('v1', 'v2'):\n"
        "    print(*k.ptxas_report(k._flash_diff_bwd_dkdv, dict(k.SHAPES[mode], BLOCK_M=16, BLOCK_N=32), 4, 2))\n"
        "for name in ('dq', 'fwd'):\n"
        "    kernel, _, extra = k.KERNELS[name]\n"
        "    c = k.ptxas_counts(kernel, dict(k.SHAPES['v2'], **extra, BLOCK_M=64, BLOCK_N=32), 4, 2)\n"
        "    print(c['registers'], *(f\"{n}:{o['HGMMA'] > 0}:{o['MUFU'] > 0}\" for n, _, o in c['loops']))\n"
    )
    lines = [line.split() for line in compiled_run(script, benchmarks).split("\n") if line]
    reports = [tuple(map(int, line)) for line in lines[:2]]
    assert len(reports) == 2 and all(0 < registers <= 255 and spilled == 0 for registers, spilled in reports)
    for registers, *loops in lines[2:]:  # dq, fwd
        assert 0 < int(registers) <= 255 and len(loops) == 2, lines
        assert all(loop.endswith(":True:True") and int(loop.split(":")[0]) > 100 for loop in loops), lines
