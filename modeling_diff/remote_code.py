"""What an exported folder's `auto_map` names for its models (`hub.auto_map`): the model classes, and the
registrations with optional packages that `import modeling_diff` makes for the package and that the folder's code,
which never imports modeling_diff, makes here, as soon as the package is imported, before or after the model is
loaded (loading imports neither):
- PEFT's default target modules for "diff_llama" (`peft_targets.py`), so that `LoraConfig(task_type="CAUSAL_LM")`
  adapts the model as a Llama;
- Liger's model-type dispatch (`liger.py`), so that Trainer's `use_liger_kernel=True` (which imports liger-kernel)
  patches the model with the folder's own `apply_liger_kernel_to_diff_llama`.
The registrations live here, above the model module that `liger.py` patches, so that no two modules import each
other."""

from .import_hooks import call_when_imported
from .modeling_diff_llama import (DiffLlamaForCausalLM, DiffLlamaForQuestionAnswering,
                                  DiffLlamaForSequenceClassification, DiffLlamaForTokenClassification, DiffLlamaModel)
from .peft_targets import register_peft_default_targets


def _register_with_liger() -> None:
    from . import liger  # noqa: F401 (imported, it puts "diff_llama" in Liger's dispatch)


call_when_imported("peft.utils.constants", register_peft_default_targets)
call_when_imported("liger_kernel.transformers", _register_with_liger)

__all__ = ["DiffLlamaForCausalLM", "DiffLlamaForQuestionAnswering", "DiffLlamaForSequenceClassification",
           "DiffLlamaForTokenClassification", "DiffLlamaModel"]
