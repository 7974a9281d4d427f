"""LoRA (PEFT) for DiffLlama: adapters on the Llama projections, the differential parameters trained in full.

The differential parameters are few (per layer: V1 4d + 2d, V2 hidden * h, DEX d * d + 1) and carry what
differential attention adds, so they are trained alongside the adapter rather than adapted:
- whole modules -- V1 `subln`, V2 `lambda_proj`, DEX `dex_proj` (f_D) -- go through PEFT's own
  `modules_to_save`, which trains a copy and saves it with the adapter;
- bare parameters of the attention modules -- V1 `lambda_q1, lambda_k1, lambda_q2, lambda_k2`, DEX
  `lambda_learn` -- are beyond `modules_to_save` (it takes modules only): `get_lora_model` unfreezes them and
  `save_lora` writes them into the adapter file, from which `PeftModel.from_pretrained` loads them (PEFT loads
  every key of the adapter file that the model has).
"""

import os
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

from .atomic import atomic_directory

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DIFFERENTIAL_MODULES = ("subln", "lambda_proj", "dex_proj")
DIFFERENTIAL_PARAMETERS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "lambda_learn")
ADAPTER_FILE = "adapter_model.safetensors"


def lora_config(r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05, **kwargs) -> LoraConfig:
    """The recommended `LoraConfig`: LoRA on attention and MLP projections, differential modules trained in full.
    Keyword arguments override or extend it (any `LoraConfig` field)."""
    fields = dict(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, task_type="CAUSAL_LM",
                  target_modules=list(LORA_TARGET_MODULES), modules_to_save=list(DIFFERENTIAL_MODULES))
    return LoraConfig(**{**fields, **kwargs})


def differential_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The bare differential parameters of `model` (a DiffLlama or a PeftModel around one), by full name."""
    return {name: p for name, p in model.named_parameters() if name.rpartition(".")[2] in DIFFERENTIAL_PARAMETERS}


def get_lora_model(model: nn.Module, config: LoraConfig | None = None, train_differential: bool = True) -> PeftModel:
    """`peft.get_peft_model(model, config or lora_config())`, with the bare differential parameters trainable
    when `train_differential` (list `DIFFERENTIAL_MODULES` in `modules_to_save` to train the modules too)."""
    peft_model = get_peft_model(model, config if config is not None else lora_config())
    for parameter in differential_parameters(peft_model).values():
        parameter.requires_grad_(train_differential)
    return peft_model


def save_lora(peft_model: PeftModel, save_directory: str | os.PathLike, overwrite: bool = False, **kwargs) -> Path:
    """`peft_model.save_pretrained(save_directory, **kwargs)` plus the trained bare differential parameters in the
    adapter file; load with `PeftModel.from_pretrained(base_model, save_directory)`. Never half-written; an
    existing non-empty folder is replaced only with `overwrite=True`."""
    trained = {name: p.detach().cpu().contiguous() for name, p in differential_parameters(peft_model).items()
               if p.requires_grad}
    with atomic_directory(save_directory, overwrite, name="save_directory") as staging:
        peft_model.save_pretrained(staging, **kwargs)
        adapter_files = sorted(staging.rglob(ADAPTER_FILE))  # one per saved adapter (sub-folders for non-default)
        if trained and not adapter_files:
            raise ValueError(f"save_lora needs safetensors adapter files ({ADAPTER_FILE}); got none in {kwargs}")
        for path in adapter_files:
            tensors = load_file(path)
            save_file({**tensors, **trained}, path, metadata={"format": "pt"})
    return Path(save_directory).resolve()


__all__ = [
    "DIFFERENTIAL_MODULES",
    "DIFFERENTIAL_PARAMETERS",
    "LORA_TARGET_MODULES",
    "differential_parameters",
    "get_lora_model",
    "lora_config",
    "save_lora",
]
