"""Annealing of a converted model: the DEX lambda schedule, the Trainer callback, exact resumption."""

import pytest
import torch
from safetensors import safe_open
from test_conversion import tiny_llama, token_ids
from transformers import Trainer, TrainerCallback, TrainingArguments

from modeling_diff import set_anneal_step
from modeling_diff.annealing import AnnealingCallback, anneal_state
from modeling_diff.conversion import convert_model

HEADS = [[0, 2], [1], [3]]


def dex_model(anneal_steps=4, lambda_learn=0.5, seed=3):
    """A converted tiny Llama with f_D = M (random, per layer) and lambda_learn != lambda_init."""
    model = convert_model(tiny_llama(), heads=HEADS, anneal_steps=anneal_steps, progress=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.dex_proj.weight.copy_(torch.randn(16, 16, generator=generator) * 0.3)
            layer.self_attn.dex_lambda.lambda_learn.fill_(lambda_learn)
    return model


def expected_lambda(t, T, lambda_init, lambda_learn):
    """DEX (arXiv 2505.16333): lambda(t) = (1 - a) (t/T) lambda_init + a lambda_learn, a = min(1, t/T)."""
    a = min(1.0, t / T)
    return (1 - a) * (t / T) * lambda_init + a * lambda_learn


@pytest.mark.parametrize("step", [0, 1, 2, 4, 7])
def test_dex_lambda_schedule_shows_in_the_logits(step):
    """Reference: the source Llama whose o_proj columns of a selected head i become W_o_i (I - lambda M)."""
    model, ids = dex_model(anneal_steps=4), token_ids()
    set_anneal_step(model, step)
    reference = tiny_llama()
    with torch.no_grad():
        for layer_idx, (layer, dex_layer) in enumerate(zip(reference.model.layers, model.model.layers)):
            attention = dex_layer.self_attn
            lam = expected_lambda(step, 4, attention.lambda_init, 0.5)
            operator = torch.eye(16) - lam * attention.dex_proj.weight
            for head in HEADS[layer_idx]:
                block = layer.self_attn.o_proj.weight[:, head * 16:(head + 1) * 16]
                block.copy_(block @ operator)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_anneal_state_reports_the_schedule():
    model = dex_model(anneal_steps=4)
    set_anneal_step(model, 3)
    lambdas = [expected_lambda(3, 4, layer.self_attn.lambda_init, 0.5) for layer in model.model.layers]
    state = anneal_state(model)
    assert state["anneal_step"] == 3 and state["anneal_fraction"] == 0.75
    assert state["dex_lambda"] == pytest.approx(sum(lambdas) / len(lambdas))
    v2 = convert_model(tiny_llama(), method="v2", anneal_steps=4, progress=False)
    set_anneal_step(v2, 9)
    assert anneal_state(v2) == {"anneal_step": 9.0, "anneal_fraction": 1.0}
    assert anneal_state(tiny_llama()) == {}


class Blocks(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = token_ids(batch=16, length=16, seed=5)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepProbe(TrainerCallback):
    """Records the anneal step each optimizer step trains with."""

    def __init__(self):
        self.steps = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.steps.append(model.model.layers[0].self_attn.anneal_step.item())


def train(model, output_dir, resume=None, callbacks=(AnnealingCallback(),), gradient_accumulation_steps=1):
    args = TrainingArguments(output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                             save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, dataloader_num_workers=0,
                             gradient_accumulation_steps=gradient_accumulation_steps)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_trainer_callback_anneals_and_resumes_exactly(tmp_path):
    probe = StepProbe()
    uninterrupted = dex_model(anneal_steps=3)
    trainer = train(uninterrupted, tmp_path / "run", callbacks=[AnnealingCallback(), probe])
    assert probe.steps == [0, 1, 2, 3]
    assert anneal_state(uninterrupted)["anneal_step"] == 4
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["anneal_step"] for entry in logged] == [1, 2, 3, 4]
    assert logged[0]["dex_lambda"] != pytest.approx(logged[-1]["dex_lambda"])
    assert [entry["anneal_fraction"] for entry in logged] == pytest.approx([1 / 3, 2 / 3, 1, 1])

    checkpoint = tmp_path / "run" / "checkpoint-2"
    with safe_open(checkpoint / "model.safetensors", framework="pt") as saved:
        assert saved.get_tensor("model.layers.1.self_attn.annealing.step").item() == 2

    resumed = dex_model(anneal_steps=3)
    resumed_probe = StepProbe()
    train(resumed, tmp_path / "resumed", resume=str(checkpoint), callbacks=[AnnealingCallback(), resumed_probe])
    assert resumed_probe.steps == [2, 3]
    expected = uninterrupted.state_dict()
    for name, tensor in resumed.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=name)


class RecordingIntegration(TrainerCallback):
    """In TensorBoard's place among `report_to`'s integrations (tensorboard is not installed): what
    TensorBoardCallback's on_log does, write `logs` out."""

    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append(dict(logs))


def test_add_annealing_callback_puts_the_schedule_in_what_report_to_integrations_log(tmp_path, monkeypatch):
    """Trainer calls the integrations of `report_to` (TensorBoard, W&B, ...) before the callbacks it is given, and
    they write each log entry out before `callbacks=[AnnealingCallback()]` adds the schedule to it: they never logged
    it. `add_annealing_callback(trainer)` puts the callback ahead of them (here a recording integration in
    TensorBoard's place: tensorboard is not installed), and moves the one the trainer holds."""
    import transformers.integrations.integration_utils as integrations

    from modeling_diff.annealing import add_annealing_callback

    monkeypatch.setitem(integrations.INTEGRATION_TO_CALLBACK, "tensorboard", RecordingIntegration)
    for given in ([], [AnnealingCallback()]):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True,
                                 save_strategy="no", logging_steps=1, report_to=["tensorboard"], disable_tqdm=True)
        trainer = Trainer(model=dex_model(anneal_steps=8), args=args, train_dataset=Blocks(), callbacks=given)
        callback = add_annealing_callback(trainer)
        assert given == [] or callback is given[0]
        names = [type(other).__name__ for other in trainer.callback_handler.callbacks]
        assert names[:3] == ["DefaultFlowCallback", "AnnealingCallback", "RecordingIntegration"], names
        assert names.count("AnnealingCallback") == 1
        trainer.train()
        integration = trainer.callback_handler.callbacks[2]
        logged = [entry for entry in integration.logged if "loss" in entry]
        assert [entry["anneal_step"] for entry in logged] == [1, 2, 3]
        assert [entry["anneal_fraction"] for entry in logged] == pytest.approx([1 / 8, 2 / 8, 3 / 8])


def test_a_resume_that_restores_callback_states_keeps_the_schedule_in_what_integrations_log(tmp_path, monkeypatch):
    """`restore_callback_states_from_checkpoint=True`: on resume Trainer replaces each stateful callback by a new one
    built from the checkpoint and appends it behind every other, the integrations of `report_to` among them, which
    then wrote each entry out before the schedule was added. A trainer given `add_annealing_callback` keeps the
    restored callback right after DefaultFlowCallback: the resumed run's integration logs t of each step, and t
    continues from the checkpoint's."""
    import transformers.integrations.integration_utils as integrations

    from modeling_diff.annealing import add_annealing_callback

    monkeypatch.setitem(integrations.INTEGRATION_TO_CALLBACK, "tensorboard", RecordingIntegration)

    def run(resume=None):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, use_cpu=True,
                                 save_strategy="steps", save_steps=2, logging_steps=1, report_to=["tensorboard"],
                                 disable_tqdm=True, restore_callback_states_from_checkpoint=True)
        trainer = Trainer(model=dex_model(anneal_steps=8), args=args, train_dataset=Blocks())
        add_annealing_callback(trainer)
        trainer.train(resume_from_checkpoint=resume)
        names = [type(other).__name__ for other in trainer.callback_handler.callbacks]
        assert names[:3] == ["DefaultFlowCallback", "AnnealingCallback", "RecordingIntegration"], names
        assert names.count("AnnealingCallback") == 1
        integration = trainer.callback_handler.callbacks[2]
        return [entry["anneal_step"] for entry in integration.logged if "loss" in entry]

    assert run() == [1, 2, 3, 4]
    assert run(resume=str(tmp_path / "checkpoint-2")) == [3, 4]


def test_custom_loop_advances_t_with_each_optimizer_step():
    model, ids = dex_model(anneal_steps=2, lambda_learn=0.3), token_ids()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        optimizer.step()  # t = optimizer steps taken, with nothing to call
        optimizer.zero_grad()
    assert anneal_state(model)["anneal_step"] == 3 and anneal_state(model)["anneal_fraction"] == 1.0
    attention = model.model.layers[0].self_attn
    assert attention.current_lambda().item() == pytest.approx(attention.dex_lambda.lambda_learn.item())
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1).step()  # an optimizer of something else
    assert anneal_state(model)["anneal_step"] == 3


def layer_steps(model) -> list[int]:
    return [layer.self_attn.anneal_step.item() for layer in model.model.layers]


def train_steps(model, optimizer, steps=2, scaler=None):
    ids = token_ids()
    for _ in range(steps):
        loss = model.train()(ids, labels=ids).loss
        (scaler.scale(loss) if scaler else loss).backward()
        scaler.step(optimizer) if scaler else optimizer.step()
        if scaler:
            scaler.update()
        optimizer.zero_grad()


@pytest.mark.parametrize("trained", ["embeddings", "mlps", "last layer", "first attention"])
def test_an_optimizer_over_part_of_the_model_advances_every_layer_s_t(trained):
    """t counts the model's optimizer steps, whichever of its parameters the optimizer holds: it advanced only the
    attentions whose own parameters were held, so an optimizer of the embeddings moved no layer and one of the last
    layer moved it alone, and the layers computed different points of the schedule."""
    model = dex_model(anneal_steps=10)
    layers = model.model.layers
    parameters = {
        "embeddings": model.model.embed_tokens.parameters(),
        "mlps": [p for layer in layers for p in layer.mlp.parameters()],
        "last layer": layers[-1].parameters(),
        "first attention": layers[0].self_attn.parameters(),
    }[trained]
    train_steps(model, torch.optim.SGD(parameters, lr=1e-3), steps=2)
    assert layer_steps(model) == [2] * len(layers)


@pytest.mark.parametrize("method", ["dex", "v2"])
@pytest.mark.parametrize("copy_by", ["deepcopy", "torch.save and torch.load"])
def test_a_copy_of_a_model_advances_its_own_t(method, copy_by):
    """A copy runs neither __init__ nor post_init, where a model and its attentions are registered: a deepcopied or
    unpickled converted model kept t = 0 however long it trained, and the differential term never turned on."""
    import copy
    import io

    model = dex_model(anneal_steps=10) if method == "dex" else convert_model(tiny_llama(), method="v2",
                                                                             anneal_steps=10, progress=False)
    if copy_by == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copied = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    train_steps(copied, torch.optim.SGD(copied.parameters(), lr=1e-3), steps=3)
    assert layer_steps(copied) == [3] * len(copied.model.layers)
    assert layer_steps(model) == [0] * len(model.model.layers)  # the original is not the copy's model
    train_steps(model, torch.optim.SGD(model.parameters(), lr=1e-3), steps=1)
    assert layer_steps(model) == [1] * len(model.model.layers) and layer_steps(copied) == [3] * len(model.model.layers)


def split_optimizers(model, kind: str) -> list[torch.optim.Optimizer]:
    """Optimizers that share the model's parameters between them, as users combine them: torch's Muon for the
    layers' matrices beside AdamW for the rest (Muon takes 2-D parameters only), the attentions' parameters beside
    the rest, or one optimizer a parameter (transformers' layerwise optimizers)."""
    if kind == "muon and adamw":
        matrices = [p for layer in model.model.layers for p in layer.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
        return [torch.optim.Muon(matrices, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]
    if kind == "attentions and the rest":
        attention = [p for layer in model.model.layers for p in layer.self_attn.parameters()]
        return [torch.optim.SGD(attention, lr=1e-3),
                torch.optim.SGD([p for p in model.parameters() if all(p is not q for q in attention)], lr=1e-3)]
    return [torch.optim.SGD([p], lr=1e-3) for p in model.parameters()]


@pytest.mark.parametrize("kind", ["muon and adamw", "attentions and the rest"])
def test_optimizers_stepped_one_after_another_in_a_training_step_are_one_step(kind):
    """README: t counts training steps. Two optimizers over parts of the model, each stepped once a training step,
    advanced t twice a step, so the schedule ended at half its T, and so did a model trained with Muon beside AdamW."""
    model = dex_model(anneal_steps=10)
    optimizers, ids = split_optimizers(model, kind), token_ids()
    for _ in range(3):
        model.train()(ids, labels=ids).loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert layer_steps(model) == [3, 3, 3]


def test_one_optimizer_a_parameter_stepped_in_the_backward_is_one_step():
    """The optimizer step fused into the backward (PyTorch's tutorial; transformers' layerwise optimizers, GaLore's
    and APOLLO's, do it this way): one optimizer a parameter, stepped by the parameter's post-accumulate-grad hook.
    Each of the model's 36 optimizers advanced t once a step."""
    model = dex_model(anneal_steps=100)
    optimizers = dict(zip(model.parameters(), split_optimizers(model, "one a parameter")))

    def step(parameter):
        optimizers[parameter].step()
        optimizers[parameter].zero_grad()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(step)
    ids = token_ids()
    for _ in range(3):
        model.train()(ids, labels=ids).loss.backward()
    assert len(optimizers) == 36 and layer_steps(model) == [3, 3, 3]


def test_a_step_the_scaler_skips_is_none_and_a_new_optimizer_counts_from_its_second_step():
    """A step that a gradient scaler skips (an inf gradient) calls no step() and does not count. An optimizer that
    takes over from another still referenced joins the other's training step with its first step (it cannot be
    told from a second optimizer of that step), and counts from its second on: README says so."""
    model = dex_model(anneal_steps=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_steps(model, optimizer, steps=1, scaler=scaler)
    assert layer_steps(model) == [1, 1, 1]
    ids = token_ids()
    (model(ids, labels=ids).loss * float("inf")).backward()  # inf gradients: the scaler skips the step
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    assert layer_steps(model) == [1, 1, 1]
    train_steps(model, optimizer, steps=1)
    assert layer_steps(model) == [2, 2, 2]
    train_steps(model, torch.optim.SGD(model.parameters(), lr=1e-3), steps=3)
    assert layer_steps(model) == [4, 4, 4]


def test_a_frozen_model_counts_the_steps_of_what_trains_it_only_in_training_mode():
    """Prompt and prefix tuning train an encoder outside the model and freeze the model: its t follows every
    optimizer step while it is in training mode; a frozen model in eval mode (a reference or teacher model, as
    from_pretrained returns it) keeps its t, as does one whose parameters train under another optimizer."""
    model = dex_model(anneal_steps=10).requires_grad_(False)
    prompt = torch.nn.Parameter(torch.zeros(1, 2, model.config.hidden_size))
    optimizer = torch.optim.SGD([prompt], lr=1e-3)
    ids = token_ids()
    for training in (True, True, False):
        embeds = torch.cat([prompt.expand(ids.shape[0], -1, -1), model.get_input_embeddings()(ids)], dim=1)
        model.train(training)(inputs_embeds=embeds).logits.sum().backward()
        optimizer.step()
    assert layer_steps(model) == [2, 2, 2]
    trained = dex_model(anneal_steps=10).train()
    torch.optim.SGD([prompt], lr=1e-3).step()
    assert layer_steps(trained) == [0, 0, 0]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_without_the_callback_anneals_with_the_optimizer_steps(tmp_path, accumulation):
    """The common path is right by default: without AnnealingCallback t still follows the optimizer steps (not the
    forward passes), so the differential term turns on and f_D learns."""
    probe = StepProbe()
    model = dex_model(anneal_steps=3)
    f_d = model.model.layers[0].self_attn.dex_proj.weight.detach().clone()
    train(model, tmp_path / "run", callbacks=[probe], gradient_accumulation_steps=accumulation)
    assert probe.steps == [0, 1, 2, 3]
    assert not torch.equal(model.model.layers[0].self_attn.dex_proj.weight, f_d)


def test_step_counter_is_exact_under_dtype_casts():
    model = dex_model(anneal_steps=1000).to(torch.bfloat16)
    set_anneal_step(model, 257)  # a bfloat16 257 would be 256
    assert {m.anneal_step.item() for m in model.modules() if hasattr(m, "anneal_step")} == {257}
    assert anneal_state(model.to(torch.float16))["anneal_fraction"] == pytest.approx(0.257)
    with pytest.raises(ValueError, match="step must be a non-negative whole number"):
        set_anneal_step(model, 2.5)


def test_optimizer_state_initialisation_of_a_checkpoint_load_is_not_a_step():
    """torch.distributed.checkpoint initialises an empty optimizer (FSDP2 / accelerate resume) with one step() at
    lr 0 on zero gradients before it loads the saved state: t must not count it."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    model = dex_model(anneal_steps=10)
    set_anneal_step(model, 4)
    _init_optim_state(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert anneal_state(model)["anneal_step"] == 4


class Lookahead(torch.optim.Optimizer):
    """An optimizer that steps another inside its own step, as torch's ZeroRedundancyOptimizer (its rank's shard)
    and Lookahead-style wrappers do."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        super().__init__([p for group in inner.param_groups for p in group["params"]], {})

    def step(self, closure=None):
        return self.inner.step(closure)


def test_an_optimizer_stepped_inside_another_s_step_counts_once():
    """t advanced twice per training step (the inner and the outer optimizer's hooks), and with a sharded inner
    optimizer on some ranks only."""
    model = dex_model(anneal_steps=10)
    set_anneal_step(model, 4)
    optimizer = Lookahead(torch.optim.SGD(model.parameters(), lr=1e-3))
    for _ in range(3):
        model.train()(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
        optimizer.step()
    assert anneal_state(model)["anneal_step"] == 7


def test_a_step_of_another_model_inside_an_optimizer_step_counts_for_that_model():
    """Only an enclosing step over the same parameters counts in place of the inner one: model B's optimizer stepped
    in model A's step post-hook, or three times in A's closure, advances B's t each time."""
    a, b = dex_model(anneal_steps=10), dex_model(anneal_steps=10)
    step_a, step_b = torch.optim.SGD(a.parameters(), lr=1e-3), torch.optim.SGD(b.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3]])

    def closure():
        for _ in range(3):
            b.train()(input_ids=ids, labels=ids).loss.backward()
            step_b.step()
        return a.train()(input_ids=ids, labels=ids).loss

    step_a.step(closure)
    step_a.register_step_post_hook(lambda *_: step_b.step())
    step_a.step(closure)
    assert (anneal_state(a)["anneal_step"], anneal_state(b)["anneal_step"]) == (2, 7)


def test_the_callback_continues_from_the_model_s_t_in_a_new_run(tmp_path):
    """A new run (a second train(), a new Trainer, an adapted model saved and trained on) starts at global step 0:
    the callback set t back to 0 there, and the differential term annealed in again from nothing."""
    model = dex_model(anneal_steps=3)
    set_anneal_step(model, 4)  # adapted: past T
    probe = StepProbe()
    train(model, tmp_path / "again", callbacks=[AnnealingCallback(), probe])
    assert probe.steps == [4, 5, 6, 7]  # t at each step's forward
    assert anneal_state(model)["anneal_step"] == 8
