"""Annealing the differential term in during adaptation (DEX lambda schedule, V2 noise factor).

The step t lives in every V2/DEX attention's `annealing` module (an integer buffer, `anneal_step` of the attention),
so a checkpoint saved mid-adaptation resumes exactly, and a PEFT adapter whose modules_to_save hold `annealing`
(`lora_config()`'s) has its own t, saved with it; T is `config.anneal_steps`. t is the number of training steps
taken, and it keeps itself so: after the optimizer steps that update the model, t grows by one a training step
however many optimizers share it (an optimizer step hook, `diff_attention.py`), whatever runs the loop -- Trainer,
TRL, accelerate or a custom loop. Nothing to add:

- with `Trainer`, `add_annealing_callback(trainer)` (or `callbacks=[AnnealingCallback()]`) also pins t to the
  model's t when training began plus `state.global_step` (after a resume too) and logs the schedule, to the
  reporting integrations too where added by `add_annealing_callback`;
- `set_anneal_step(model, step)` sets t by hand (e.g. to evaluate the schedule at a given step).

`anneal_state(model)` reads the schedule back (for logging).
"""

import torch
from torch import nn
from transformers import DefaultFlowCallback, TrainerCallback
from transformers.trainer_callback import ExportableState

from .diff_attention import DexAttention, DiffAttentionV2, anneal_fraction
from .modeling_diff_llama import set_anneal_step


@torch.no_grad()
def anneal_state(model: nn.Module) -> dict[str, float]:
    """`anneal_step` (t), `anneal_fraction` (min(1, t/T)) and, for DEX, the mean over layers of lambda(t)."""
    dex = [m for m in model.modules() if isinstance(m, DexAttention)]
    annealed = dex or [m for m in model.modules() if isinstance(m, DiffAttentionV2)]
    if not annealed:
        return {}
    first = annealed[0]
    fraction = anneal_fraction(first.anneal_step, first.config.anneal_steps)  # None: annealing off
    state = {
        "anneal_step": first.anneal_step.item(),
        "anneal_fraction": 1.0 if fraction is None else fraction.clamp(max=1.0).item(),
    }
    if dex:
        state["dex_lambda"] = torch.cat([m.current_lambda() for m in dex]).mean().item()
    return state


class AnnealingCallback(TrainerCallback, ExportableState):
    """Keeps every attention's `anneal_step` equal to the model's t when the run began plus the run's optimizer steps
    (`state.global_step`), and logs the schedule.

    The start is read at the beginning of training: a new run on an adapted model (a second `train()`, a new
    Trainer, a saved model trained on) takes the model's t and step 0 -- pinning t to the global step alone set it
    back to 0 there, and annealed the differential term in again from nothing. A resumed run takes the start its
    checkpoint's trainer_state.json recorded (this callback's `state()`), or, from a checkpoint without it, its
    model's t less its global step. A PEFT adapter whose modules_to_save leave out `annealing` holds no t (the
    attentions' buffers are then the base model's, which PEFT does not save): a resumed adapter's model has its base's
    t, and without this callback keeps counting from it. t is set at the beginning and after each optimizer step
    (before the Trainer saves a checkpoint, so a checkpoint holds the step it was saved at).
    """

    def __init__(self):
        self.start = 0

    def state(self) -> dict:
        return {"args": {}, "attributes": {"start": self.start}}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) else saved
        if state.global_step > 0 and isinstance(saved, dict) and "start" in saved.get("attributes", {}):
            self.start = int(saved["attributes"]["start"])
        else:
            self.start = max(0, int(anneal_state(model).get("anneal_step", 0)) - state.global_step)
        set_anneal_step(model, self.start + state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        set_anneal_step(model, self.start + state.global_step)

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        # Trainer appends a copy of `logs` to the history before callbacks run: extend both.
        schedule = anneal_state(model)
        if logs is not None:
            logs.update(schedule)
        if state.log_history:
            state.log_history[-1].update(schedule)


def add_annealing_callback(trainer) -> AnnealingCallback:
    """Give `trainer` an `AnnealingCallback` (the one it holds, where it holds one) placed right after Trainer's
    DefaultFlowCallback, ahead of the reporting integrations of `report_to` (TensorBoard, W&B, MLflow, ...). Trainer
    puts those ahead of the callbacks it is given (`callbacks=[...]`, `add_callback`), and they log each entry before
    a callback behind them has added the schedule: then only `trainer.state.log_history` and the console get it.
    The place holds for an `AnnealingCallback` the trainer is given later through its handler's `add_callback`, and
    so for the new one a resume with `restore_callback_states_from_checkpoint=True` puts in the returned one's place
    (Trainer removes each stateful callback and appends the one rebuilt from the checkpoint). Returns the callback."""
    handler = trainer.callback_handler
    held = [callback for callback in handler.callbacks if isinstance(callback, AnnealingCallback)]
    callback = held[0] if held else AnnealingCallback()
    _place_after_flow(handler.callbacks, callback)
    if not getattr(handler.add_callback, "places_annealing", False):
        add_callback = handler.add_callback

        def add_callback_in_place(added):
            add_callback(added)
            if isinstance(handler.callbacks[-1], AnnealingCallback):  # what was just added
                _place_after_flow(handler.callbacks, handler.callbacks[-1])

        add_callback_in_place.places_annealing = True
        handler.add_callback = add_callback_in_place
    return callback


def _place_after_flow(callbacks: list, callback: AnnealingCallback) -> None:
    """Put `callback` right after DefaultFlowCallback in `callbacks` (at the front without one), in place of every
    AnnealingCallback there (one t, one log)."""
    callbacks[:] = [other for other in callbacks if not isinstance(other, AnnealingCallback)]
    flow = [i for i, other in enumerate(callbacks) if isinstance(other, DefaultFlowCallback)]
    callbacks.insert(flow[0] + 1 if flow else 0, callback)


__all__ = ["AnnealingCallback", "add_annealing_callback", "anneal_state", "set_anneal_step"]
