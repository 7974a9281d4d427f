"""modeling_diff: differential attention (DIFF Transformer V1, V2, DEX retrofit) as a transformers model.

Importing the package registers `DiffLlamaConfig` (model_type "diff_llama") with `AutoConfig` and the
models with `AutoModel`, `AutoModelForCausalLM`, `AutoModelForSequenceClassification`,
`AutoModelForTokenClassification` and `AutoModelForQuestionAnswering`.
transformers' built-in "diffllama" classes are untouched.
"""

from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForQuestionAnswering,
                          AutoModelForSequenceClassification, AutoModelForTokenClassification)

from .configuration import DIFF_MODES, PRESETS, DiffLlamaConfig, preset_config
from .modeling_diff_llama import (
    DiffLlamaForCausalLM,
    DiffLlamaForQuestionAnswering,
    DiffLlamaForSequenceClassification,
    DiffLlamaForTokenClassification,
    DiffLlamaModel,
    DiffLlamaPreTrainedModel,
    set_anneal_step,
)
from .liger import apply_liger_kernel_to_diff_llama  # registers "diff_llama" with Liger's dispatch when installed

try:  # gives "diff_llama" PEFT's default target modules of Llama, where PEFT is installed
    from . import lora  # noqa: F401
except ImportError:  # no PEFT, or one that does not import with this transformers: the rest works without it
    pass

__version__ = "0.1.0"

# exist_ok: the class *name* DiffLlamaConfig is also transformers' built-in one.
AutoConfig.register(DiffLlamaConfig.model_type, DiffLlamaConfig, exist_ok=True)
AutoModel.register(DiffLlamaConfig, DiffLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(DiffLlamaConfig, DiffLlamaForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DiffLlamaConfig, DiffLlamaForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(DiffLlamaConfig, DiffLlamaForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(DiffLlamaConfig, DiffLlamaForQuestionAnswering, exist_ok=True)

__all__ = [
    "DIFF_MODES",
    "PRESETS",
    "apply_liger_kernel_to_diff_llama",
    "DiffLlamaConfig",
    "DiffLlamaForCausalLM",
    "DiffLlamaForQuestionAnswering",
    "DiffLlamaForSequenceClassification",
    "DiffLlamaForTokenClassification",
    "DiffLlamaModel",
    "DiffLlamaPreTrainedModel",
    "preset_config",
    "set_anneal_step",
]
