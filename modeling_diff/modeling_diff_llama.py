"""DiffLlama models: transformers' Llama with differential attention (V1, V2 or DEX, by `config.diff_mode`).

Structure mirrors transformers' `models/llama/modeling_llama.py`: embeddings -> decoder layers (pre-norm
attention + SwiGLU MLP) -> norm -> lm_head. The rotary embedding, RMSNorm and the MLP are LlamaRotaryEmbedding,
LlamaRMSNorm and LlamaMLP with Triton kernels on the fast paths; the attention differs (see `diff_attention.py`).

transformers renamed the cache argument `past_key_values` to `cache` after 5.17; both names are accepted,
and outputs carry the cache under the name the installed transformers expects.
"""

import functools
import inspect
import math
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from huggingface_hub import HfApi
from torch import nn
from transformers import AutoModel, conversion_mapping
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (GenericForQuestionAnswering, GenericForSequenceClassification,
                                         GenericForTokenClassification, GradientCheckpointingLayer)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration import DiffLlamaConfig
from . import tensor_parallel  # noqa: F401  (registers the plan's styles for the differential parameters)
from .decode_graphs import decode_step
from .generation import graphed_greedy_generate
from .diff_attention import (
    ATTENTION_CLASSES, LEGACY_ATTENTION_NAMES, MAX_ANNEAL_STEP, AnnealingStep, DexAttention, DexLambda,
    DifferentialLambda, DiffAttentionV1, DiffAttentionV2, check_loaded_anneal_step, register_annealed_model,
)
from .kernels import (
    add_rms_norm, add_rms_norm_applies, check_static_cache_fits, gated_projection, gated_projection_applies,
    keep_own_forward, resolve, rms_norm, rms_norm_kernel_applies, rope_cos_sin, rope_cos_sin_applies, runs_own_forward,
    silu_mul, silu_mul_applies, split_linear, split_linear_applies, static_step_mask, swiglu_mlp,
    swiglu_mlp_applies, uses_fast_kernels,
)

logger = logging.get_logger(__name__)

# "cache" (transformers > 5.17) or "past_key_values" (5.17): the keyword of masks and model outputs.
CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _pick_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    return cache if cache is not None else past_key_values


def _renamed_cache_kwarg(forward):
    """Where the keyword is `cache`, `past_key_values=` warns and is renamed, as in transformers' Llama."""
    if CACHE_KWARG == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)
    return forward


def _no_cache_unless_asked_in_training(forward):
    """A training forward (train mode, gradients on) builds a DynamicCache only where the call asks for one
    (`use_cache=True`). transformers' Llama builds one from `config.use_cache`, which no training step reads: it
    copies every layer's keys and values into the cache, and its backward copies their gradients back to the
    projections' layout (64 launches, about 1.4 ms of a 2K x 4 step of the ~1.1B preset). Anywhere else the
    config's default holds. (As for transformers' decorator under it, use_cache is a keyword.)"""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("use_cache") is None and self.training and torch.is_grad_enabled():
            kwargs["use_cache"] = False
        return forward(self, *args, **kwargs)

    return wrapper


class DiffLlamaRMSNorm(LlamaRMSNorm):
    """transformers' LlamaRMSNorm (same weight, same arithmetic); on the project's fast implementations (`sdpa` on
    CUDA, `diff_triton`, `fused_diff`) one Triton pass forward and one backward (`kernels/rmsnorm.py`); the decoder
    layer's residual add before it joins its pass (`add_and_norm`). Not taken by transformers' Hub kernelization
    (`kernels.keep_own_forward`)."""

    kernel_condition = staticmethod(keep_own_forward)

    def __init__(self, config: DiffLlamaConfig):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)
        self.config = config

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if uses_fast_kernels(resolve(self.config._attn_implementation, hidden_states)) and rms_norm_kernel_applies(
            hidden_states, self.weight
        ):
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


# The norms whose residual add may join their pass (`add_and_norm`): exact types, so that Liger's norm, PEFT's
# wrappers and subclasses with other arithmetic keep their own forward (a module-level tuple: Liger's class-level
# patch rebinds the name DiffLlamaRMSNorm, not this).
ADD_FUSED_NORMS = (DiffLlamaRMSNorm, LlamaRMSNorm)


def add_and_norm(norm: nn.Module, residual: torch.Tensor, update: torch.Tensor, config: DiffLlamaConfig):
    """(residual + update, norm of it): one Triton pass (and in training one backward pass, the residual stream's
    gradient added in the norm's) on the fast implementations, where `norm` is a LlamaRMSNorm without hooks and
    without a forward of its instance (Liger's instance patch binds one); the add, then the norm's forward,
    otherwise. The config (its attention implementation) is read last: most calls leave at the type checks."""
    if (
        type(norm) in ADD_FUSED_NORMS
        and runs_own_forward(norm)
        and add_rms_norm_applies(residual, update, norm.weight)
        and uses_fast_kernels(resolve(config._attn_implementation, update))
    ):
        return add_rms_norm(residual, update, norm.weight, norm.variance_epsilon)
    hidden_states = residual + update
    return hidden_states, norm(hidden_states)


class DiffLlamaRotaryEmbedding(LlamaRotaryEmbedding):
    """transformers' LlamaRotaryEmbedding (same frequencies, same arithmetic); in a decoding step on the project's
    fast implementations, cos and sin in one Triton launch (`kernels/rope.py`) where its forward issues about
    eight kernels. RoPE types that update their frequencies in the forward (dynamic, longrope) keep its forward."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            rope_cos_sin_applies(x, position_ids, self.inv_freq)
            and "dynamic" not in self.rope_type and self.rope_type != "longrope"
            and uses_fast_kernels(resolve(self.config._attn_implementation, x))
        ):
            return rope_cos_sin(position_ids, self.inv_freq, self.attention_scaling, x.dtype)
        return super().forward(x, position_ids)


class DiffLlamaMLP(LlamaMLP):
    """transformers' LlamaMLP (same weights, same arithmetic); in training on the project's fast implementations one
    autograd node that keeps gate(x) and up(x) but not silu(gate(x)) * up(x), which its backward computes again
    (`kernels/swiglu.py`): two (tokens x intermediate) activations a layer, where LlamaMLP keeps four and Liger's
    SwiGLU MLP three. With wrapped projections (PEFT's LoRA layers) the activation alone takes a kernel that keeps
    gate(x) and up(x) and not silu(gate(x)). In a decoding step gate, up and the activation are one launch and
    down_proj is split along its input (`kernels/projection.py`), the decoder's residual add in its last pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not uses_fast_kernels(resolve(self.config._attn_implementation, x)):
            return super().forward(x)
        decoded = self.decoding_forward(x)
        if decoded is not None:  # no residual: (mlp(x), None) from down_proj's split, else (None, mlp(x))
            summed, update = decoded
            return summed if update is None else update
        if swiglu_mlp_applies(self, x):
            return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        # wrapped projections (PEFT's LoRA layers, tensor parallelism, hooks): their own forward, the activation
        # in one pass that keeps gate(x) and up(x) but not silu(gate(x))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation_in_kernels() and silu_mul_applies(gate, up):
            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(self.act_fn(gate) * up)

    def activation_in_kernels(self) -> bool:
        """Whether a kernel may compute the activation in act_fn's place: silu, and act_fn called by nobody else's
        hook (`runs_own_forward`)."""
        return self.config.hidden_act in ("silu", "swish") and runs_own_forward(self.act_fn)

    def decoding_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """A decoding step's MLP on the kernels (no gradients, few tokens, plain projections; the caller is on a fast
        implementation): silu(gate(x)) * up(x) in one launch, then down_proj split along its input, with `residual`
        added in its last pass where given. -> (residual + mlp(x), None) where that pass made the sum, else
        (residual, mlp(x)) for the caller to add; None where the kernels do not take x."""
        if not (self.activation_in_kernels() and gated_projection_applies(x, self.gate_proj, self.up_proj)):
            return None
        activation = gated_projection(x, self.gate_proj, self.up_proj)
        if split_linear_applies(activation, self.down_proj, residual):
            return split_linear(activation, self.down_proj, residual), None
        return residual, self.down_proj(activation)


class DiffLlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.self_attn = ATTENTION_CLASSES[config.diff_mode](config=config, layer_idx=layer_idx)
        self.mlp = DiffLlamaMLP(config)
        self.input_layernorm = DiffLlamaRMSNorm(config)
        self.post_attention_layernorm = DiffLlamaRMSNorm(config)

    def forward(
        self, hidden_states, attention_mask=None, position_embeddings=None, cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        residual, update = self.residual_stream(hidden_states, None, attention_mask, position_embeddings, cache,
                                                **kwargs)
        return residual if update is None else residual + update

    def residual_stream(self, hidden_states, pending, attention_mask=None, position_embeddings=None, cache=None,
                        **kwargs: Unpack[TransformersKwargs]):
        """The layer's output as (residual, update), their sum; update None where a kernel's pass made the sum.
        `pending`: the layer before's update not yet added to hidden_states (None: nothing pending), added in the
        input norm's pass (`DiffLlamaModel.forward` hands it on, `defers_residual_adds`: one launch a layer fewer
        where down_proj runs on cuBLAS, steps of more than 16 tokens, prefill and training, and in training one
        gradient sum fewer)."""
        residual, hidden_states = self.before_attention(hidden_states, pending)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        return self.after_attention(residual, hidden_states)

    def before_attention(self, hidden_states: torch.Tensor, pending: torch.Tensor | None):
        """(the residual, the input norm of it): hidden_states + pending and its norm in one pass where an update is
        pending (`add_and_norm`)."""
        if pending is None:
            return hidden_states, self.input_layernorm(hidden_states)
        return add_and_norm(self.input_layernorm, hidden_states, pending, self.config)

    def after_attention(self, residual: torch.Tensor, attn_output: torch.Tensor):
        """residual + attention, its norm (one pass on the fast implementations), and the MLP -> (residual, update) as
        `residual_stream` gives them: in decoding steps where the MLP is ours without hooks or a forward of its
        instance (Liger's and PEFT's modules, and hooks, see the MLP's own output) the residual add in down_proj's
        last pass where it is split (update None), else left to the caller."""
        residual, hidden_states = add_and_norm(self.post_attention_layernorm, residual, attn_output, self.config)
        mlp = self.mlp
        if (
            type(mlp) is DiffLlamaMLP
            and runs_own_forward(mlp)
            and uses_fast_kernels(resolve(self.config._attn_implementation, hidden_states))
        ):
            decoded = mlp.decoding_forward(hidden_states, residual)
            if decoded is not None:
                return decoded
        return residual, mlp(hidden_states)


def defers_residual_adds(layers) -> bool:
    """Whether the model's loop may hand each layer's last residual add to the next layer's input norm
    (`residual_stream`): where every layer is ours as built and called plainly, with no hooks (transformers records
    hidden states through hooks: the layers' outputs are then the sums; FSDP2's wrapped layers are of another
    class), no forward bound on the instance, no compiled call and, in training, no gradient checkpointing (which
    replays the layer's call)."""
    recording = torch.is_grad_enabled()
    return all(
        type(layer) is DiffLlamaDecoderLayer and runs_own_forward(layer) and layer._compiled_call_impl is None
        and not (recording and layer.gradient_checkpointing and layer.training)
        for layer in layers
    )


class _AsVector(ConversionOps):
    """A scalar -> a 1-element vector (DEX's lambda_learn was a scalar before FSDP2 support)."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.reshape(1)}


class _LegacyLayout:
    """Loading-only transforms: saving always writes the current layout, so their reverse matches nothing."""

    __slots__ = ()

    def reverse_transform(self):
        return WeightRenaming(source_patterns=r"\Z_legacy_layout", target_patterns="_legacy_layout")


class _LegacyRenaming(_LegacyLayout, WeightRenaming):
    __slots__ = ()


class _LegacyConverter(_LegacyLayout, WeightConverter):
    __slots__ = ()


# Loads under way in this process (of any thread): the legacy transforms stay registered while one is.
_LEGACY_LOADS = {"count": 0, "lock": threading.Lock()}


@contextmanager
def _legacy_layout_readable():
    """While a checkpoint loads, checkpoints of `LEGACY_ATTENTION_NAMES` load unchanged (a scalar lambda_learn
    becomes a vector). Registered for loads only: the model type's mapping is what transformers reverses on save,
    and these transforms are one-way. The registry is the process's: it is removed when the last load under way
    ends (a load ending in one thread removed it under another's, which then lost its legacy weights)."""
    model_type = DiffLlamaConfig.model_type
    with _LEGACY_LOADS["lock"]:
        if _LEGACY_LOADS["count"] == 0:
            transforms = [
                _LegacyConverter(rf"self_attn\.{old}", f"self_attn.{new}", operations=[_AsVector()])
                if old == "lambda_learn" else _LegacyRenaming(rf"self_attn\.{old}", f"self_attn.{new}")
                for old, new in LEGACY_ATTENTION_NAMES.items()
            ]
            register_checkpoint_conversion_mapping(model_type, transforms, overwrite=True)
        _LEGACY_LOADS["count"] += 1
    try:
        yield
    finally:
        with _LEGACY_LOADS["lock"]:
            _LEGACY_LOADS["count"] -= 1
            if _LEGACY_LOADS["count"] == 0:
                conversion_mapping._checkpoint_conversion_mapping_cache.pop(model_type, None)
                conversion_mapping.USER_REGISTERED_MAPPINGS.discard(model_type)


def _copy_folder_code(code: Path, auto_map: dict, save_directory: Path) -> None:
    """Copy from `code` (the loaded copy of an exported folder's code) each module `auto_map` names and the modules it
    imports, as transformers' loader takes them: files of that folder, named by identifiers (never a path)."""
    modules = {reference.rpartition(".")[0] for reference in auto_map.values() if isinstance(reference, str)}
    for module in sorted(name for name in modules if name.isidentifier() and (code / f"{name}.py").is_file()):
        for needed in [code / f"{module}.py", *map(Path, get_relative_import_files(code / f"{module}.py"))]:
            shutil.copyfile(needed, save_directory / needed.name)


class DiffLlamaPreTrainedModel(PreTrainedModel):
    config_class = DiffLlamaConfig
    config: DiffLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DiffLlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    # PEFT maps the keys of adapter files with this (transformers' own loading: `_legacy_layout_readable`), so
    # adapters of `LEGACY_ATTENTION_NAMES` load unchanged (DexLambda reshapes a scalar lambda_learn).
    _checkpoint_conversion_mapping = {
        rf"self_attn\.{old}$": f"self_attn.{new}" for old, new in LEGACY_ATTENTION_NAMES.items()
    }
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": DiffLlamaDecoderLayer,
        "attentions": [DiffAttentionV1, DiffAttentionV2, DexAttention],
    }

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        with _legacy_layout_readable():
            loaded = super().from_pretrained(*args, **kwargs)
        _check_anneal_steps(loaded[0] if isinstance(loaded, tuple) else loaded)  # (with output_loading_info)
        return loaded

    def post_init(self):
        super().post_init()
        register_annealed_model(self)  # optimizer steps count for the model as a whole

    def __setstate__(self, state):  # a copy (copy.deepcopy, pickle) runs no post_init: registered here instead
        super().__setstate__(state)
        register_annealed_model(self)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained (its arguments, positional or named), for two kinds of models that hold an
        exported folder's `auto_map` (`modeling_diff.hub.save_for_hub`): a model of the folder's code writes that code
        whole (`_save_with_folder_code`); a model of the package's classes (the same folder loaded after `import
        modeling_diff`) writes no code, so its config.json leaves out the `auto_map` that named the code (a Python
        without the package failed on the missing files): `save_for_hub` writes a folder that loads without it."""
        if self._auto_class is None and self.config.auto_map:
            logger.warning_once("save_pretrained of modeling_diff's classes writes no model code: the exported "
                                "folder's auto_map is left out of config.json (modeling_diff.hub.save_for_hub writes "
                                "a folder that loads without the package)")
            auto_map, self.config.auto_map = self.config.auto_map, {}
            try:
                return super().save_pretrained(save_directory, *args, **kwargs)
            finally:
                self.config.auto_map = auto_map
        if self._auto_class is not None and self.config.auto_map and not getattr(self, "_hf_peft_config_loaded", False):
            return self._save_with_folder_code(save_directory, *args, **kwargs)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _save_with_folder_code(self, save_directory, *args, **kwargs) -> None:
        """save_pretrained of a model of an exported folder's code (loaded with `trust_remote_code=True` where
        modeling_diff is not imported): transformers copies only the model class's file and its imports, and names
        that file in `auto_map` for the model's Auto class. The folder lost `remote_code.py`, which the other model
        entries name (AutoModel and the task heads did not load from it) and which registers PEFT's default targets
        and Liger's dispatch as the model loads. Here the folder's code is written whole, with the folder's
        `auto_map`, and with `push_to_hub=True` the folder is uploaded once it is whole."""
        arguments = inspect.signature(PreTrainedModel.save_pretrained).bind(self, save_directory, *args, **kwargs)
        arguments = {**arguments.arguments, **arguments.arguments.pop("kwargs", {})}
        del arguments["self"]
        push_to_hub, main = arguments.pop("push_to_hub", False), arguments.get("is_main_process", True)
        hub_kwargs = {name: arguments.pop(name) for name in ("repo_id", "commit_message", "create_pr", "private")
                      if name in arguments}
        if push_to_hub and main:  # what the folder held before, as transformers' own push compares it
            Path(save_directory).mkdir(parents=True, exist_ok=True)
            files_timestamps = self._get_files_timestamps(save_directory)
        auto_map = dict(self.config.auto_map)  # the folder's own entries, before transformers renames this class's
        super().save_pretrained(**arguments)
        self.config.auto_map = auto_map
        if not main:
            return
        _copy_folder_code(Path(sys.modules[type(self).__module__].__file__).parent, auto_map, Path(save_directory))
        self.config.save_pretrained(save_directory)  # config.json with the folder's auto_map
        if push_to_hub:
            repo_id = HfApi().create_repo(hub_kwargs.get("repo_id", Path(save_directory).name), exist_ok=True,
                                          private=hub_kwargs.get("private"), token=arguments.get("token")).repo_id
            self._upload_modified_files(save_directory, repo_id, files_timestamps, token=arguments.get("token"),
                                        commit_message=hub_kwargs.get("commit_message"),
                                        create_pr=hub_kwargs.get("create_pr", False))

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DifferentialLambda):
            for vector in module.vectors():
                init.normal_(vector, 0.0, self.config.lambda_std_dev)
        elif isinstance(module, DexLambda):
            init.constant_(module.lambda_learn, module.lambda_init)
        elif isinstance(module, AnnealingStep):
            init.zeros_(module.step)
        elif isinstance(module, DexAttention):
            init.zeros_(module.dex_proj.weight)
            init.copy_(module.head_mask, module.selected_head_mask())


class DiffLlamaModel(DiffLlamaPreTrainedModel):
    # Decoding steps with a DynamicCache on CUDA as piecewise CUDA graphs (`decode_graphs.py`); False: the layers'
    # eager forward every step.
    decode_graphs = True

    def __init__(self, config: DiffLlamaConfig):
        super().__init__(config)
        config.validate_architecture()  # its fields again: a config's attributes may be set after it was made
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [DiffLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = DiffLlamaRMSNorm(config)
        self.rotary_emb = DiffLlamaRotaryEmbedding(config=config)  # RoPE over head_dim d
        self.gradient_checkpointing = False
        self.post_init()

    @_no_cache_unless_asked_in_training
    @merge_with_config_defaults
    @capture_outputs
    @_renamed_cache_kwarg
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = _pick_cache(cache, past_key_values)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        # transformers' mask looks for packed sequences in the positions a caller passes (without a cache and a
        # mask). The default positions are one sequence a row, and looking reads them on the host: a synchronization
        # that, in a training step without a cache, leaves the GPU idle until the host has launched the forward.
        packed_positions = position_ids
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # a step into a StaticCache without padding: transformers' mask in one launch; else transformers'
        causal_mask = static_step_mask(self.config, inputs_embeds, attention_mask, cache)
        if causal_mask is None:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=packed_positions,
                **{CACHE_KWARG: cache},
            )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)  # (B, L, d) each
        graphed = decode_step(self, hidden_states, position_embeddings, causal_mask, cache, kwargs)
        if graphed is not None:  # a decoding step with a DynamicCache through the graphs: the final norm's output
            return BaseModelOutputWithPast(last_hidden_state=graphed, **{CACHE_KWARG: cache})
        layers = self.layers[: self.config.num_hidden_layers]
        deferred = defers_residual_adds(layers)
        pending = None  # where deferred: the last layer's update, added in the next norm's pass
        for decoder_layer in layers:
            if deferred:
                hidden_states, pending = decoder_layer.residual_stream(
                    hidden_states, pending, causal_mask, position_embeddings, cache, position_ids=position_ids,
                    **kwargs,
                )
            else:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=causal_mask,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    cache=cache,
                    **kwargs,
                )
        hidden_states = self.final_norm(hidden_states, pending)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_KWARG: cache})

    def final_norm(self, residual: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        """The last norm of residual (+ pending, the last layer's update, in the same pass where it is given)."""
        return self.norm(residual) if pending is None else add_and_norm(self.norm, residual, pending, self.config)[1]


class DiffLlamaForCausalLM(DiffLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    # (hidden_states, labels, **loss_kwargs) -> loss without materialising the logits, a method: set by
    # `modeling_diff.liger.apply_liger_kernel_to_diff_llama` (Liger's fused linear cross-entropy); None = lm_head + loss
    fused_linear_loss = None

    def __init__(self, config: DiffLlamaConfig):
        super().__init__(config)
        self.model = DiffLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @_renamed_cache_kwarg
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        skip_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """`labels` gives the shifted causal-LM loss (Trainer's `num_items_in_batch` is honoured);
        `logits_to_keep`: an int keeps the last that many positions (0 = all), a tensor gives the indices.
        `skip_logits` (Liger's argument; default: in training, when labels are given): with a `fused_linear_loss`
        set, the loss comes from the hidden states and `logits` is None."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=_pick_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, keep, :]
        if skip_logits and labels is None:
            raise ValueError("skip_logits=True needs labels: without logits the loss is the only output")
        logits = loss = None
        if self.fused_linear_loss is not None and labels is not None and (
            self.training if skip_logits is None else skip_logits
        ):
            loss = self.fused_linear_loss(hidden_states, labels, **kwargs)
        else:
            logits = self.lm_head(hidden_states)
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
        )

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """transformers' `generate`. Plain greedy decoding with `cache_implementation="static"` on CUDA replays each
        step as one CUDA graph (`modeling_diff.generation`): the same tokens, without the per-token Python of the
        decoding loop; `disable_compile=True` or anything else (sampling, beams, processors, a streamer...) takes
        transformers' loop. A StaticCache passed in that is too short is a ValueError before the first token
        (`_prepare_cache_for_generation`)."""
        output = graphed_greedy_generate(self, inputs, generation_config, kwargs)
        if output is not None:
            return output
        return super().generate(inputs, generation_config, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers' choice whether generate compiles the decoding step, except for an offloading StaticCache
        (`cache_implementation="offloaded_static"`, or one made with `offloading=True`) unless `compile_config` asks:
        that compiled step died of a segmentation fault on an H200 (transformers 5.17, torch 2.11) for transformers'
        own LlamaForCausalLM as for ours; uncompiled, it gives the dynamic cache's tokens (benchmarks/RESULTS.md,
        "the offloaded StaticCache under generate's compile")."""
        cache = _pick_cache(model_kwargs.get("cache"), model_kwargs.get("past_key_values"))
        if getattr(cache, "offloading", False) and generation_config.compile_config is None:
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """transformers' step that sizes the cache it makes by `max_cache_length`; a StaticCache passed in that is
        shorter is a ValueError here, before the first token (`check_static_cache_fits`)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)
        cache = _pick_cache(model_kwargs.get("cache"), model_kwargs.get("past_key_values"))
        if isinstance(cache, Cache):
            check_static_cache_fits(cache, max_cache_length)

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `generate(cache_implementation="paged")`, both of
        which start here). V1 is refused: its cache holds keys and values 2 x head_dim wide, and the paged cache sizes
        its blocks by head_dim (continuous batching's worker logged an error and returned no tokens)."""
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        if self.config.diff_mode == "v1":
            raise ValueError("continuous batching (generate_batch, cache_implementation='paged') does not take "
                             "diff_mode='v1': its cache holds keys and values of 2 x head_dim, and transformers' "
                             "paged cache sizes them by head_dim; use generate(), or a V2 or DEX model")
        if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:
            # 5.17 and 5.18 hand the paged cache to the attention function as `cache`, the name of our layers' own
            raise ValueError(f"continuous batching of a DiffLlama needs transformers >= 5.19 (a paged cache updated "
                             f"through the layers' cache.update), got {transformers.__version__}; use generate()")
        return super().init_continuous_batching(*args, **kwargs)


class _DiffLlamaHead(DiffLlamaPreTrainedModel):
    """A head on the base model, as transformers' Llama builds its heads: GenericFor* makes the base model,
    `self.model`, with `AutoModel.from_config(config)`, so AutoModel must know the config's class first. In an
    exported folder's remote code it did not (transformers registers only the head being loaded, and loads the config
    from a module copy of its own), took the class by its name, DiffLlamaConfig, for transformers' built-in DiffLlama's
    and built that model instead."""

    def __init__(self, config: DiffLlamaConfig):
        # Ours or the folder's copy of it (its class name is ours, its model_type is not transformers' DiffLlama's);
        # a subclass is left to AutoModel, as for Llama's heads
        if type(config).__name__ == DiffLlamaConfig.__name__ and config.model_type == DiffLlamaConfig.model_type:
            AutoModel.register(type(config), DiffLlamaModel, exist_ok=True)
        super().__init__(config)


class DiffLlamaForSequenceClassification(GenericForSequenceClassification, _DiffLlamaHead):
    pass


class DiffLlamaForTokenClassification(GenericForTokenClassification, _DiffLlamaHead):
    pass


class DiffLlamaForQuestionAnswering(GenericForQuestionAnswering, _DiffLlamaHead):
    pass


def _check_anneal_steps(model: nn.Module) -> None:
    """After transformers' load (which bypasses `AnnealingStep`'s own check on torch's loading path): every t in
    [0, MAX_ANNEAL_STEP)."""
    for name, module in model.named_modules():
        if isinstance(module, AnnealingStep):
            check_loaded_anneal_step(f"{name}.step", module.step)


def set_anneal_step(model: nn.Module, step: int) -> None:
    """Set the annealing step t (the number of optimizer steps taken) of every V2 / DEX attention in `model`,
    stored exactly in its integer `AnnealingStep` buffer (the active adapter's copy under PEFT's modules_to_save)."""
    try:
        whole = not isinstance(step, bool) and math.isfinite(step) and int(step) == step
    except (TypeError, ValueError, OverflowError, RuntimeError):  # not a number
        whole = False
    if not whole or not 0 <= step < MAX_ANNEAL_STEP:
        raise ValueError(f"step must be a non-negative whole number of optimizer steps below 2**62, got {step!r}")
    for module in model.modules():
        if isinstance(module, (DiffAttentionV2, DexAttention)):
            module.anneal_step.fill_(int(step))


__all__ = [
    "DiffLlamaPreTrainedModel",
    "DiffLlamaModel",
    "DiffLlamaForCausalLM",
    "DiffLlamaForQuestionAnswering",
    "DiffLlamaForSequenceClassification",
    "DiffLlamaForTokenClassification",
    "set_anneal_step",
]
