"""PEFT's default target modules for model type "diff_llama": Llama's, for every PEFT method that has them (the
projections carry Llama's names), so that a config without `target_modules` (`LoraConfig(task_type=...)`,
`IA3Config()`) adapts a DiffLlama as it would a Llama; PEFT raised "Please specify `target_modules`".

Registered where PEFT is imported, never by importing it: importing it took 5.5 s, which neither the model's module
nor an exported remote-code folder (modeling_diff/hub.py carries this module) should cost a user who does not use
PEFT. `modeling_diff.lora` imports PEFT and registers (`import modeling_diff` imports it where PEFT is installed); an
exported remote-code folder's `remote_code.py` registers when PEFT is imported, before or after the model is
loaded."""

import sys

from .configuration import DiffLlamaConfig


def register_peft_default_targets() -> None:
    """Give "diff_llama" Llama's entry in each of PEFT's `TRANSFORMERS_MODELS_TO_*` maps, where PEFT is imported."""
    constants = sys.modules.get("peft.utils.constants")
    for name in dir(constants) if constants is not None else ():
        mapping = getattr(constants, name)
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(mapping, dict) and "llama" in mapping:
            mapping.setdefault(DiffLlamaConfig.model_type, mapping["llama"])


__all__ = ["register_peft_default_targets"]
