"""What an exported folder's `auto_map` names for its models (`hub.auto_map`): the model classes, and the
registration with Liger that `import modeling_diff` makes for the package and that the folder's code, which never
imports modeling_diff, makes here. When liger-kernel is imported (by Trainer's `use_liger_kernel=True`, before or
after the model is loaded; loading imports it not, 3.4 s), "diff_llama" enters Liger's model-type dispatch, which
patches each model with its own code's `apply_liger_kernel_to_diff_llama` (`liger.py`). The registration lives
here, above the model module that `liger.py` patches, so that neither imports the other both ways."""

from .import_hooks import call_when_imported
from .modeling_diff_llama import (DiffLlamaForCausalLM, DiffLlamaForQuestionAnswering,
                                  DiffLlamaForSequenceClassification, DiffLlamaForTokenClassification, DiffLlamaModel)


def _register_with_liger() -> None:
    from . import liger  # noqa: F401 (imported, it puts "diff_llama" in Liger's dispatch)


call_when_imported("liger_kernel.transformers", _register_with_liger)

__all__ = ["DiffLlamaForCausalLM", "DiffLlamaForQuestionAnswering", "DiffLlamaForSequenceClassification",
           "DiffLlamaForTokenClassification", "DiffLlamaModel"]
