"""transformers' built-in DiffLlama (model_type "diffllama") <-> our V1, exactly, in both directions.

transformers' `DiffLlamaAttention` has H query heads and H_kv kv heads of width D. It computes the paper's V1
(`DiffAttentionV1`) with h = H / 2 differential heads, h_kv = H_kv / 2 kv heads, d = D and a subln weight of 1,
under a head permutation:
- differential head i takes Q1 = query head i and Q2 = query head i + h (its output is chunked in two along heads);
- kv group g takes K1 = key head g and K2 = key head g + h_kv (query heads i and i + h read kv heads g and
  g + h_kv, g = i // (h / h_kv), the group our head i reads), and V = [v_g | v_{g + h_kv}] (its value is chunked
  in two along kv heads, the halves concatenated along the last dimension);
- lambda from the same four vectors, lambda_init = 0.8 - 0.6 exp(-0.3 l), an RMSNorm over 2d without weight
  (`groupnorm`, eps = rms_norm_eps), the factor (1 - lambda_init), and heads concatenated into o_proj.
So the rows of q_proj, k_proj and v_proj (and their biases), viewed (2, n, D), become (n, 2, D) in ours; every
other tensor is kept and `subln.weight` is 1.

Back (`--to diffllama`): (n, 2, d) -> (2, n, d), and subln's weight w goes into o_proj. w is one vector of 2d shared
by every head and multiplies the *normalised* output, so o_proj(concat_i(w * x_i)) = W' concat_i(x_i) with
W'[:, i*2d + c] = W[:, i*2d + c] * w[c]: it folds into o_proj's columns (exact in exact arithmetic; in bf16/fp16
the folded weight is rounded once). What does not map is refused: diff_mode other than v1, a lambda_init other
than transformers' depth schedule, MLP biases, attention dropout (transformers' DiffLlama has none of them).
"""

import copy
import math
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from transformers import DiffLlamaConfig as TransformersDiffLlamaConfig
from transformers import DiffLlamaForCausalLM as TransformersDiffLlamaForCausalLM
from transformers import PreTrainedConfig

from modeling_diff.checkpoint_files import read_checkpoint_json
from modeling_diff.configuration import DiffLlamaConfig
from modeling_diff.diff_attention import depth_lambda_init
from modeling_diff.modeling_diff_llama import DiffLlamaForCausalLM

from .mapping import TensorMapping, _layer_of

SOURCE_MODEL_TYPE = TransformersDiffLlamaConfig.model_type  # "diffllama"
TARGETS = (DiffLlamaConfig.model_type, SOURCE_MODEL_TYPE)  # ("diff_llama", "diffllama"): what --to accepts

# Config fields both configs have with the same meaning.
_SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "hidden_act", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias",
    "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id", "lambda_std_dev", "head_dim", "use_cache",
)
_PERMUTED = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")
_SUBLN = "subln.weight"


def v1_config_from_diffllama(source: PreTrainedConfig) -> DiffLlamaConfig:
    """Our V1 config computing what transformers' DiffLlama of config `source` computes."""
    if source.model_type != SOURCE_MODEL_TYPE:
        raise ValueError(f"model_type must be {SOURCE_MODEL_TYPE!r}, got {source.model_type!r}")
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(source, field) % 2 != 0:
            raise ValueError(f"{field} must be even in a diffllama config (heads i and i + H/2 form one "
                             f"differential head), got {getattr(source, field)}")
    config = DiffLlamaConfig(
        **{name: getattr(source, name) for name in _SHARED_FIELDS},
        num_attention_heads=source.num_attention_heads // 2,
        num_key_value_heads=source.num_key_value_heads // 2,
        diff_mode="v1",
        lambda_init=None,  # transformers' depth schedule, which is ours
    )
    config.dtype = getattr(source, "dtype", None)
    return config


def diffllama_config_from_v1(config: DiffLlamaConfig) -> TransformersDiffLlamaConfig:
    """transformers' DiffLlama config computing what our V1 of `config` computes; ValueError where none does."""
    if config.model_type != DiffLlamaConfig.model_type or config.diff_mode != "v1":
        raise ValueError(f"only diff_mode='v1' exports to {SOURCE_MODEL_TYPE!r} (transformers' DiffLlama is V1), "
                         f"got {getattr(config, 'diff_mode', config.model_type)!r}")
    if config.lambda_init is not None:
        mismatched = [layer for layer in range(config.num_hidden_layers)
                      if not math.isclose(config.lambda_init, depth_lambda_init(layer), rel_tol=0, abs_tol=1e-12)]
        if mismatched:
            raise ValueError(
                f"lambda_init must be None (the depth schedule 0.8 - 0.6 exp(-0.3 l), the only one transformers' "
                f"DiffLlama has) to export to {SOURCE_MODEL_TYPE!r}, got the constant {config.lambda_init} "
                f"(differs at layer {mismatched[0]})"
            )
    if config.mlp_bias:
        raise ValueError(f"mlp_bias must be False to export to {SOURCE_MODEL_TYPE!r}: its MLP has no biases")
    if config.attention_dropout:
        raise ValueError(f"attention_dropout must be 0 to export to {SOURCE_MODEL_TYPE!r}: transformers' DiffLlama "
                         f"refuses dropout, got {config.attention_dropout}")
    target = TransformersDiffLlamaConfig(
        **{name: getattr(config, name) for name in _SHARED_FIELDS},
        num_attention_heads=2 * config.num_attention_heads,
        num_key_value_heads=2 * config.num_key_value_heads,
    )
    target.dtype = getattr(config, "dtype", None)
    return target


def _meta_shapes(model_class, config, tied: bool) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        state = model_class(copy.deepcopy(config)).state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    if tied:
        shapes.pop("lm_head.weight")
    return shapes


def _interleave_halves(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (2 * n * d, ...) viewed (2, n, d, ...) -> (n, 2, d, ...): half j of head i goes next to head i."""
    return tensor.unflatten(0, (2, -1, head_dim)).transpose(0, 1).flatten(0, 2)


def _split_halves(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of `_interleave_halves`: rows viewed (n, 2, d, ...) -> (2, n, d, ...)."""
    return tensor.unflatten(0, (-1, 2, head_dim)).transpose(0, 1).flatten(0, 2)


def _renames(source_names, target_names) -> dict[str, str]:
    """Source tensor name -> target tensor name: the same name, or else the one unmatched tensor of the same layer
    and module with the same last component (`self_attn.lambda_q1` <-> `self_attn.diff_lambda.lambda_q1`, however
    our model nests its lambdas). Names without a counterpart are left out."""
    def key(name):
        layer = _layer_of(name)
        return None if layer is None else (layer[0], layer[1].split(".")[0], layer[1].rpartition(".")[2])

    renames = {name: name for name in source_names if name in target_names}
    unmatched = [name for name in target_names if name not in renames]
    for name in source_names:
        candidates = [target for target in unmatched if key(name) is not None and key(target) == key(name)]
        if name not in renames and len(candidates) == 1:
            renames[name] = candidates[0]
    return renames


class _Between(TensorMapping, ABC):
    """A mapping between transformers' DiffLlama and our V1 (`source_class` -> `target_class`): tensors renamed by
    `_renames`; the only tensors without a counterpart are subln weights (ours), else it is an internal error.
    `get_tensor(name)` reads a source tensor (set by `DiffLlamaPlan.mapping`; the export reads subln weights)."""

    source_class: type
    target_class: type

    def __init__(self, source_config: PreTrainedConfig, config: PreTrainedConfig):
        self.source_config = source_config
        self.get_tensor = None
        super().__init__(config)
        target_shapes = _meta_shapes(self.target_class, config, config.tie_word_embeddings)
        self.renames = _renames(self.source_shapes, target_shapes)
        self.unmapped_source = sorted(set(self.source_shapes) - set(self.renames))
        self.unmapped_target = sorted(set(target_shapes) - set(self.renames.values()))
        unexpected = [name for name in self.unmapped_source + self.unmapped_target if not name.endswith(_SUBLN)]
        if unexpected:
            raise RuntimeError(f"internal error: no counterpart for {unexpected} between diffllama and diff_llama")

    def _source_shapes(self) -> dict[str, tuple[int, ...]]:
        return _meta_shapes(self.source_class, self.source_config, self.config.tie_word_embeddings)

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name not in self.renames:
            return {}  # our subln weight, folded into o_proj (DiffLlamaExport)
        layer = _layer_of(name)
        return {self.renames[name]: tensor if layer is None else self.map_layer_tensor(*layer, tensor)}

    @abstractmethod
    def map_layer_tensor(self, layer_idx: int, local: str, tensor: torch.Tensor) -> torch.Tensor:
        """Tensor `local` (its name inside layer `layer_idx`) as the target layout holds it: each direction's own."""

    def layer_extras(self, layer_idx: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """subln's weight of layer `layer_idx` where the target has one and the source not: 1, the weightless
        norm of transformers' DiffLlama (DiffLlamaImport); nothing otherwise."""
        prefix = f"model.layers.{layer_idx}."
        return {name: torch.ones(2 * self.config.head_dim, dtype=dtype)
                for name in self.unmapped_target if name.startswith(prefix)}


class DiffLlamaImport(_Between):
    """Maps the tensors of a transformers `diffllama` checkpoint to those of our V1 (`v1_config_from_diffllama`)."""

    source_class = TransformersDiffLlamaForCausalLM
    target_class = DiffLlamaForCausalLM

    def __init__(self, source_config: PreTrainedConfig):
        super().__init__(source_config, v1_config_from_diffllama(source_config))

    def map_layer_tensor(self, layer_idx: int, local: str, tensor: torch.Tensor) -> torch.Tensor:
        return _interleave_halves(tensor, self.config.head_dim) if local.startswith(_PERMUTED) else tensor


class DiffLlamaExport(_Between):
    """Maps the tensors of our V1 checkpoint (config `source_config`) to those of transformers' DiffLlama.
    o_proj's conversion reads its layer's subln weight through `get_tensor` (it may sit in another shard)."""

    source_class = DiffLlamaForCausalLM
    target_class = TransformersDiffLlamaForCausalLM

    def __init__(self, source_config: DiffLlamaConfig):
        super().__init__(source_config, diffllama_config_from_v1(source_config))
        self.subln = {_layer_of(name)[0]: name for name in self.unmapped_source}  # layer -> its subln weight

    def map_layer_tensor(self, layer_idx: int, local: str, tensor: torch.Tensor) -> torch.Tensor:
        d = self.config.head_dim
        if local.startswith(_PERMUTED):
            return _split_halves(tensor, d)
        if local == "self_attn.o_proj.weight":  # (hidden, h * 2d): column i*2d + c is scaled by w[c]
            subln = self.get_tensor(self.subln[layer_idx]).float()  # (2d,)
            return (tensor.float().unflatten(1, (-1, 2 * d)) * subln).flatten(1).to(tensor.dtype)
        return tensor


def applies(src: Path, to: str) -> bool:
    """Whether converting `src` to `to` is one of this module's: `to="diffllama"`, or a transformers diffllama
    source (model_type read from its config.json)."""
    if to not in TARGETS:
        raise ValueError(f"to must be one of {TARGETS}, got {to!r}")
    if to == SOURCE_MODEL_TYPE:
        if not (src / "config.json").is_file():
            raise ValueError(f"to={to!r} needs a {DiffLlamaConfig.model_type!r} checkpoint directory (config.json "
                             f"and safetensors), got {str(src)!r}")
        return True
    try:  # read as every source's config is (a config.json linking to /proc/kmsg hung here)
        return read_checkpoint_json(src, "config.json").get("model_type") == SOURCE_MODEL_TYPE
    except ValueError:  # not a readable config: the Llama path names the problem
        return False


# What `convert_checkpoint` chooses for a Llama-family source only, with its command-line option. Between the
# DiffLlamas every head maps to a V1 head (no selection, so no calibration) and V1 does not anneal: given, the last
# four were ignored as if applied (exit 0), and a calibration text asked for a tokenizer it never used.
_LLAMA_ONLY = {"method": "--method", "heads": "--heads", "head_fraction": "--head-fraction",
               "calibration": "--calibration-file", "anneal_steps": "--anneal-steps", "noise_init": "--noise-init"}


def check_unset(to: str, **options) -> None:
    """Before the source's weights or tokenizer are read: a ValueError naming the `options` (those of `_LLAMA_ONLY`)
    that are set, for a conversion to `to` that this module runs (`applies`)."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        source = DiffLlamaConfig.model_type if to == SOURCE_MODEL_TYPE else SOURCE_MODEL_TYPE
        raise ValueError(f"{', '.join(f'{name} ({_LLAMA_ONLY[name]})' for name in given)} given, but method and heads "
                         f"must be left unset to convert {source!r} to {to!r} (every head maps to a V1 head), and so "
                         f"must head_fraction and calibration (no heads are chosen) and anneal_steps and noise_init "
                         f"(V1 does not anneal)")


class DiffLlamaPlan:
    """A conversion between transformers' DiffLlama and our V1 checked before anything is written, as
    `convert_checkpoint` runs it (the interface of its `_Plan`; the choices for Llama-family sources are refused by
    `check_unset`). `source_tensors` yields (name, shape, dtype, where)."""

    def __init__(self, source_config: PreTrainedConfig, to: str, source_tensors, source_name: str):
        if to == DiffLlamaConfig.model_type:
            self._mapping = DiffLlamaImport(source_config)
        elif source_config.model_type != DiffLlamaConfig.model_type:
            raise ValueError(f"to={SOURCE_MODEL_TYPE!r} needs a {DiffLlamaConfig.model_type!r} source with "
                             f"diff_mode='v1', got model_type {source_config.model_type!r}")
        else:
            self._mapping = DiffLlamaExport(source_config)
        kept = [name for name, shape, dtype, where in source_tensors if self._mapping.check(name, shape, dtype, where)]
        self._mapping.check_complete(kept, source_name)

    def mapping(self, get_tensor, progress: bool) -> TensorMapping:
        self._mapping.get_tensor = get_tensor
        return self._mapping


__all__ = [
    "DiffLlamaExport", "DiffLlamaImport", "DiffLlamaPlan", "TARGETS", "applies", "check_unset",
    "diffllama_config_from_v1", "v1_config_from_diffllama",
]
