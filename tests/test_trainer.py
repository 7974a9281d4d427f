"""transformers.Trainer fine-tunes every diff_mode on real text, and gradient accumulation is exact."""

import copy

import pytest
import torch
import torch.nn.functional as F
from ecosystem_helpers import byte_tokenizer, readme_snippet, tiny_config
from transformers import Trainer, TrainingArguments

from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.data import shakespeare, text_blocks

MODES = ("v1", "v2", "dex")


def arguments(tmp_path, **overrides) -> TrainingArguments:
    fields = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no",
                  disable_tqdm=True, logging_strategy="no", seed=0, dataloader_num_workers=0)
    return TrainingArguments(**{**fields, **overrides})


def as_dataset(blocks: torch.Tensor, labels: torch.Tensor | None = None) -> list[dict]:
    labels = blocks if labels is None else labels
    return [{"input_ids": x, "labels": y} for x, y in zip(blocks, labels)]


@pytest.mark.parametrize("mode", MODES)
def test_trainer_lowers_heldout_loss_on_shakespeare(mode, tmp_path):
    tokenizer, text = byte_tokenizer(), shakespeare("hamlet")
    train = as_dataset(text_blocks(tokenizer, text, length=64, count=96))
    held_out = as_dataset(text_blocks(tokenizer, text, length=64, count=16, offset=1000))  # a later scene
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config(mode))
    args = arguments(tmp_path, max_steps=40, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                     learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert before > 5.0  # ~ln(257): an untrained model knows nothing of the bytes
    assert after < before - 1.5, (before, after)


def masked_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4 sequences whose numbers of supervised tokens differ widely (31, 3, 16, 8), so that averaging per
    micro-batch would weight tokens unequally."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size - 1, (4, 32), generator=generator)
    labels = input_ids.clone()
    for row, keep in enumerate((32, 4, 17, 9)):
        labels[row, keep:] = -100
    return input_ids, labels


def reference_loss(model, input_ids, labels) -> torch.Tensor:
    """Causal-LM loss written out: mean cross-entropy over every supervised next token of the whole batch."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum") / (targets != -100).sum()


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode", MODES)
def test_num_items_in_batch_makes_accumulated_gradients_exact(mode):
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config(mode))
    input_ids, labels = masked_batch(model.config.vocab_size)

    reference_loss(model, input_ids, labels).backward()
    full = gradients(model)
    model.zero_grad()

    num_items = (labels[:, 1:] != -100).sum()
    for part in (slice(0, 2), slice(2, 4)):
        model(input_ids=input_ids[part], labels=labels[part], num_items_in_batch=num_items).loss.backward()
    torch.testing.assert_close(gradients(model), full, rtol=1e-4, atol=1e-7)
    model.zero_grad()

    # The check is sensitive: averaging each micro-batch on its own gives other gradients.
    for part in (slice(0, 2), slice(2, 4)):
        (model(input_ids=input_ids[part], labels=labels[part]).loss / 2).backward()
    assert not torch.allclose(gradients(model), full, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_trainer_step_with_accumulation_equals_one_full_batch_step(mode, tmp_path):
    """One optimizer step over a batch of 4 equals one over 2 accumulated micro-batches of 2 (plain SGD: equal
    weights afterwards mean equal gradients); the reported loss is the full batch's."""
    torch.manual_seed(0)
    initial = DiffLlamaForCausalLM(tiny_config(mode))
    input_ids, labels = masked_batch(initial.config.vocab_size)
    expected_loss = reference_loss(initial, input_ids, labels).item()

    results = []
    for batch_size, accumulation in ((4, 1), (2, 2), (1, 4)):
        model = copy.deepcopy(initial)
        args = arguments(tmp_path, max_steps=1, per_device_train_batch_size=batch_size,
                         gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5,
                         lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0)
        output = Trainer(model=model, args=args, train_dataset=as_dataset(input_ids, labels)).train()
        results.append((output.training_loss, torch.cat([p.detach().flatten() for p in model.parameters()])))

    start = torch.cat([p.detach().flatten() for p in initial.parameters()])
    (loss_full, weights_full), *accumulated = results
    assert not torch.allclose(weights_full, start)
    assert loss_full == pytest.approx(expected_loss, rel=1e-5)
    for loss, weights in accumulated:
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        torch.testing.assert_close(weights - start, weights_full - start, rtol=1e-4, atol=1e-7)


def test_readme_trainer_snippet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(readme_snippet("trainer"), scope)
    assert scope["trainer"].state.global_step == 20
    assert (tmp_path / "diffllama-shakespeare" / "model.safetensors").exists()
