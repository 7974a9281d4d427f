"""LoRA (PEFT) for DiffLlama: adapters on the Llama projections, the differential parameters trained in full.

The differential parameters are few (per layer: V1 4d + 2d, V2 hidden * h, DEX d * d + 1) and carry what
differential attention adds, so they are trained alongside the adapter rather than adapted. Each lives in a
module of its own -- V1 `diff_lambda` (lambda_q1 .. lambda_k2) and `subln`, V2 `lambda_proj`, DEX `dex_proj`
(f_D) and `dex_lambda` (lambda_learn) -- so PEFT's own `modules_to_save` trains a copy of each and saves it with
the adapter. So does the annealing step t of V2 and DEX (`annealing`, no parameters): each adapter counts its own t,
saved with it, and the base model keeps its own. `lora_config()` is therefore all a user needs, through any tool:
`peft.get_peft_model(model, lora_config())`, TRL's `SFTTrainer(peft_config=lora_config())`, Trainer checkpoints and
`resume_from_checkpoint`, `PeftModel.from_pretrained(base, folder)`.
"""

import os
from pathlib import Path

from torch import nn

from .atomic import atomic_directory, writes_on_this_rank
from .extras import require
from .peft_targets import register_peft_default_targets

peft = require("peft", "modeling_diff.lora (LoRA adapters)")
LoraConfig, PeftModel, get_peft_model = peft.LoraConfig, peft.PeftModel, peft.get_peft_model

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DIFFERENTIAL_MODULES = ("diff_lambda", "subln", "lambda_proj", "dex_proj", "dex_lambda")
ANNEALING_MODULES = ("annealing",)  # saved with the adapter, nothing to train: t of V2 / DEX (`AnnealingStep`)


def lora_config(r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05, **kwargs) -> LoraConfig:
    """The recommended `LoraConfig`: LoRA on attention and MLP projections, differential modules trained in full, the
    annealing step saved with the adapter.
    Keyword arguments override or extend it (any `LoraConfig` field)."""
    fields = dict(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, task_type="CAUSAL_LM",
                  target_modules=list(LORA_TARGET_MODULES), modules_to_save=[*DIFFERENTIAL_MODULES, *ANNEALING_MODULES])
    return LoraConfig(**{**fields, **kwargs})


def get_lora_model(model: nn.Module, config: LoraConfig | None = None) -> PeftModel:
    """`peft.get_peft_model(model, config or lora_config())`."""
    return get_peft_model(model, config if config is not None else lora_config())


def check_adapter_name(name) -> None:
    """A ValueError naming the adapter unless `name` is a plain folder name: PEFT saves an adapter other than
    "default" in `save_directory/<name>`, so an absolute name would be written outside `save_directory` (and outside
    its staging folder), a name with `/` or `\\` in a sub-folder, one that is not UTF-8 where safetensors cannot
    open it."""
    rule = ("must be a plain folder name (PEFT saves an adapter other than 'default' in save_directory/<name>): "
            "not empty, '.' or '..', without '/', '\\' or NUL, valid UTF-8")
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"adapter name {name!r} {rule}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as error:  # a surrogate-escaped byte of a file name
        raise ValueError(f"adapter name {name!r} {rule}") from error


def save_lora(peft_model: PeftModel, save_directory: str | os.PathLike, overwrite: bool | str = False,
              protect: tuple = (), **kwargs) -> Path:
    """`peft_model.save_pretrained(save_directory, **kwargs)`, never half-written. An existing non-empty folder is
    replaced only with `overwrite=True` and only if it holds an adapter (adapter_config.json), any folder with
    `overwrite="force"`; `save_directory` may not be, contain or lie inside the base model's local folder nor a path
    of `protect`. With `is_main_process=False`, or on a rank other than 0 where torch.distributed is initialized
    (every rank may call it), nothing is written: every rank wrote, and a rank that met another's lock was refused
    at once. Load with `PeftModel.from_pretrained(base_model, save_directory)`, which opens UTF-8 paths
    only (safetensors): another is refused (`check_destination`). Every adapter saved (`selected_adapters`, by
    default all) must have a plain folder name (`check_adapter_name`): PEFT writes it in a folder of that name."""
    selected = kwargs.get("selected_adapters")
    for name in (list(peft_model.peft_config) if selected is None else selected):
        check_adapter_name(name)
    if not writes_on_this_rank(kwargs.get("is_main_process", True)):  # every rank may call it, as save_for_hub
        return Path(save_directory).resolve()
    base = getattr(peft_model.get_base_model(), "name_or_path", "") or ""
    protect = (*protect, *([base] if base and Path(base).is_dir() else []))
    with atomic_directory(save_directory, overwrite, protect, name="save_directory",
                          expected=("adapter_config.json",)) as staging:
        peft_model.save_pretrained(staging, **kwargs)
    return Path(save_directory).resolve()


register_peft_default_targets()  # PEFT is imported: `import modeling_diff` imports this module where it is installed


__all__ = ["ANNEALING_MODULES", "DIFFERENTIAL_MODULES", "LORA_TARGET_MODULES", "check_adapter_name", "get_lora_model",
           "lora_config", "save_lora"]
