"""Liger Kernel (linkedin/Liger-Kernel, `pip install "modeling-diff[liger]"`) for DiffLlama, the way Llama gets it.

    from modeling_diff.liger import apply_liger_kernel_to_diff_llama
    apply_liger_kernel_to_diff_llama()             # every DiffLlama built afterwards, as apply_liger_kernel_to_llama()
    apply_liger_kernel_to_diff_llama(model=model)  # one model already built

`import modeling_diff` registers the function in Liger's model-type dispatch (`MODEL_TYPE_TO_APPLY_LIGER_FN`
["diff_llama"]) when liger-kernel is installed, so `TrainingArguments(use_liger_kernel=True)` (and TRL's
`use_liger_kernel`, which goes through the same dispatch) apply it to a DiffLlama as they do to a Llama, with
`liger_kernel_config` passed on as keyword arguments.

What it replaces (Liger's kernels are Triton: CUDA tensors, or Triton's interpreter):
- `fused_linear_cross_entropy` (default): in training with labels, the loss of `DiffLlamaForCausalLM` through
  Liger's fused linear cross-entropy, which runs lm_head and the cross-entropy over chunks of rows, so the
  (tokens x vocab) logits are never materialised; `logits` is then None. `labels` with -100,
  `num_items_in_batch` (Trainer's gradient accumulation), `shift_labels` and `logits_to_keep` mean what they mean
  on the plain path; in eval, or with `skip_logits=False`, the forward is the plain one.
- `cross_entropy`: Liger's cross-entropy on materialised logits (as for Llama, Liger replaces
  `torch.nn.functional.cross_entropy` for the whole process); exclusive with `fused_linear_cross_entropy`.
- `rms_norm` (off by default, unlike for Llama): the decoder's RMSNorms (input, post-attention and final) through
  Liger's RMSNorm (Llama's casting: only the inverse RMS in float32). Off, they keep the project's kernel
  (`kernels/rmsnorm.py`), which measured 2.5x faster forward + backward on the H200 (benchmarks/RESULTS.md,
  `liger_kernels.py`). V1's per-head `subln` is never replaced (the attention's combine reads it).
- `swiglu`: accepted so that configurations naming it apply unchanged; the MLP stays the project's
  (`DiffLlamaMLP`, `kernels/swiglu.py`): silu(gate) * up in one pass as Liger's kernel does, and in training one
  (tokens x intermediate) activation fewer kept for the backward than Liger's SwiGLU MLP keeps (benchmarks/RESULTS.md
  compares them: `liger_kernels.py`).
- `rope`: accepted so that configurations naming it apply unchanged; RoPE stays the attention's own (on the fast
  paths one Triton launch for queries and keys, `kernels/rope.py`), since the differential layouts (V1's Q1/Q2,
  V2's 2h query heads) are rotated there in one call. benchmarks/RESULTS.md compares it with Liger's kernel.
"""

import functools
import inspect
import sys
from types import MethodType

import torch

from . import modeling_diff_llama
from .configuration import DiffLlamaConfig
from .kernels import runs_own_forward
from .modeling_diff_llama import DiffLlamaForCausalLM, DiffLlamaPreTrainedModel, DiffLlamaRMSNorm

try:
    from liger_kernel.transformers.functional import liger_cross_entropy, liger_fused_linear_cross_entropy
    from liger_kernel.transformers.model.llama import lce_maybe_trainable_lm_head
    from liger_kernel.transformers.model.loss_utils import unpack_cross_entropy_result
    from liger_kernel.transformers.monkey_patch import (
        MODEL_TYPE_TO_APPLY_LIGER_FN, _patch_rms_norm_module,
    )
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
except ImportError:  # the optional extra [liger] is not installed: everything else works without it
    LIGER_AVAILABLE = False
else:
    LIGER_AVAILABLE = True
    # Liger versions before `chunk_mem_const` get their own chunks (their loss would refuse the argument)
    LIGER_TAKES_CHUNK_BUDGET = "chunk_mem_const" in inspect.signature(liger_fused_linear_cross_entropy).parameters

    class LigerDiffLlamaRMSNorm(LigerRMSNorm):
        """What `apply_liger_kernel_to_diff_llama()` builds in place of DiffLlamaRMSNorm: Liger's RMSNorm with
        DiffLlama's constructor (the same `weight`, so checkpoints load either way)."""

        def __init__(self, config: DiffLlamaConfig):
            super().__init__(config.hidden_size, eps=config.rms_norm_eps)


FUSED_LOSS_CHUNK_TOKENS = 2048


def fused_loss_chunk_budget(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Liger's `chunk_mem_const` for a fused loss over `tokens` rows: the budget at which its chunks hold at least
    FUSED_LOSS_CHUNK_TOKENS rows. Liger's default (1) bounds a chunk's logits by (tokens x hidden) elements, which
    at 8192 tokens, hidden 2048 and vocab 32000 is 512 rows a chunk, too few for the products to run at the
    tensor cores' rate: 2048 rows made lm_head + loss 16% faster on the H200 (6.75 -> 5.66 ms forward +
    backward, benchmarks/RESULTS.md), for 0.1 GiB more transient memory. Where the default already gives
    chunks as large (long sequences), it is kept."""
    return max(1, -(-vocab_size * FUSED_LOSS_CHUNK_TOKENS // (hidden_size * max(tokens, 1))))


def _check_labels(name: str, labels: torch.Tensor, rows: torch.Size, vocab_size: int, ignore_index: int) -> None:
    """Liger's fused loss reads the labels by flat row unchecked, where transformers' loss raises: a shape other
    than the hidden states' rows (labels of another batch, the whole sequence beside logits_to_keep) crashed the
    process or gave a loss of the wrong rows, an id outside the vocabulary a loss of -1e13. The shape is checked
    here, the ids asserted on the device (no synchronisation in a training step)."""
    if labels.shape != rows:
        raise ValueError(f"{name} of shape {tuple(labels.shape)} must match the {tuple(rows)} positions whose logits "
                         f"the loss takes (batch x sequence, after logits_to_keep)")
    in_vocabulary = (labels >= 0) & (labels < vocab_size)
    torch._assert_async((in_vocabulary | (labels == ignore_index)).all(),
                        f"{name} must be token ids in [0, {vocab_size}) or ignore_index ({ignore_index})")


def adapts_lm_head(model: DiffLlamaForCausalLM) -> bool:
    """Whether PEFT adapters add to lm_head's output (LoRA, DoRA, IA3, ... on lm_head: active, not merged, not
    disabled). Liger's fused loss reads lm_head's weight alone: with them it gave the base model's loss and the
    adapters no gradient, silently (Liger's Llama alike)."""
    # No adapter without PEFT imported; read from sys.modules, not imported: an exported folder's copy of this file
    # would make PEFT a requirement of transformers' remote-code loader (which lists the files' imports)
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    lm_head = model.lm_head
    return (tuners is not None and isinstance(lm_head, tuners.BaseTunerLayer) and bool(lm_head.active_adapters)
            and not lm_head.merged and not lm_head.disable_adapters)


def liger_fused_linear_loss(self: DiffLlamaForCausalLM, hidden_states, labels, **loss_kwargs) -> torch.Tensor:
    """`DiffLlamaForCausalLM.fused_linear_loss`: the shifted causal-LM loss of lm_head(hidden_states) (B, L, hidden)
    against `labels` (B, L), through Liger's fused linear cross-entropy (which unwraps a PEFT `modules_to_save`
    lm_head and gathers an FSDP-sharded one, as for Llama). Where PEFT adapters add to lm_head's output
    (`adapts_lm_head`), or lm_head has hooks or a forward bound on it (`runs_own_forward`), which the fused loss
    would not run, the loss of lm_head's own output (its logits made, as on the plain path)."""
    shift_labels = loss_kwargs.pop("shift_labels", None)
    for name, value in (("labels", labels), ("shift_labels", shift_labels)):
        if value is not None:
            _check_labels(name, value, hidden_states.shape[:-1], self.config.vocab_size,
                          loss_kwargs.get("ignore_index", -100))
    if adapts_lm_head(self) or not runs_own_forward(self.lm_head):  # hooks, accelerate's bound forward: called
        return self.loss_function(logits=self.lm_head(hidden_states), labels=labels,
                                  vocab_size=self.config.vocab_size, shift_labels=shift_labels, **loss_kwargs)
    if LIGER_TAKES_CHUNK_BUDGET:
        loss_kwargs.setdefault("chunk_mem_const", fused_loss_chunk_budget(
            hidden_states.shape[:-1].numel(), self.config.hidden_size, self.config.vocab_size))
    # Liger views the rows flat: logits_to_keep's slice is copied (keeping all positions, it is a no-op)
    result = lce_maybe_trainable_lm_head(
        self, hidden_states=hidden_states.contiguous(), hidden_size=self.config.hidden_size, labels=labels,
        shift_labels=shift_labels, **loss_kwargs,
    )
    return unpack_cross_entropy_result(result)[0]


def apply_liger_kernel_to_diff_llama(
    rope: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    rms_norm: bool = False,
    swiglu: bool = True,
    model: DiffLlamaForCausalLM | None = None,
) -> None:
    """Liger's kernels in DiffLlama (see the module docstring); the arguments are `apply_liger_kernel_to_llama`'s
    (`rope` and `swiglu` keep the project's kernels). Without `model` the classes are patched (models built
    afterwards); with it, that model's modules."""
    if not LIGER_AVAILABLE:
        raise ModuleNotFoundError("apply_liger_kernel_to_diff_llama needs the 'liger_kernel' package: "
                                  "pip install 'modeling-diff[liger]'", name="liger_kernel")
    if cross_entropy and fused_linear_cross_entropy:
        raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True: the fused loss "
                         "computes the cross-entropy itself, from the hidden states")
    if cross_entropy:  # as apply_liger_kernel_to_llama does: transformers' loss functions call it
        from transformers.loss.loss_utils import nn

        nn.functional.cross_entropy = liger_cross_entropy

    if model is None:
        if rms_norm:
            modeling_diff_llama.DiffLlamaRMSNorm = LigerDiffLlamaRMSNorm
        if fused_linear_cross_entropy:
            DiffLlamaForCausalLM.fused_linear_loss = liger_fused_linear_loss
        return

    if callable(getattr(model, "get_base_model", None)):  # a PEFT model: its modules are the wrapped model's
        model = model.get_base_model()
    if not isinstance(model, DiffLlamaPreTrainedModel):  # (it patched nothing, silently)
        where = type(model).__module__
        raise ValueError(f"model must be a DiffLlama model (or a PEFT model of one), got {type(model).__name__}" + (
            f" of remote code ({where}): load the folder without trust_remote_code, with modeling_diff imported, "
            f"for the package's classes" if where.startswith("transformers_modules.")  # an exported folder's copy
            else "; Liger's apply_liger_kernel_to_llama and its siblings patch other models"))
    base_model = getattr(model, model.base_model_prefix, model)
    if rms_norm:
        for module in base_model.modules():
            if isinstance(module, DiffLlamaRMSNorm):  # not V1's subln: the attention's combine reads it
                _patch_rms_norm_module(module)
    if fused_linear_cross_entropy and isinstance(model, DiffLlamaForCausalLM):
        model.fused_linear_loss = MethodType(liger_fused_linear_loss, model)


@functools.wraps(apply_liger_kernel_to_diff_llama)  # its signature: Liger passes the keywords that it names
def apply_liger_kernel_with_the_model_s_own_code(*args, model=None, **kwargs) -> None:
    """Liger's dispatch entry for "diff_llama", one for the package and every exported folder's copy of this module
    (`remote_code.py`; the first registered stays): the `apply_liger_kernel_to_diff_llama` of the code the model (or
    the model a PEFT model wraps) is built from, where that code's copy of this module is imported, else this one."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    own = sys.modules.get(type(base).__module__.rpartition(".")[0] + ".liger")
    getattr(own, "apply_liger_kernel_to_diff_llama", apply_liger_kernel_to_diff_llama)(*args, model=model, **kwargs)


if LIGER_AVAILABLE:  # what TrainingArguments(use_liger_kernel=True) and TRL look config.model_type up in
    MODEL_TYPE_TO_APPLY_LIGER_FN.setdefault(DiffLlamaConfig.model_type, apply_liger_kernel_with_the_model_s_own_code)
