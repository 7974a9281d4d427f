"""The training MLP on quack's GEMMs (`modeling_diff/kernels/quack_mlp.py`): on the CPU, the node's use of quack's
API (its operands' layouts: [W_gate; W_up] read as interleaved pairs, the gradient written back concatenated)
through quack's own reference implementations of the same calls (`gemm_ref`, `gemm_gated_ref`, `gemm_dgated_ref`),
against transformers' LlamaMLP; which calls go to it; and on a Hopper GPU with the package, the kernels themselves
against the formula written here."""

import math
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from modeling_diff.kernels import quack_mlp, swiglu
from modeling_diff.modeling_diff_llama import DiffLlamaMLP

from conftest import tiny_config

HOPPER_WITH_QUACK = (
    torch.cuda.is_available() and quack_mlp.quack_installed() and torch.cuda.get_device_capability()[0] == 9
)
needs_hopper_with_quack = pytest.mark.skipif(
    not HOPPER_WITH_QUACK,
    reason="quack's GEMMs need a Hopper GPU and quack-kernels (none here); the CPU tests in this file check the "
    "node through quack's reference implementations, and benchmarks/gpu_tests.sh runs these on the GPU",
)


class _CpuTorch:
    """torch for quack's reference GEMMs on the CPU: they pass `out_dtype` to torch.mm, which only CUDA implements;
    the tests' operands already have the output's dtype."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def mm(a, b, out_dtype=None, out=None):
        return torch.mm(a, b, out=out)

    @staticmethod
    def bmm(a, b, out_dtype=None, out=None):
        return torch.bmm(a, b, out=out)


@pytest.fixture
def quack_reference(monkeypatch):
    """The node's three quack calls replaced by quack's reference implementations of them (the kernels' options,
    which do not change the result, dropped). -> the list of the calls' names, in order."""
    from quack import gemm_interface

    monkeypatch.setattr(gemm_interface, "torch", _CpuTorch())
    calls = []

    def gemm(a, b, concat_layout=None, dynamic_scheduler=False, tuned=True):
        calls.append(("gemm", concat_layout))
        return gemm_interface.gemm_ref(a, b, concat_layout=concat_layout)

    def gemm_gated(a, b, activation, concat_layout=None, tuned=True):
        calls.append(("gemm_gated", concat_layout))
        return gemm_interface.gemm_gated_ref(a, b, activation=activation, concat_layout=concat_layout)

    def gemm_dgated(a, b, preact, activation, dynamic_scheduler=True, tuned=True):
        calls.append(("gemm_dgated", None))
        with torch.enable_grad():  # the reference differentiates the activation with autograd
            return gemm_interface.gemm_dgated_ref(a, b, preact, activation=activation)

    monkeypatch.setattr(quack_mlp, "quack_gemms", lambda: (gemm, gemm_gated, gemm_dgated))
    return calls


def mlp_pair(hidden=32, intermediate=40, dtype=torch.float64):
    """(DiffLlamaMLP, transformers' LlamaMLP) with the same weights."""
    config = tiny_config("v1", hidden_size=hidden, intermediate_size=intermediate)
    torch.manual_seed(0)
    ours = DiffLlamaMLP(config).to(dtype)
    theirs = LlamaMLP(config).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def node(mlp, x):
    return quack_mlp.quack_swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def test_the_node_is_llama_mlp_through_quack_s_reference_gemms(quack_reference):
    """Output and the four gradients equal LlamaMLP's (float64), through the calls the GPU makes: the gated product
    and the weights' gradient in quack's concatenated layout, the activation's gradient from the interleaved preact."""
    ours, theirs = mlp_pair()
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 7, 32, dtype=torch.float64)
    out = node(ours, x)
    assert quack_reference == [("gemm_gated", ("B",))]
    grads = torch.autograd.grad(out, (x, *ours.parameters()), grad_out)
    assert quack_reference[1:] == [("gemm_dgated", None), ("gemm", ("B",)), ("gemm", ("out",))]
    x_ref = x.detach().requires_grad_()
    ref = theirs(x_ref)
    ref_grads = torch.autograd.grad(ref, (x_ref, *theirs.parameters()), grad_out)
    assert out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_node_keeps_x_and_the_two_projections_only(quack_reference):
    """For the backward it keeps x and preact (gate(x) and up(x) interleaved: two (tokens x intermediate) tensors'
    worth, as `swiglu.py`'s node), not the product, and not the concatenated weight."""
    ours, _ = mlp_pair()
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        node(ours, x)
    weights = [tuple(p.shape) for p in ours.parameters()]
    assert sorted(kept) == sorted([(15, 32), (15, 80), *weights])


def test_weight_gradients_accumulate_and_frozen_inputs_get_none(quack_reference):
    """Two backward passes into .grad (gradient accumulation: the gate and up gradients are halves of one buffer)
    add up to twice one pass; with the weights frozen only x gets a gradient, with x frozen only the weights."""
    ours, theirs = mlp_pair()
    x = torch.randn(4, 32, dtype=torch.float64)
    for _ in range(2):
        node(ours, x).sum().backward()
    theirs(x).sum().backward()
    for mine, ref in zip(ours.parameters(), theirs.parameters()):
        assert torch.allclose(mine.grad, 2 * ref.grad, rtol=1e-12, atol=1e-12)

    ours.zero_grad(set_to_none=True)
    ours.requires_grad_(False)
    x.requires_grad_()
    node(ours, x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in ours.parameters())
    ours.requires_grad_(True)
    ours.gate_proj.weight.requires_grad_(False)
    x = x.detach()
    node(ours, x).sum().backward()
    assert ours.up_proj.weight.grad is not None and ours.gate_proj.weight.grad is None


def test_the_training_mlp_goes_to_quack_where_it_runs(quack_reference, monkeypatch):
    """`swiglu_mlp` (DiffLlamaMLP's training forward) takes the node where `quack_mlp_runs_on` holds, with x and the
    weights cast first as F.linear would (autocast), and `swiglu.py`'s node where it does not."""
    ours, theirs = mlp_pair(dtype=torch.float32)
    x = torch.randn(2, 3, 32, requires_grad=True)
    monkeypatch.setattr(swiglu, "quack_mlp_runs_on", lambda *tensors: True)
    out = swiglu.swiglu_mlp(x, ours.gate_proj.weight, ours.up_proj.weight, ours.down_proj.weight)
    assert quack_reference == [("gemm_gated", ("B",))]
    assert torch.allclose(out, theirs(x), rtol=1e-5, atol=1e-6)
    seen = []
    monkeypatch.setattr(swiglu, "quack_mlp_runs_on", lambda *tensors: seen.append(tensors[0].dtype) or False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(swiglu._SwiGLUMLP, "apply", lambda *tensors: "the project's node")
        assert swiglu.swiglu_mlp(x, ours.gate_proj.weight, ours.up_proj.weight, ours.down_proj.weight) == \
            "the project's node"
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("version, taken", [("0.5.3", False), ("0.6.4", False), ("0.6.5", True), ("0.7.0rc1", True),
                                            ("1.0", True)])
def test_quack_versions_before_the_measured_calls_are_left_alone(monkeypatch, version, taken):
    """flash-attn-4 installs quack-kernels >= 0.5.3; the node's calls (concat_layout) are those of 0.6.5."""
    monkeypatch.setattr(quack_mlp.importlib.metadata, "version", lambda name: version)
    assert quack_mlp.quack_installed.__wrapped__() is taken


def test_which_calls_quack_takes(monkeypatch):
    """Only where turned on (`MODELING_DIFF_QUACK=1`), not on the CPU, not float32, not sizes its kernels refuse."""
    monkeypatch.setattr(quack_mlp, "ENABLED", True)
    w_gate, w_up, w_down = torch.empty(16, 8), torch.empty(16, 8), torch.empty(8, 16)
    x = torch.empty(3, 8)
    assert not quack_mlp.quack_mlp_runs_on(x.bfloat16(), w_gate.bfloat16(), w_up.bfloat16(), w_down.bfloat16())
    if HOPPER_WITH_QUACK:
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        cuda = [torch.empty(t.shape, **bf16) for t in (x, w_gate, w_up, w_down)]
        assert quack_mlp.quack_mlp_runs_on(*cuda)
        assert not quack_mlp.quack_mlp_runs_on(*(t.float() for t in cuda))
        odd = [torch.empty(3, 12, **bf16), torch.empty(16, 12, **bf16), torch.empty(16, 12, **bf16),
               torch.empty(12, 16, **bf16)]
        assert not quack_mlp.quack_mlp_runs_on(*odd)
        monkeypatch.setattr(quack_mlp, "ENABLED", False)
        assert not quack_mlp.quack_mlp_runs_on(*cuda)


def test_our_calls_compile_quack_s_hopper_kernels_on_the_cpu():
    """The node's four calls (forward and backward, the ~1.1B MLP's shapes) compiled for the H100 / H200 (sm_90a) by
    the installed package on the CPU, with fake tensors (FakeTensorMode, the node's staticmethods called directly:
    autograd wants a CUDA device here), QUACK_ARCH naming the architecture, the H100's 132 multiprocessors for its
    persistent schedule, and each compiled kernel recorded in place of its launch (no driver here). This is where a
    change of quack's API, or a layout its kernels refuse, shows up without a GPU."""
    script = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import quack.cute_dsl_utils, quack.gemm, quack.gemm_runtime.host
from modeling_diff.kernels.quack_mlp import _QuackSwiGLUMLP

clusters = lambda size, **kwargs: 132 // size
quack.cute_dsl_utils.get_max_active_clusters = quack.gemm.get_max_active_clusters = clusters
quack.gemm_runtime.host.get_max_active_clusters = clusters
launches = []
quack.gemm.launch_gemm = quack.gemm_runtime.host.launch_gemm = lambda plan, *args: launches.append(plan.compiled_fn)

class Ctx:
    needs_input_grad = (True, True, True, True)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

with FakeTensorMode():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, w_gate, w_up = (torch.empty(rows, 2048, **bf16) for rows in (8192, 8192, 8192))
    w_down = torch.empty(2048, 8192, **bf16)
    ctx = Ctx()
    out = _QuackSwiGLUMLP.forward(ctx, x.view(4, 2048, 2048), w_gate, w_up, w_down)
    grads = _QuackSwiGLUMLP.backward(ctx, torch.empty_like(out))
print(tuple(out.shape), *(tuple(g.shape) for g in grads), len(launches), all(launches))
"""
    env = dict(os.environ, QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", QUACK_CACHE_ENABLED="0")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["4", "True"]
    assert run.stdout.replace(" ", "").split(")")[:5] == [
        "(4,2048,2048", "(4,2048,2048", "(8192,2048", "(8192,2048", "(2048,8192"]


@needs_hopper_with_quack
@pytest.mark.parametrize("tokens, hidden, intermediate", [(8192, 2048, 8192), (2 * 333, 256, 1024)])
def test_quack_s_kernels_match_the_formula(tokens, hidden, intermediate, monkeypatch):
    """On the GPU: the node's output and gradients against down(silu(gate x) * up x) in float64 (bf16 inputs), as
    close as `swiglu.py`'s node is (both round to bf16; the epilogue rounds gate(x) and up(x) later)."""
    torch.manual_seed(1)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, **bf16)
    weights = [torch.randn(intermediate, hidden, **bf16) * hidden**-0.5 for _ in range(2)]
    weights.append(torch.randn(hidden, intermediate, **bf16) * intermediate**-0.5)
    grad_out = torch.randn(tokens, hidden, **bf16)
    leaves64 = [t.double().requires_grad_() for t in (x, *weights)]
    x64, g64, u64, d64 = leaves64
    gate, up = x64 @ g64.T, x64 @ u64.T
    ref = (gate * torch.sigmoid(gate) * up) @ d64.T
    ref_grads = torch.autograd.grad(ref, leaves64, grad_out.double())

    def errors(fn):
        leaves = [t.detach().requires_grad_() for t in (x, *weights)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_out)
        return [((g.double() - w).norm() / w.norm()).item() for g, w in zip((out, *grads), (ref, *ref_grads))]

    monkeypatch.setattr(quack_mlp, "ENABLED", True)
    assert quack_mlp.quack_mlp_runs_on(x, *weights)
    theirs = errors(swiglu._SwiGLUMLP.apply)
    ours = errors(quack_mlp.quack_swiglu_mlp)
    for mine, project in zip(ours, theirs):
        assert mine < 1e-2 and mine < 2 * project + 1e-3, (ours, theirs)
    assert math.isfinite(sum(ours))
