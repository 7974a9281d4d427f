"""Liger Kernel in DiffLlama (`modeling_diff.liger`): losses and gradients against the plain path and the formula.

Liger's kernels are Triton: on a GPU they run compiled, at the ~1.1B model's lm_head shape for the loss; on a CPU
(CI) through Triton's interpreter (TRITON_INTERPRET=1, set by conftest) on tiny shapes, with the three shims of
`liger_runs_on_the_interpreter` (the interpreter of triton 3.6 under numpy >= 2.3 differs from compiled Triton in
ways Liger's kernels meet; none changes their arithmetic).
"""

import copy
import functools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import MODES, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from modeling_diff import DiffLlamaConfig, DiffLlamaForCausalLM, apply_liger_kernel_to_diff_llama, modeling_diff_llama
from modeling_diff.diff_attention import SublnRMSNorm
from modeling_diff.liger import (apply_liger_kernel_with_the_model_s_own_code, fused_loss_chunk_budget,
                                 liger_fused_linear_loss)

pytest.importorskip("liger_kernel", reason="liger-kernel (the [liger] extra) is not installed")
from liger_kernel.transformers.rms_norm import LigerRMSNorm  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOL = 1e-4  # relative error ||got - want|| / ||want||, float32 models


@pytest.fixture(autouse=True)
def liger_runs_on_the_interpreter(monkeypatch):
    """Where Triton's interpreter runs the kernels: compiled Triton passes a float argument (Liger's eps) as an fp32
    scalar, the interpreter as a Python float; libdevice's rsqrt returns None there. (Its scalars as loop bounds:
    modeling_diff mends those under the interpreter, `_triton.interpreter_takes_runtime_loop_bounds`.)"""
    if GPU:
        return
    import liger_kernel.ops.rms_norm as liger_rms_norm
    import triton.language as tl
    from triton.runtime import interpreter

    implicit_cvt = interpreter._implicit_cvt

    def float_as_fp32(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return implicit_cvt(arg)

    monkeypatch.setattr(interpreter, "_implicit_cvt", float_as_fp32)
    monkeypatch.setattr(liger_rms_norm, "rsqrt", lambda x: tl.math.rsqrt(x))  # tl.math's, as patched at run time


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def plain_and_liger(mode: str, **apply_kwargs):
    """The same tiny model twice, in training mode, the second with Liger's kernels applied to it."""
    plain = tiny_model(mode).to(DEVICE).train()
    liger = copy.deepcopy(plain)
    apply_liger_kernel_to_diff_llama(model=liger, **apply_kwargs)
    return plain, liger


def masked_batch(vocab_size: int, batch: int = 3, length: int = 12):
    """Token ids and labels whose rows supervise different numbers of tokens (-100 elsewhere)."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, vocab_size, (batch, length), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100
    labels[1, 8:] = -100
    return input_ids.to(DEVICE), labels.to(DEVICE)


def formula_loss(logits, labels, num_items=None):
    """Causal-LM loss written out: token t predicts label t + 1; -100 ignored; mean, or sum / num_items."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total / ((targets != -100).sum() if num_items is None else num_items)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def assert_same_gradients(plain, liger):
    names = [n for n, p in plain.named_parameters() if p.grad is not None]
    assert names == [n for n, p in liger.named_parameters() if p.grad is not None]
    assert rel_err(grads(liger), grads(plain)) < TOL


def test_diff_llama_is_in_liger_model_type_dispatch():
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    assert MODEL_TYPE_TO_APPLY_LIGER_FN[DiffLlamaConfig.model_type] is apply_liger_kernel_with_the_model_s_own_code
    model = tiny_model("v1")
    _apply_liger_kernel_to_instance(model=model)  # what Trainer's use_liger_kernel=True calls
    assert model.fused_linear_loss is not None
    decoder = model.model
    norms = [decoder.norm] + [n for layer in decoder.layers for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
    assert all("forward" not in vars(n) for n in norms)  # by default the project's RMSNorm kernel stays
    # swiglu=True (the default) keeps the project's MLP: it fuses silu(gate) * up as Liger's does, and keeps less
    assert all(type(layer.mlp) is modeling_diff_llama.DiffLlamaMLP and "forward" not in vars(layer.mlp)
               for layer in decoder.layers)
    assert DiffLlamaForCausalLM.fused_linear_loss is None  # the instance, not the class

    _apply_liger_kernel_to_instance(model=model, rms_norm=True)  # a liger_kernel_config's keyword arguments
    assert all(n._get_name() == "LigerRMSNorm" for n in norms)
    subln = decoder.layers[0].self_attn.subln  # V1's per-head norm is read by the attention's combine: untouched
    assert type(subln) is SublnRMSNorm and "forward" not in vars(subln)


def test_a_model_of_an_exported_folders_remote_code_is_patched_with_its_own_code(tmp_path):
    """An exported folder loaded with trust_remote_code=True before modeling_diff is imported is of the folder's copy
    of the classes. Liger's dispatch entry for its model type was the package's function, and Trainer's
    use_liger_kernel=True raised "model must be a DiffLlama model (or a PEFT model of one), got
    DiffLlamaForCausalLM". The entry now patches each model with its own code's copy of `modeling_diff.liger` (the
    folder registers it, `remote_code.py`); the package's function, called by hand on the folder's model, still says
    it is remote code and how to load the package's classes (the user's order, in a process of its own)."""
    from ecosystem_helpers import PYTHON, offline_env

    from modeling_diff.hub import save_for_hub

    folder = save_for_hub(tiny_model("v2"), tmp_path / "export")
    script = f"""
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
remote = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
import modeling_diff
assert type(remote).__module__.startswith("transformers_modules."), type(remote).__module__
try:
    modeling_diff.apply_liger_kernel_to_diff_llama(model=remote)
except ValueError as error:
    print("ERROR", " ".join(str(error).split()))
# on the GPU where there is one: Liger's Triton kernels take CPU tensors only under TRITON_INTERPRET=1 (the CPU's CI)
args = TrainingArguments(output_dir={str(tmp_path / "out")!r}, use_cpu=not torch.cuda.is_available(), report_to=[],
                         use_liger_kernel=True, max_steps=1, per_device_train_batch_size=2, save_strategy="no",
                         disable_tqdm=True)
data = [{{"input_ids": ids, "labels": ids}} for ids in torch.randint(3, 90, (2, 8))]
for model in (remote, AutoModelForCausalLM.from_pretrained({str(folder)!r})):  # Trainer patches as train() starts
    Trainer(model=model, args=args, train_dataset=data).train()
    print("PATCHED", type(model).__module__, model.fused_linear_loss.__module__)
"""
    out = subprocess.run([PYTHON, "-c", script], cwd=tmp_path, env=offline_env(tmp_path), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    error = next((line for line in out.stdout.splitlines() if line.startswith("ERROR ")), out.stdout[-3000:])
    assert re.search(r"got DiffLlamaForCausalLM of remote code \(transformers_modules\..*\): load the folder without "
                     r"trust_remote_code, with modeling_diff imported", error), error
    patched = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("PATCHED ")]
    assert len(patched) == 2 and all(loss == cls.rpartition(".")[0] + ".liger" for cls, loss in patched), out.stdout
    assert patched[0][0].startswith("transformers_modules.") and patched[1][0] == "modeling_diff.modeling_diff_llama"


def test_liger_rms_norm_on_the_instance_keeps_its_forward_in_decoding_steps(monkeypatch):
    """`_apply_liger_kernel_to_instance(model=..., rms_norm=True)` binds LigerRMSNorm's forward to each norm of the
    model; the decoder layer's one-pass residual add and post-attention norm (`add_and_norm`) must then leave the
    norm to Liger's forward, in the prefill and in every decoding step, and the logits stay the unpatched model's."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    fused, liger_norms = [], []
    add_rms_norm, liger_forward = modeling_diff_llama.add_rms_norm, LigerRMSNorm.forward
    monkeypatch.setattr(modeling_diff_llama, "add_rms_norm", lambda *a: fused.append(1) or add_rms_norm(*a))
    monkeypatch.setattr(LigerRMSNorm, "forward", lambda self, x: liger_norms.append(1) or liger_forward(self, x))
    implementation = "sdpa" if GPU else "diff_triton"  # the fast implementations, where the one-pass add applies
    plain = tiny_model("v2", attn_implementation=implementation).to(DEVICE)
    liger = copy.deepcopy(plain)
    _apply_liger_kernel_to_instance(model=liger, rms_norm=True)
    ids = torch.randint(3, plain.config.vocab_size, (2, 6), device=DEVICE)
    layers = plain.config.num_hidden_layers
    logits = []
    with torch.no_grad():
        for model in (plain, liger):
            out = model(ids, use_cache=True)
            steps = [out.logits[:, -1]]
            for token in ids[:, :2].T:  # two decoding steps of one token
                out = model(token[:, None], past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits[:, -1])
            logits.append(torch.stack(steps, 1))
            if model is plain:
                # The prefill and each step: every layer's post-attention norm, and where the MLP's residual add is
                # left to the next norm's pass (not in down_proj's split, as on the CPU), the next layer's input norm
                # and the final norm too (the H200 with sdpa: 4 a call).
                assert 3 * layers <= len(fused) <= 3 * 2 * layers
                fused.clear()
    assert fused == [] and len(liger_norms) == 3 * (2 * layers + 1)  # input, post-attention and final norms
    assert rel_err(logits[1], logits[0]) < TOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rms_norm", [False, True])
def test_training_loss_and_gradients_match_the_plain_path_and_the_formula(mode, rms_norm):
    plain, liger = plain_and_liger(mode, rms_norm=rms_norm)
    input_ids, labels = masked_batch(plain.config.vocab_size)

    out = liger(input_ids=input_ids, labels=labels)
    assert out.logits is None  # the fused loss never materialises them
    out.loss.backward()
    reference = plain(input_ids=input_ids, labels=labels)
    reference.loss.backward()

    assert rel_err(out.loss, formula_loss(reference.logits.detach(), labels)) < TOL
    assert rel_err(out.loss, reference.loss) < TOL
    assert_same_gradients(plain, liger)


def test_num_items_in_batch_accumulates_to_the_full_batch():
    """Two micro-batches with Trainer's num_items_in_batch (the whole batch's supervised tokens) sum to the full
    batch's loss and gradients, as on the plain path."""
    plain, liger = plain_and_liger("v1", rms_norm=True)
    input_ids, labels = masked_batch(plain.config.vocab_size, batch=4)
    num_items = (labels[:, 1:] != -100).sum()
    with torch.no_grad():
        full = formula_loss(plain.eval()(input_ids=input_ids).logits, labels)
    plain.train()

    total = 0.0
    for part in (slice(0, 1), slice(1, 4)):
        loss = liger(input_ids=input_ids[part], labels=labels[part], num_items_in_batch=num_items).loss
        loss.backward()
        total += loss.detach()
        plain(input_ids=input_ids[part], labels=labels[part], num_items_in_batch=num_items).loss.backward()
    assert rel_err(total, full) < TOL
    assert_same_gradients(plain, liger)


def test_logits_to_keep_and_shift_labels():
    """logits_to_keep=k scores the last k positions against labels of length k; shift_labels are used as given."""
    plain, liger = plain_and_liger("v2")
    input_ids, labels = masked_batch(plain.config.vocab_size)
    keep = 5
    with torch.no_grad():
        kept_logits = plain.eval()(input_ids=input_ids).logits[:, -keep:]
    plain.train()
    out = liger(input_ids=input_ids, labels=labels[:, -keep:], logits_to_keep=keep)
    assert out.logits is None
    assert rel_err(out.loss, formula_loss(kept_logits, labels[:, -keep:])) < TOL

    shift = labels.roll(-1, dims=1)  # the target of every position given directly
    shift[:, -1] = -100
    got = liger(input_ids=input_ids, labels=labels, shift_labels=shift).loss
    want = plain(input_ids=input_ids, labels=labels, shift_labels=shift).loss
    assert rel_err(got, want) < TOL


def assert_labels_assert_on_the_device(path: str, bad_id: int) -> None:
    """A child process runs the plain or the Liger model of `plain_and_liger` on labels holding `bad_id`: the
    device-side assert must stop it (without the fused loss's check, Liger's kernel returned a loss of -1e13)."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_liger import masked_batch, plain_and_liger
plain, liger = plain_and_liger("v2")
input_ids, labels = masked_batch(plain.config.vocab_size)
labels[0, 3] = {bad_id}
print({path}(input_ids=input_ids, labels=labels).loss.item())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "device-side assert triggered" in result.stderr, (path, result.stdout,
                                                                                       result.stderr[-2000:])


@pytest.mark.parametrize("attack", ["another batch", "longer", "logits_to_keep", "id = vocab_size", "id -5"])
def test_labels_the_plain_path_refuses_are_refused_by_the_fused_loss(attack):
    """Liger's fused loss reads labels by flat row unchecked: labels of another batch crashed the process
    (SIGSEGV), longer ones or the whole sequence beside logits_to_keep gave a loss of the wrong rows, an id outside
    the vocabulary a loss like -1e13. transformers' loss (the plain path) raises on each; so does the fused one."""
    plain, liger = plain_and_liger("v2")
    input_ids, labels = masked_batch(plain.config.vocab_size)
    vocab = plain.config.vocab_size
    extra = {}
    if attack == "another batch":
        labels = labels[:1]
    elif attack == "longer":
        labels = torch.cat([labels, labels], dim=1)
    elif attack == "logits_to_keep":
        extra = dict(logits_to_keep=3)
    else:
        labels = labels.clone()
        labels[0, 3] = vocab if attack == "id = vocab_size" else -5
        if GPU:  # both losses assert on the device, which loses the process's CUDA context: each runs in a child
            for path in ("plain", "liger"):
                assert_labels_assert_on_the_device(path, labels[0, 3].item())
            return
    with pytest.raises((ValueError, IndexError, RuntimeError)):  # transformers' own loss refuses them
        plain(input_ids=input_ids, labels=labels, **extra)
    if attack.startswith("id"):
        message = rf"labels must be token ids in \[0, {vocab}\) or ignore_index \(-100\)"
        with pytest.raises(RuntimeError, match=message):  # asserted on the device: raised at once on the CPU
            liger(input_ids=input_ids, labels=labels, **extra)
    else:
        with pytest.raises(ValueError, match=r"labels of shape .* must match the .* positions whose logits the loss"):
            liger(input_ids=input_ids, labels=labels, **extra)


def test_eval_and_skip_logits():
    plain, liger = plain_and_liger("dex")
    input_ids, labels = masked_batch(plain.config.vocab_size)
    with torch.no_grad():
        reference = plain.eval()(input_ids=input_ids, labels=labels)
        evaluated = liger.eval()(input_ids=input_ids, labels=labels)  # eval: the plain forward, logits returned
        assert rel_err(evaluated.logits, reference.logits) < TOL and rel_err(evaluated.loss, reference.loss) < TOL
        skipped = liger(input_ids=input_ids, labels=labels, skip_logits=True)  # Trainer's eval with Liger
        assert skipped.logits is None and rel_err(skipped.loss, reference.loss) < TOL
    liger.train()
    kept = liger(input_ids=input_ids, labels=labels, skip_logits=False)
    assert kept.logits is not None and rel_err(kept.loss, reference.loss) < TOL
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        liger(input_ids=input_ids, skip_logits=True)


def test_class_level_apply_builds_liger_modules_with_the_same_checkpoint(monkeypatch):
    """apply_liger_kernel_to_diff_llama() without a model (as apply_liger_kernel_to_llama()): models built afterwards
    hold Liger's modules under the same parameter names, so a plain checkpoint loads into them."""
    for name in ("DiffLlamaRMSNorm", "DiffLlamaMLP"):  # restored after the test: the patch is process-wide
        monkeypatch.setattr(modeling_diff_llama, name, getattr(modeling_diff_llama, name))
    monkeypatch.setattr(DiffLlamaForCausalLM, "fused_linear_loss", None)
    plain = tiny_model("v1").to(DEVICE).train()
    apply_liger_kernel_to_diff_llama(rms_norm=True)
    liger = DiffLlamaForCausalLM(plain.config).to(DEVICE).train()
    assert isinstance(liger.model.norm, LigerRMSNorm)
    assert type(liger.model.layers[0].mlp) is modeling_diff_llama.DiffLlamaMLP
    assert list(liger.state_dict()) == list(plain.state_dict())
    liger.load_state_dict(plain.state_dict())

    input_ids, labels = masked_batch(plain.config.vocab_size)
    out = liger(input_ids=input_ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    reference = plain(input_ids=input_ids, labels=labels)
    reference.loss.backward()
    assert rel_err(out.loss, reference.loss) < TOL
    assert_same_gradients(plain, liger)


def test_liger_cross_entropy_on_materialised_logits(monkeypatch):
    """cross_entropy=True: Liger's cross-entropy replaces torch's for the whole process, as for Llama (restored
    after the test), so the plain reference runs before it is applied."""
    monkeypatch.setattr(F, "cross_entropy", F.cross_entropy)
    plain = tiny_model("v1").to(DEVICE).train()
    liger = copy.deepcopy(plain)
    input_ids, labels = masked_batch(plain.config.vocab_size)
    reference = plain(input_ids=input_ids, labels=labels)
    reference.loss.backward()
    want = formula_loss(reference.logits.detach(), labels)

    apply_liger_kernel_to_diff_llama(model=liger, cross_entropy=True, fused_linear_cross_entropy=False)
    out = liger(input_ids=input_ids, labels=labels)
    assert out.logits is not None
    out.loss.backward()
    assert rel_err(out.loss, want) < TOL
    assert_same_gradients(plain, liger)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cross_entropy and fused_linear_cross_entropy cannot both be True"):
        apply_liger_kernel_to_diff_llama(cross_entropy=True, fused_linear_cross_entropy=True)
    apply_liger_kernel_to_diff_llama(model=tiny_model("v2", hidden_act="gelu"))  # the MLP is the project's: any act
    # another model patched nothing, silently
    with pytest.raises(ValueError, match="model must be a DiffLlama model .*, got LlamaForCausalLM"):
        apply_liger_kernel_to_diff_llama(model=LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)))


TINY_LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)


def test_a_peft_model_is_patched_through_the_model_it_wraps():
    """A PEFT-wrapped DiffLlama was left unpatched, silently: its modules are the wrapped model's."""
    from peft import get_peft_model

    from modeling_diff.lora import lora_config

    peft_model = get_peft_model(tiny_model("v1"), lora_config(r=4))
    apply_liger_kernel_to_diff_llama(model=peft_model, rms_norm=True)
    wrapped = peft_model.get_base_model()
    assert wrapped.fused_linear_loss is not None and wrapped.fused_linear_loss.__func__ is liger_fused_linear_loss
    norms = [m for m in wrapped.modules() if type(m) is modeling_diff_llama.DiffLlamaRMSNorm]
    assert norms and all(m.forward.__func__ is LigerRMSNorm.forward for m in norms)


@pytest.mark.parametrize("mode", MODES)
def test_adapters_on_lm_head_get_the_plain_paths_loss_and_gradients(mode):
    """Liger's fused loss reads lm_head's weight alone: with LoRA on lm_head it gave the base model's loss (4.53
    against 10.60 for V1 here) and the adapter no gradient, exit status 0. Such a model's loss is now lm_head's own
    output's; merged, the fused loss takes it again (the delta is then in the weight)."""
    from peft import get_peft_model

    from modeling_diff.lora import lora_config

    plain = get_peft_model(tiny_model(mode).to(DEVICE),
                           lora_config(r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"]))
    with torch.no_grad():
        for name, parameter in plain.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)  # a trained adapter (a fresh one adds 0)
    plain.train()
    liger = copy.deepcopy(plain)
    apply_liger_kernel_to_diff_llama(model=liger)
    input_ids, labels = masked_batch(plain.config.vocab_size)
    losses = [model(input_ids=input_ids, labels=labels).loss for model in (plain, liger)]
    for loss in losses:
        loss.backward()
    with torch.no_grad():
        expected = formula_loss(plain(input_ids=input_ids).logits, labels)
    assert rel_err(losses[1], expected) < TOL and rel_err(losses[0], expected) < TOL
    assert_same_gradients(plain, liger)
    assert any("lm_head.lora_B" in name for name, p in liger.named_parameters() if p.grad is not None)
    merged = liger.merge_and_unload()
    assert merged.fused_linear_loss is not None
    assert merged(input_ids=input_ids, labels=labels).logits is None  # the fused loss again
    assert rel_err(merged(input_ids=input_ids, labels=labels).loss, expected) < TOL


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_or_bound_forward_on_lm_head_runs_under_the_fused_loss(mode):
    """Liger's fused loss reads lm_head's weight in place of calling it. With a forward hook on lm_head (or a forward
    bound on it: accelerate's hooks, which its offloading uses, added by accelerate's own `add_hook_to_module`), the
    fused loss had skipped it: a hook changing the logits changed neither loss nor gradients. Such a model's loss is
    now lm_head's own output's, as on the plain path, and lm_head is called once a step."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class ChangedLogits(ModelHook):
        def post_forward(self, module, output):
            calls.append(1)
            return output * 1.5 + 0.1

    plain = tiny_model(mode).to(DEVICE).train()
    liger = copy.deepcopy(plain)
    apply_liger_kernel_to_diff_llama(model=liger)
    input_ids, labels = masked_batch(plain.config.vocab_size)
    for bound in (False, True):
        calls, losses, handles = [], [], []
        for model in (plain, liger):
            model.zero_grad(set_to_none=True)
            lm_head = model.lm_head
            if bound:  # accelerate binds a forward on the instance
                add_hook_to_module(lm_head, ChangedLogits())
                assert "forward" in vars(lm_head)
            else:
                handles.append(lm_head.register_forward_hook(lambda m, a, out: calls.append(1) or out * 1.5 + 0.1))
            losses.append(model(input_ids=input_ids, labels=labels).loss)
            losses[-1].backward()
        assert len(calls) == 2  # lm_head once in each model's step
        with torch.no_grad():
            expected = formula_loss(plain(input_ids=input_ids).logits, labels)  # the logits as lm_head changes them
        assert rel_err(losses[1], expected) < TOL and rel_err(losses[0], expected) < TOL
        assert_same_gradients(plain, liger)
        for model in (plain, liger):
            if bound:
                remove_hook_from_module(model.lm_head)
        for handle in handles:
            handle.remove()


def liger_chunk_rows(tokens: int, hidden: int, vocab: int, budget: int) -> int:
    """Rows of a chunk of Liger's fused loss (liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5)."""
    per_chunk = -(-tokens // -(-vocab // (budget * hidden)))
    return min(1 << (per_chunk - 1).bit_length(), tokens)


@pytest.mark.parametrize("tokens", [1, 1000, 2048, 4096, 8192, 32768, 65536, 262144])
@pytest.mark.parametrize("hidden, vocab", [(2048, 32000), (4096, 128256), (576, 49152), (64, 128)])
def test_fused_loss_chunks_hold_2048_rows_or_every_row(tokens, hidden, vocab):
    """The budget passed to Liger gives chunks of >= 2048 rows (all rows, if fewer), and Liger's own default
    where that already does."""
    budget = fused_loss_chunk_budget(tokens, hidden, vocab)
    assert liger_chunk_rows(tokens, hidden, vocab, budget) >= min(2048, tokens)
    if liger_chunk_rows(tokens, hidden, vocab, 1) >= 2048:
        assert budget == 1


def test_fused_loss_passes_the_chunk_budget_and_a_callers_own(monkeypatch):
    """The budget goes to Liger's loss; a caller's own `chunk_mem_const` wins; a Liger without the argument gets
    none."""
    from liger_kernel.transformers.model import loss_utils

    real, budgets = loss_utils.F.liger_fused_linear_cross_entropy, []

    @functools.wraps(real)  # Liger keeps only the keyword arguments its signature names
    def spy(*args, **kwargs):
        budgets.append(kwargs.get("chunk_mem_const"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_utils.F, "liger_fused_linear_cross_entropy", spy)
    plain, liger = plain_and_liger("v2")
    input_ids, labels = masked_batch(plain.config.vocab_size)
    config = plain.config
    want = liger(input_ids=input_ids, labels=labels).loss
    got = liger(input_ids=input_ids, labels=labels, chunk_mem_const=1).loss
    monkeypatch.setattr("modeling_diff.liger.LIGER_TAKES_CHUNK_BUDGET", False)  # a Liger without the argument
    older = liger(input_ids=input_ids, labels=labels).loss
    assert budgets == [fused_loss_chunk_budget(input_ids.numel(), config.hidden_size, config.vocab_size), 1, None]
    assert rel_err(got, want) < TOL and rel_err(older, want) < TOL


@pytest.mark.skipif(not GPU, reason="the ~1.1B model's lm_head on the GPU")
def test_fused_linear_loss_at_the_1b_lm_head_in_bf16():
    """hidden 2048, vocab 32000, 2 x 2048 tokens in bf16 against the formula in float32."""
    torch.manual_seed(0)
    config = DiffLlamaConfig(diff_mode="v2", vocab_size=32000, hidden_size=2048, intermediate_size=256,
                             num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8)
    model = DiffLlamaForCausalLM(config).to(DEVICE, torch.bfloat16).train()
    apply_liger_kernel_to_diff_llama(model=model, rms_norm=False, swiglu=False)
    hidden = torch.randn(2, 2048, 2048, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32000, (2, 2048), device=DEVICE)
    labels[0, :700] = -100
    loss = model.fused_linear_loss(hidden, labels)
    got = torch.autograd.grad(loss, (hidden, model.lm_head.weight))

    h32, w32 = hidden.detach().float().requires_grad_(), model.lm_head.weight.detach().float().requires_grad_()
    want_loss = formula_loss(h32 @ w32.T, labels)
    want = torch.autograd.grad(want_loss, (h32, w32))
    assert rel_err(loss, want_loss) < 1e-2
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-2


def test_trainer_use_liger_kernel_trains_and_evaluates_as_the_plain_path(tmp_path):
    """TrainingArguments(use_liger_kernel=True) finds DiffLlama in Liger's dispatch: the model is patched, a step
    with gradient accumulation over masked labels (num_items_in_batch) gives the plain run's weights (plain SGD),
    and evaluation (Trainer passes skip_logits=True) the plain eval loss."""
    torch.manual_seed(0)
    initial = tiny_model("v2").train()
    input_ids, labels = masked_batch(initial.config.vocab_size, batch=4)
    data = [{"input_ids": x, "labels": y} for x, y in zip(input_ids.cpu(), labels.cpu())]
    runs = {}
    for use_liger in (False, True):
        model = copy.deepcopy(initial)
        args = TrainingArguments(output_dir=str(tmp_path / str(use_liger)), use_cpu=not GPU, report_to=[],
                                 save_strategy="no", disable_tqdm=True, logging_strategy="no", seed=0,
                                 dataloader_num_workers=0, max_steps=1, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5,
                                 lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                                 per_device_eval_batch_size=4, prediction_loss_only=True,
                                 use_liger_kernel=use_liger)
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
        loss = trainer.train().training_loss
        runs[use_liger] = (loss, trainer.evaluate()["eval_loss"],
                           torch.cat([p.detach().cpu().flatten() for p in model.parameters()]))
        assert (model.fused_linear_loss is not None) == use_liger
    start = torch.cat([p.detach().flatten() for p in initial.parameters()])
    (plain_loss, plain_eval, plain_weights), (loss, eval_loss, weights) = runs[False], runs[True]
    assert not torch.equal(plain_weights, start)
    assert loss == pytest.approx(plain_loss, rel=TOL) and eval_loss == pytest.approx(plain_eval, rel=TOL)
    assert rel_err(weights - start, plain_weights - start) < TOL


def test_without_liger_everything_works_and_apply_says_what_to_install():
    script = """
import sys
sys.modules["liger_kernel"] = None  # as if the [liger] extra were not installed
import torch
import modeling_diff
from modeling_diff import DiffLlamaForCausalLM, preset_config
from modeling_diff.liger import LIGER_AVAILABLE
assert not LIGER_AVAILABLE
model = DiffLlamaForCausalLM(preset_config("tiny-v1")).train()
ids = torch.randint(0, model.config.vocab_size, (2, 8))
out = model(input_ids=ids, labels=ids)
assert out.logits.shape == (2, 8, model.config.vocab_size) and torch.isfinite(out.loss)
try:
    modeling_diff.apply_liger_kernel_to_diff_llama()
except ModuleNotFoundError as error:
    assert "needs the 'liger_kernel' package: pip install 'modeling-diff[liger]'" in str(error), error
else:
    raise AssertionError("no ImportError")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
