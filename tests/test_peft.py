"""PEFT LoRA on every diff_mode: adapters on q/k/v/o and the MLP, the differential parameters trained alongside,
saved and loaded with the adapter; merge_and_unload keeps the logits."""

import os

import pytest
import torch
from ecosystem_helpers import byte_tokenizer, readme_snippet, tiny_config
from peft import PeftModel

from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.data import shakespeare, text_blocks
from modeling_diff.lora import LORA_TARGET_MODULES, get_lora_model, lora_config, save_lora

MODES = ("v1", "v2", "dex")
# What differential attention adds, per mode, as parameter-name suffixes of one attention module.
DIFFERENTIAL = {
    "v1": ("diff_lambda.lambda_q1", "diff_lambda.lambda_k1", "diff_lambda.lambda_q2", "diff_lambda.lambda_k2",
           "subln.weight"),
    "v2": ("lambda_proj.weight",),
    "dex": ("dex_proj.weight", "dex_lambda.lambda_learn"),
}


def base_model(mode: str) -> DiffLlamaForCausalLM:
    torch.manual_seed(0)
    return DiffLlamaForCausalLM(tiny_config(mode))


def active_value(model, layer: int, suffix: str) -> torch.Tensor:
    """The value the forward pass uses (for a module in modules_to_save: its trained copy)."""
    attention = model.get_base_model().model.layers[layer].self_attn
    owner, _, name = suffix.rpartition(".")
    module = getattr(attention, owner) if owner else attention
    if hasattr(module, "modules_to_save"):  # PEFT's ModulesToSaveWrapper: the trained copy is the active one
        module = module.modules_to_save["default"]
    return getattr(module, name).detach().clone()


@pytest.fixture(scope="module")
def batches():
    return text_blocks(byte_tokenizer(), shakespeare("hamlet"), length=64, count=32).split(8)


@pytest.mark.parametrize("mode", MODES)
def test_lora_trains_adapter_and_differential_parameters_and_reloads(mode, batches, tmp_path):
    model = get_lora_model(base_model(mode), lora_config(r=4, lora_alpha=8, lora_dropout=0.0))

    # A module in modules_to_save trains its copy, "<module>.modules_to_save.default.<parameter>".
    trainable = {n.replace(".modules_to_save.default", "") for n, p in model.named_parameters() if p.requires_grad}
    frozen_base = {name for name, p in model.named_parameters() if not p.requires_grad}
    for target in LORA_TARGET_MODULES:  # every projection of every layer carries an adapter
        assert sum(f".{target}.lora_A." in n for n in trainable) == model.config.num_hidden_layers, target
    for suffix in DIFFERENTIAL[mode]:
        assert sum(n.endswith(suffix) for n in trainable) == model.config.num_hidden_layers, suffix
    assert all(("lora_" in n) or any(n.endswith(s) for s in DIFFERENTIAL[mode]) for n in trainable)
    assert any(n.endswith("q_proj.base_layer.weight") for n in frozen_base)

    before = {s: active_value(model, 0, s) for s in DIFFERENTIAL[mode]}
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for step in range(12):
        batch = batches[step % len(batches)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    assert sum(losses[-3:]) < sum(losses[:3])
    for suffix, value in before.items():
        assert not torch.equal(active_value(model, 0, suffix), value), f"{suffix} was not trained"
    torch.testing.assert_close(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight, base_q)

    probe = batches[0][:2]
    with torch.no_grad():
        expected = model(input_ids=probe).logits
    save_lora(model, tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(base_model(mode), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=probe).logits, expected)
    for suffix in DIFFERENTIAL[mode]:
        torch.testing.assert_close(active_value(reloaded, 1, suffix), active_value(model, 1, suffix))

    merged = model.merge_and_unload()
    assert type(merged) is DiffLlamaForCausalLM
    assert not any("lora_" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=probe).logits, expected, rtol=1e-4, atol=1e-5)


def test_save_lora_replaces_only_an_adapter_never_its_base_model_and_writes_nothing_off_the_main_process(tmp_path):
    """Attacks that succeeded: `overwrite=True` wiped a folder of photos, and the base model's own folder (its
    weights and config deleted); with `is_main_process=False` a good adapter was replaced by an empty folder."""
    base_dir = tmp_path / "base"
    base_model("v2").save_pretrained(base_dir)
    model = get_lora_model(DiffLlamaForCausalLM.from_pretrained(base_dir))
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"jpeg")
    with pytest.raises(ValueError, match="holds no adapter_config.json, so it is not an earlier output"):
        save_lora(model, photos, overwrite=True)
    assert [p.name for p in photos.iterdir()] == ["holiday.jpg"]
    before = sorted(p.name for p in base_dir.iterdir())
    for inside in (base_dir, base_dir / "adapter"):
        with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
            save_lora(model, inside, overwrite="force")
    assert sorted(p.name for p in base_dir.iterdir()) == before
    adapter = save_lora(model, tmp_path / "adapter")
    files = sorted(p.name for p in adapter.iterdir())
    assert "adapter_config.json" in files
    save_lora(model, adapter, overwrite=True, is_main_process=False)
    assert sorted(p.name for p in adapter.iterdir()) == files
    save_lora(model, adapter, overwrite=True)  # an earlier adapter
    save_lora(model, photos, overwrite="force")
    assert (photos / "adapter_config.json").is_file() and not (photos / "holiday.jpg").exists()


def test_save_lora_on_another_rank_of_a_distributed_run_writes_nothing(tmp_path, monkeypatch):
    """Every rank may call it, as save_pretrained and save_for_hub: a rank other than 0 writes nothing (every rank
    wrote, and one meeting another's lock was refused)."""
    import torch.distributed

    model = get_lora_model(base_model("dex"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert save_lora(model, tmp_path / "adapter") == (tmp_path / "adapter").resolve()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    assert (save_lora(model, tmp_path / "adapter") / "adapter_config.json").is_file()


def test_save_lora_refuses_a_folder_whose_path_is_not_utf8(tmp_path):
    """The adapter was written, but safetensors opens UTF-8 paths only: PeftModel.from_pretrained could not load it.
    Refused before anything is written, naming the argument and the rule."""
    bad = tmp_path / os.fsdecode(b"adapter-\xff")
    with pytest.raises(ValueError, match=r"^save_directory b'.*adapter-\\xff' is not valid UTF-8: .* UTF-8 paths only"):
        save_lora(get_lora_model(base_model("v2")), bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["absolute", "a/b", "a\\b", "a\0b", "\udcff"])
def test_save_lora_refuses_an_adapter_name_that_is_not_a_plain_folder_name(tmp_path, name):
    """PEFT saves an adapter other than "default" in `save_directory/<name>`: one named by an absolute path was
    written there (adapter_config.json and weights outside save_directory, unstaged), one with a `/` in a sub-folder.
    Refused before anything is written, naming the adapter and the rule; a plain name still goes in its folder."""
    outside = tmp_path / "escape"
    name = str(outside) if name == "absolute" else name
    model = get_lora_model(base_model("v2"), lora_config(r=2))
    model.add_adapter(name, lora_config(r=2))
    for kwargs in ({}, {"selected_adapters": [name]}):
        with pytest.raises(ValueError, match=r"^adapter name .* must be a plain folder name"):
            save_lora(model, tmp_path / "adapter", **kwargs)
        assert list(tmp_path.iterdir()) == []
    save_lora(model, tmp_path / "adapter", selected_adapters=["default"])  # the bad one left out: saved
    plain = get_lora_model(base_model("v2"), lora_config(r=2))
    plain.add_adapter("extra", lora_config(r=2))
    adapter = save_lora(plain, tmp_path / "plain")
    assert (adapter / "adapter_config.json").is_file() and (adapter / "extra" / "adapter_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "plain"]


def test_differential_parameters_can_stay_frozen():
    model = get_lora_model(base_model("v1"), lora_config(modules_to_save=None))
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", MODES)
def test_plain_peft_and_trainer_train_save_and_resume_every_differential_parameter(mode, batches, tmp_path):
    """PEFT's own API (no helper of ours) with the recommended config, trained by Trainer: every differential
    parameter trains, `save_model` and the checkpoints hold it, and `resume_from_checkpoint` restores it."""
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": b, "labels": b} for b in torch.cat(batches)]

    def trainer(max_steps):
        model = get_peft_model(base_model(mode), lora_config(r=4, lora_alpha=8, lora_dropout=0.0))
        args = TrainingArguments(str(tmp_path / "run"), max_steps=max_steps, per_device_train_batch_size=4,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=2, report_to=[],
                                 use_cpu=True, disable_tqdm=True, seed=0, data_seed=0)
        return Trainer(model=model, args=args, train_dataset=data)

    before = {s: active_value(trainer(1).model, 0, s) for s in DIFFERENTIAL[mode]}
    full = trainer(4)
    full.train()
    trained = {s: active_value(full.model, 0, s) for s in DIFFERENTIAL[mode]}
    for suffix in DIFFERENTIAL[mode]:
        assert not torch.equal(trained[suffix], before[suffix]), f"{suffix} was not trained"
    full.save_model(str(tmp_path / "saved"))
    for folder in (tmp_path / "saved", tmp_path / "run" / "checkpoint-4"):
        reloaded = PeftModel.from_pretrained(base_model(mode), folder)
        for suffix in DIFFERENTIAL[mode]:
            torch.testing.assert_close(active_value(reloaded, 0, suffix), trained[suffix])

    resumed = trainer(4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for suffix in DIFFERENTIAL[mode]:
        torch.testing.assert_close(active_value(resumed.model, 0, suffix), trained[suffix])


@pytest.mark.parametrize("mode", ["v2", "dex"])
def test_an_adapter_holds_its_own_annealing_step_and_the_base_model_keeps_its_own(mode, batches, tmp_path):
    """t was a buffer of the base model only: the adapter folder held none, so `PeftModel.from_pretrained(base,
    folder)` computed the schedule at the base's t = 0 (the trained differential term off), and the base model with
    the adapter disabled (TRL's reference model) moved with training. lora_config() saves `annealing` with the
    adapter: the reloaded adapter has the trained t and logits, merging keeps t, the disabled adapter is the base."""
    from modeling_diff.annealing import anneal_state

    def base():
        torch.manual_seed(0)
        return DiffLlamaForCausalLM(tiny_config(mode, anneal_steps=10))

    model = get_lora_model(base(), lora_config(r=4, lora_alpha=8, lora_dropout=0.0)).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in batches[:3]:
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    probe = batches[0][:2]
    attentions = [layer.self_attn for layer in model.get_base_model().model.layers]
    assert [attention.anneal_step.item() for attention in attentions] == [3] * len(attentions)
    with torch.no_grad():
        expected = model(input_ids=probe).logits
        with model.disable_adapter():
            assert [attention.anneal_step.item() for attention in attentions] == [0] * len(attentions)
            torch.testing.assert_close(model(input_ids=probe).logits, base().eval()(input_ids=probe).logits)

    save_lora(model, tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(base(), tmp_path / "adapter").eval()
    assert anneal_state(reloaded)["anneal_step"] == 3
    merged = model.merge_and_unload()
    assert anneal_state(merged)["anneal_step"] == 3
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=probe).logits, expected)
        torch.testing.assert_close(merged(input_ids=probe).logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("callback", [True, False])
@pytest.mark.parametrize("mode", ["v2", "dex"])
def test_a_resumed_adapter_continues_from_the_checkpoint_s_annealing_step(mode, callback, batches, tmp_path):
    """When the adapter held no t (the attentions' buffers were the base model's), a run resumed from checkpoint-2
    began at its base's t = 0, and its parameters ended 9e-3 away from the uninterrupted run's. The checkpoint's
    adapter holds t now (`annealing` in lora_config's modules_to_save); AnnealingCallback also records its start in
    trainer_state.json and sets t when training begins. Either way the resumed run is the uninterrupted one."""
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    from modeling_diff.annealing import AnnealingCallback, anneal_state

    data = [{"input_ids": b, "labels": b} for b in torch.cat(batches)]

    def trainer():
        torch.manual_seed(0)
        model = get_peft_model(DiffLlamaForCausalLM(tiny_config(mode, anneal_steps=4)),
                               lora_config(r=4, lora_alpha=8, lora_dropout=0.0))
        args = TrainingArguments(str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=2, report_to=[],
                                 use_cpu=True, disable_tqdm=True, seed=0, data_seed=0)
        return Trainer(model=model, args=args, train_dataset=data, callbacks=[AnnealingCallback()] if callback else [])

    full = trainer()
    full.train()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert anneal_state(resumed.model)["anneal_step"] == anneal_state(full.model)["anneal_step"] == 4
    expected = full.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=name)


def test_dora_on_a_zero_f_d_is_refused_naming_it_and_on_a_trained_one_works():
    """DoRA divides by the norm of the weight it adapts: on DEX's f_D at its start (zero) the loss was NaN from the
    first forward, with `target_modules="all-linear", use_dora=True` too. A LoRA of f_D, or DoRA on the rest, works."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(3, 90, (2, 12))
    with pytest.raises(ValueError, match=r"DoRA on dex_proj \(f_D\) divides by the norm of its weight, which is zero"):
        get_peft_model(base_model("dex"), LoraConfig(r=4, target_modules="all-linear", use_dora=True))(ids)
    for config in (LoraConfig(r=4, target_modules="all-linear"),
                   LoraConfig(r=4, target_modules="all-linear", use_dora=True, exclude_modules=["dex_proj"]),
                   lora_config(r=4, use_dora=True)):
        assert torch.isfinite(get_peft_model(base_model("dex"), config)(ids, labels=ids).loss)
    trained = base_model("dex")
    with torch.no_grad():
        for layer in trained.model.layers:
            layer.self_attn.dex_proj.weight.normal_(0, 0.1)  # f_D after training: DoRA's norm is defined
    dora = get_peft_model(trained, LoraConfig(r=4, target_modules=["dex_proj"], use_dora=True))
    assert torch.isfinite(dora(ids, labels=ids).loss)


def test_plain_peft_modules_to_save_trains_lambda_through_its_kernel_as_through_the_reference(batches, monkeypatch):
    """V1's lambda kernel (a GPU path; here under the interpreter) behind PEFT's own `modules_to_save` wrapper:
    the trained copy's four vectors get the reference's gradients, and the frozen originals none."""
    from peft import LoraConfig, get_peft_model

    from modeling_diff.kernels import combine

    def lambda_grads(kernel: bool):
        if kernel:
            monkeypatch.setattr(combine, "_lambda_kernel_applies", lambda vectors: True)
        model = get_peft_model(base_model("v1"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            modules_to_save=["diff_lambda"]))
        wrapper = model.get_base_model().model.layers[0].self_attn.diff_lambda
        copy = wrapper.modules_to_save["default"]
        assert (type(copy().grad_fn) is combine._DifferentialLambda._backward_cls) == kernel
        model(batches[0], labels=batches[0]).loss.backward()
        assert all(v.grad is None for v in wrapper.original_module.vectors())
        monkeypatch.undo()
        return [v.grad for v in copy.vectors()]

    for got, want in zip(lambda_grads(kernel=True), lambda_grads(kernel=False)):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_readme_peft_snippet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(readme_snippet("peft"), scope)
    assert (tmp_path / "diffllama-lora" / "adapter_model.safetensors").exists()
    assert isinstance(scope["merged"], DiffLlamaForCausalLM)
    assert scope["recommended"].to_dict() == lora_config().to_dict()


def test_peft_configs_without_target_modules_adapt_a_diffllama_as_a_llama():
    """PEFT's default target modules are per model type: "diff_llama" had none ("Please specify `target_modules`")."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    for make in (lambda: LoraConfig(task_type="CAUSAL_LM"), lambda: IA3Config(task_type="CAUSAL_LM")):
        expected = get_peft_model(LlamaForCausalLM(llama), make()).peft_config["default"].target_modules
        assert expected  # (a set of module names, as PEFT resolves them)
        for mode in ("v1", "v2", "dex"):
            model = get_peft_model(DiffLlamaForCausalLM(tiny_config(mode)), make())
            assert model.peft_config["default"].target_modules == expected
            ids = torch.randint(3, 90, (2, 6))
            model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_prefix_tuning_trains_and_generates_where_the_cache_layout_allows(mode):
    """PEFT's prefix tuning sizes its prefix keys by config.head_dim: V2 and DEX cache such keys and train; V1 caches
    K1|K2 (2 x head_dim): a ValueError saying so, where it was a size mismatch inside torch.cat."""
    from peft import PrefixTuningConfig, get_peft_model

    model = get_peft_model(DiffLlamaForCausalLM(tiny_config(mode)),
                           PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5))
    ids = torch.randint(3, 90, (2, 6))
    if mode == "v1":
        with pytest.raises(ValueError, match=r"V1 caches keys and values 2 x head_dim = \d+ wide .* prefix tuning"):
            model(input_ids=ids, labels=ids)
        return
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == (2, 9)


@pytest.mark.parametrize("mode", ["v2", "dex"])
@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_prompt_and_prefix_tuning_advance_the_annealing_step(mode, method, tmp_path):
    """PEFT's prompt and prefix tuning train an encoder outside the model and freeze the model: the model's t
    stayed 0 under their optimizer, so a converted model's differential term never turned on. Through plain
    get_peft_model and Trainer, t now follows the optimizer steps in every layer."""
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    make = {"prompt": PromptTuningConfig, "prefix": PrefixTuningConfig}[method]
    model = get_peft_model(DiffLlamaForCausalLM(tiny_config(mode, anneal_steps=10)),
                           make(task_type="CAUSAL_LM", num_virtual_tokens=3))
    rows = torch.randint(3, 90, (8, 12))
    args = TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no")
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows]).train()
    layers = model.get_base_model().model.layers
    assert [layer.self_attn.anneal_step.item() for layer in layers] == [3] * len(layers)
