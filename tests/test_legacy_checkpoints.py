"""Checkpoints saved before the scale-out layout load unchanged: V1's lambda vectors at `self_attn.lambda_q1 ..`
(float32), DEX's scalar float32 `self_attn.lambda_learn`, a float32 `self_attn.anneal_step` (now
`self_attn.annealing.step`); full checkpoints through `from_pretrained`, LoRA adapter files (the old `save_lora`
wrote the bare parameters into them) through `PeftModel.from_pretrained`. Saving always writes the current layout."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_model
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from modeling_diff import set_anneal_step
from modeling_diff.lora import lora_config


def legacy_key(name: str) -> str:
    return re.sub(r"\.(diff_lambda|dex_lambda)\.", ".", name).replace(".annealing.step", ".anneal_step")


def legacy_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith("lambda_learn"):
        return tensor.float().reshape(())
    if name.endswith("anneal_step") or re.search(r"lambda_[qk][12]$", name):
        return tensor.float()
    return tensor


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_old_full_checkpoint_loads_with_the_same_logits_and_resaves_in_the_current_layout(mode, tmp_path):
    model = tiny_model(mode, anneal_steps=0 if mode == "v1" else 10)
    if mode != "v1":
        set_anneal_step(model, 3)
    model.config.save_pretrained(tmp_path / "old")
    old_state = {legacy_key(n): legacy_tensor(legacy_key(n), t).contiguous() for n, t in model.state_dict().items()}
    assert any(k.endswith("self_attn.lambda_q1" if mode == "v1" else "self_attn.anneal_step") for k in old_state)
    save_file(old_state, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "old", attn_implementation="eager").eval()
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    if mode != "v1":
        assert loaded.model.layers[0].self_attn.anneal_step.item() == 3
    loaded.save_pretrained(tmp_path / "new")
    assert load_file(tmp_path / "new" / "model.safetensors").keys() == model.state_dict().keys()


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_old_checkpoint_through_torch_s_load_state_dict_keeps_every_tensor(mode):
    """Trainer's resume and `load_state_dict` load through torch, where transformers' renaming does not run: an old
    checkpoint's `self_attn.anneal_step`, `lambda_learn` and `lambda_q1 ..` were unexpected keys, and t and lambda
    kept the model's values (a resumed DEX run ended 2 steps behind and 8.7e-3 away from the uninterrupted one). They
    land in their modules now: strict loading finds nothing missing or unexpected, and the logits are the saved
    model's."""
    model = tiny_model(mode, anneal_steps=0 if mode == "v1" else 10).eval()
    if mode != "v1":
        set_anneal_step(model, 7)
    old_state = {legacy_key(n): legacy_tensor(legacy_key(n), t) for n, t in model.state_dict().items()}
    torch.manual_seed(1)
    loaded = tiny_model(mode, anneal_steps=0 if mode == "v1" else 10).eval()
    loaded.load_state_dict(old_state)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    if mode != "v1":
        assert {layer.self_attn.anneal_step.item() for layer in loaded.model.layers} == {7}


@pytest.mark.parametrize("mode", ["v1", "dex"])
def test_old_lora_adapter_with_bare_differential_parameters_loads_them(mode, tmp_path):
    old_modules = ["subln", "lambda_proj", "dex_proj"]  # the old lora_config(): bare parameters saved beside them
    peft_model = get_peft_model(tiny_model(mode), lora_config(r=4, modules_to_save=old_modules))
    peft_model.save_pretrained(tmp_path)
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    trained = {}
    for name, parameter in peft_model.named_parameters():
        if ".diff_lambda." in name or ".dex_lambda." in name:
            trained[name] = torch.full_like(parameter, 0.125)
            adapter[legacy_key(name)] = legacy_tensor(name, trained[name]).contiguous()
    save_file(adapter, tmp_path / "adapter_model.safetensors", metadata={"format": "pt"})

    reloaded = PeftModel.from_pretrained(tiny_model(mode), tmp_path)
    parameters = dict(reloaded.named_parameters())
    assert trained
    for name, value in trained.items():
        torch.testing.assert_close(parameters[name], value)


def save_legacy(model, folder, anneal_step=None) -> None:
    """`model` saved in the old layout, its `anneal_step` (float32 then) replaced by `anneal_step` where given."""
    model.config.save_pretrained(folder)
    state = {legacy_key(n): legacy_tensor(legacy_key(n), t).contiguous() for n, t in model.state_dict().items()}
    if anneal_step is not None:
        state = {n: torch.tensor(anneal_step) if n.endswith("anneal_step") else t for n, t in state.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("step", [float("nan"), float("inf"), -50.0, -1])
def test_an_anneal_step_no_training_reaches_is_refused_when_the_checkpoint_loads(step, tmp_path):
    """A crafted (or corrupt) anneal_step loaded unchecked: NaN and inf read as -2**63, and lambda -1.7e33 made every
    logit 0, silently; -50 gave t/T = -0.5. A ValueError naming the buffer (set_anneal_step's rule)."""
    save_legacy(tiny_model("dex", anneal_steps=100), tmp_path, anneal_step=step)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.annealing\.step is -\d+ in the checkpoint: the "
                                         r"annealing step t must be a whole number of optimizer steps in \[0, 2\*\*62\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("step", [float("nan"), -5])
def test_an_adapter_or_state_dict_whose_annealing_step_no_training_reaches_is_refused(step, tmp_path):
    """PEFT's adapter loading and torch's `load_state_dict` bypassed the check of `from_pretrained`: an adapter whose
    t was NaN loaded as -2**63 and every logit was 0, silently; -5 loaded too. A ValueError naming the tensor."""
    peft_model = get_peft_model(tiny_model("dex", anneal_steps=10), lora_config(r=4))
    peft_model.save_pretrained(tmp_path)
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    keys = [key for key in adapter if key.endswith("annealing.step")]
    assert keys
    adapter.update({key: torch.tensor(step) for key in keys})
    save_file(adapter, tmp_path / "adapter_model.safetensors", metadata={"format": "pt"})
    rule = r"step is -\d+ in the checkpoint: the annealing step t must be a whole number"
    adapter_t = r"model\.layers\.0\.self_attn\.annealing\.modules_to_save\.default\."
    with pytest.raises(ValueError, match=adapter_t + rule):
        PeftModel.from_pretrained(tiny_model("dex", anneal_steps=10), tmp_path)
    state = {n: torch.tensor(step) if n.endswith("annealing.step") else t
             for n, t in tiny_model("dex", anneal_steps=10).state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.annealing\." + rule):
        tiny_model("dex", anneal_steps=10).load_state_dict(state)


@pytest.mark.parametrize("step", [float("nan"), float("inf"), 10**30, 2**63, -1, 2.5, "3", True])
def test_set_anneal_step_refuses_what_is_no_step_naming_it(step):
    """NaN was "cannot convert float NaN to integer", inf and 10**30 an OverflowError, 2**63 torch's RuntimeError."""
    with pytest.raises(ValueError, match=r"step must be a non-negative whole number of optimizer steps below 2\*\*62"):
        set_anneal_step(tiny_model("v2", anneal_steps=10), step)


def test_legacy_checkpoints_loading_in_two_threads_at_once_keep_their_weights(tmp_path):
    """The legacy layout's mapping was registered around each load and removed at its end for the whole process: a
    load ending in one thread removed it under another's, which loaded its old-layout lambdas at random (only
    transformers' load report said so). Run in a process of its own: transformers' from_pretrained swaps
    process-wide functions while it loads (`no_tie_weights`, `no_init_weights`), which loads in two threads can
    leave swapped, and later tests of the process would build models without tied weights."""
    for name, layers in (("big", 24), ("small", 1)):
        save_legacy(tiny_model("v1", num_hidden_layers=layers), tmp_path / name)
    script = textwrap.dedent(f"""
        import json, threading
        from transformers import AutoModelForCausalLM
        import modeling_diff  # noqa: F401
        reports, errors = [], []

        def load(name, times):
            try:
                for _ in range(times):
                    info = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + name,
                                                                output_loading_info=True)[1]
                    reports.append(sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]))
            except Exception as error:
                errors.append(repr(error))

        threads = [threading.Thread(target=load, args=("big", 3)), threading.Thread(target=load, args=("small", 30))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(json.dumps({{"reports": reports, "errors": errors}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["errors"], result["errors"]
    assert len(result["reports"]) == 33 and not any(result["reports"]), result["reports"]
