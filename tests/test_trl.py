"""TRL through its own paths: `SFTTrainer(model=<path>)` resolves our model (never transformers' built-in DiffLlama,
whose class has the same name), trains it with the package's recommended LoRA config and on packed padding-free
batches (each sequence attending to itself), and annealing advances with no callback; `DPOTrainer` with the
recommended LoRA config keeps the base model as its reference while the adapter's annealing step advances."""

import pytest
import torch
from datasets import Dataset
from ecosystem_helpers import byte_tokenizer, tiny_config
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.data import shakespeare
from modeling_diff.lora import lora_config


def saved_model(tmp_path, mode: str, **overrides):
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config(mode, **overrides))
    if mode == "dex":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.dex_proj.weight.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


def sft_trainer(path, tmp_path, packing: bool = False, **kwargs) -> SFTTrainer:
    lines = [line for line in shakespeare("hamlet").splitlines() if len(line) > 20][:64]
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=3, per_device_train_batch_size=4, max_length=48,
                     learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0, packing=packing, packing_strategy="bfd")
    return SFTTrainer(model=str(path), args=args, train_dataset=Dataset.from_dict({"text": lines}), **kwargs)


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_sft_trainer_by_path_builds_our_model_with_the_saved_weights(mode, tmp_path):
    model, path = saved_model(tmp_path, mode)
    trainer = sft_trainer(path, tmp_path)
    assert type(trainer.model) is DiffLlamaForCausalLM
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(ids).logits, model.eval()(ids).logits)


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_sft_trainer_packed_batches_keep_each_sequence_to_itself(mode, tmp_path):
    """`SFTConfig(packing=True, packing_strategy="bfd")`, padding-free: TRL packs several lines into one row and its
    collator passes their positions (restarting at 0), with no attention mask; each sequence's logits in the row are
    its own alone, and the trainer trains on such batches."""
    _, path = saved_model(tmp_path, mode)
    trainer = sft_trainer(path, tmp_path, packing=True)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert "attention_mask" not in batch
    positions = batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    assert len(starts) > 2  # more than one sequence in the row
    model = trainer.model.eval()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for start, end in zip(starts, starts[1:]):
            alone = model(batch["input_ids"][:, start:end]).logits
            torch.testing.assert_close(packed[:, start:end], alone)
    trainer.train()
    assert trainer.state.global_step == 3


def test_sft_trainer_with_the_recommended_lora_config_trains_every_differential_module(tmp_path):
    _, path = saved_model(tmp_path, "dex", anneal_steps=10)
    trainer = sft_trainer(path, tmp_path, peft_config=lora_config(r=4, lora_alpha=8, lora_dropout=0.0))
    attention = trainer.model.get_base_model().model.layers[0].self_attn
    before = {name: getattr(attention, name).modules_to_save["default"].state_dict()
              for name in ("dex_proj", "dex_lambda")}
    before = {name: {k: v.clone() for k, v in state.items()} for name, state in before.items()}
    trainer.train()
    for name, state in before.items():
        trained = getattr(attention, name).modules_to_save["default"].state_dict()
        assert any(not torch.equal(trained[k], v) for k, v in state.items()), f"{name} was not trained"
    assert attention.anneal_step.item() == 3  # t advanced with the optimizer steps, no callback given


def test_dpo_trainer_with_the_recommended_lora_config_keeps_the_base_model_as_its_reference(tmp_path):
    """Given `peft_config` and no reference model, DPOTrainer scores the reference with the adapter disabled. t was a
    buffer of the base model that training advanced, so the reference moved with it (DEX's lambda(t) f_D turned on in
    the reference too). The adapter counts its own t now: after three steps (t = 3) the trained trainer's reference
    log-probabilities are an untrained one's."""
    _, path = saved_model(tmp_path, "dex", anneal_steps=10)
    lines = [line for line in shakespeare("hamlet").splitlines() if len(line) > 50][:24]
    data = Dataset.from_dict({"prompt": [line[:10] for line in lines], "chosen": [line[10:30] for line in lines],
                              "rejected": [line[30:50] for line in lines]})
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_steps=3, per_device_train_batch_size=4, max_length=48,
                     learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0)

    def trainer():
        return DPOTrainer(model=str(path), args=args, train_dataset=data, processing_class=byte_tokenizer(),
                          peft_config=lora_config(r=4, lora_alpha=8, lora_dropout=0.0))

    trained, untrained = trainer(), trainer()
    trained.train()
    assert trained.model.get_base_model().model.layers[0].self_attn.anneal_step.item() == 3
    batch = next(iter(trained.get_train_dataloader()))
    for reference, expected in zip(trained.compute_ref_log_probs(trained.model, batch),
                                   untrained.compute_ref_log_probs(untrained.model, batch)):
        torch.testing.assert_close(reference, expected)
