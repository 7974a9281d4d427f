"""From a pretrained Llama-family checkpoint to a DiffLlama one: the config and the tensors.

A converted model computes exactly what the source computes at the moment of conversion:
- `dex`: the Llama weights are kept unchanged; each layer gains f_D = 0 (`dex_proj`), `lambda_learn` =
  lambda_init and the annealing step t = 0, so O - lambda * f_D(O) = O.
- `v2`: query head i of the source becomes the signal head 2i of pair i; its noise head 2i+1 starts as a copy
  of it (`noise_init="copy"`) or with zero query weights, i.e. uniform attention (`noise_init="zeros"`), and
  `lambda_proj` = 0. The noise term is multiplied by the anneal factor min(1, t/T), 0 at t = 0.
  Signal head 2i reads kv head 2i // (2h / h_kv) = i // (h / h_kv), the kv head source head i read.

Tensors are mapped one at a time (`TensorMapping.convert`) so that a sharded checkpoint can be converted
shard by shard; the tensors a layer gains come from `TensorMapping.layer_extras`.
"""

import copy
import logging
import re

import torch
from transformers import PreTrainedConfig

from modeling_diff.checkpoint_files import is_finite
from modeling_diff.configuration import MAX_ANNEAL_STEPS, DiffLlamaConfig
from modeling_diff.diff_attention import layer_lambda_init
from modeling_diff.modeling_diff_llama import DiffLlamaForCausalLM

logger = logging.getLogger(__name__)

METHODS = ("dex", "v2")
NOISE_INITS = ("copy", "zeros")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Llama config fields that carry over to DiffLlamaConfig unchanged.
_SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "rope_parameters", "tie_word_embeddings", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
)
# Tensors older checkpoints carry that are recomputed from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def check_method(method: str, anneal_steps: int, noise_init: str = "copy") -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if noise_init not in NOISE_INITS:
        raise ValueError(f"noise_init must be one of {NOISE_INITS}, got {noise_init!r}")
    # DiffLlamaConfig's bound, checked with the other arguments: left to the output's config, built from the
    # source's, 2**40 was refused only after a GGUF source had been dequantised.
    if isinstance(anneal_steps, bool) or not isinstance(anneal_steps, int) or not 0 <= anneal_steps < MAX_ANNEAL_STEPS:
        raise ValueError(f"anneal_steps must be an integer >= 0 and < 2**31 (the config's bound), got {anneal_steps!r}")
    if method == "v2" and anneal_steps == 0:
        # Without annealing the noise head enters at full weight and the converted model is no longer the source.
        raise ValueError("anneal_steps must be >= 1 for method='v2': the noise term is annealed in from 0")


def check_finite(name: str, tensor: torch.Tensor, where: str) -> None:
    """Raise unless every value of source tensor `name` (in `where`) is finite, as it is converted (it is in memory
    then). A NaN or inf weight makes the logits non-finite: it was converted silently (exit 0) wherever no entropy
    calibration ran through it (`--heads all`, `v2`, lm_head or the final norm)."""
    if not is_finite(tensor):
        raise ValueError(f"tensor {name!r} in {where} holds NaN or inf values: a source with non-finite weights "
                         f"has non-finite logits, which no conversion keeps; it is not converted")


def tied_as_loaded(source_config: PreTrainedConfig, names, get_tensor) -> PreTrainedConfig:
    """`source_config`, or a copy untied (`tie_word_embeddings=False`) where it ties lm_head to the embedding but the
    source (`names`, `get_tensor(name)`) holds an lm_head.weight of other values: transformers loads such a
    checkpoint untied (it warns and keeps both), so that is the source whose logits the conversion keeps. Tied, the
    converted model dropped that lm_head.weight and answered with the embedding's."""
    names = set(names)
    if not getattr(source_config, "tie_word_embeddings", False) or not {_HEAD, _EMBEDDING} <= names:
        return source_config
    head, embedding = get_tensor(_HEAD), get_tensor(_EMBEDDING)
    if head.shape == embedding.shape and torch.equal(head, embedding):
        return source_config
    logger.warning(f"config.json ties lm_head to the embedding (tie_word_embeddings=True), but the source holds an "
                   f"{_HEAD} of other values: converted untied, as transformers loads the source (both kept)")
    untied = copy.deepcopy(source_config)
    untied.tie_word_embeddings = False
    return untied


def tied_renames(source_config: PreTrainedConfig, names) -> dict[str, str]:
    """{stored name: the name transformers loads it as} for a source (`names`) whose tensors it loads under other
    names: a config tying lm_head to the embedding whose checkpoint stores lm_head.weight alone is loaded with that
    tensor as the embedding both share (it was refused: "model.embed_tokens.weight missing")."""
    names = set(names)
    if getattr(source_config, "tie_word_embeddings", False) and _HEAD in names and _EMBEDDING not in names:
        return {_HEAD: _EMBEDDING}
    return {}


def _qwen2_slides(config: PreTrainedConfig) -> bool:
    """Whether any layer of a Qwen2 config uses its sliding window: those from max_window_layers on, if
    use_sliding_window (transformers' `layer_types` says so per layer)."""
    layer_types = getattr(config, "layer_types", None)
    return "sliding_attention" in layer_types if layer_types is not None else bool(config.use_sliding_window)


def check_source_architecture(source_config: PreTrainedConfig) -> None:
    """A ValueError unless `source_config` is of a family this converter maps (a Llama, a Mistral or a Qwen2 without
    sliding-window layers). Checked first: a DEX output converted again asked for a tokenizer before it was told that
    a diff_llama is no source."""
    model_type = getattr(source_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    if model_type == "mistral" and source_config.sliding_window is not None:
        raise ValueError(
            f"sliding_window must be None to convert a Mistral model (DiffLlama has no sliding-window attention), "
            f"got {source_config.sliding_window}"
        )
    if model_type == "qwen2" and _qwen2_slides(source_config):
        raise ValueError(f"a Qwen2 model converts only without sliding-window layers (DiffLlama has no sliding window): "
                         f"use_sliding_window must be False, or max_window_layers >= num_hidden_layers "
                         f"({source_config.num_hidden_layers}), got max_window_layers "
                         f"{getattr(source_config, 'max_window_layers', None)}")


def diff_config_from_source(
    source_config: PreTrainedConfig, method: str = "dex", dex_heads: list | None = None, anneal_steps: int = 0,
) -> DiffLlamaConfig:
    """The DiffLlamaConfig of the converted model. `dex_heads` (one list per layer) only for `method="dex"`."""
    check_source_architecture(source_config)
    model_type = source_config.model_type
    fields = {name: getattr(source_config, name) for name in _SHARED_FIELDS}
    head_dim = getattr(source_config, "head_dim", None)
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"head_dim must be a positive integer, or absent (hidden_size // num_attention_heads), "
                         f"got {head_dim!r}")
    head_dim = head_dim or source_config.hidden_size // source_config.num_attention_heads
    # Qwen2's q/k/v biases need attention_bias=True; its missing o_proj bias then becomes a zero bias.
    attention_bias = bool(getattr(source_config, "attention_bias", False)) or model_type == "qwen2"
    config = DiffLlamaConfig(
        **fields,
        head_dim=head_dim,
        attention_bias=attention_bias,
        mlp_bias=bool(getattr(source_config, "mlp_bias", False)),
        diff_mode=method,
        dex_heads=dex_heads if method == "dex" else None,
        anneal_steps=anneal_steps,
    )
    config.dtype = getattr(source_config, "dtype", None)
    return config


def _layer_of(name: str) -> tuple[int, str] | None:
    match = _LAYER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


class TensorMapping:
    """Maps the tensors of a Llama-family checkpoint to those of the DiffLlama described by `config`."""

    def __init__(self, config: DiffLlamaConfig, add_o_proj_bias: bool = False, noise_init: str = "copy"):
        self.config = config
        self.add_o_proj_bias = add_o_proj_bias
        self.noise_init = noise_init
        self.source_shapes = self._source_shapes()

    @classmethod
    def for_source(
        cls, source_config: PreTrainedConfig, method: str = "dex", dex_heads: list | None = None,
        anneal_steps: int = 0, noise_init: str = "copy",
    ) -> "TensorMapping":
        check_method(method, anneal_steps, noise_init)
        config = diff_config_from_source(source_config, method, dex_heads, anneal_steps)
        # Qwen2 has q/k/v biases but no o_proj bias: with attention_bias=True the converted o_proj gets a zero one.
        return cls(config, add_o_proj_bias=source_config.model_type == "qwen2", noise_init=noise_init)

    def _source_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the source must hold: the DEX model's minus what DEX adds.
        (The DEX model has the source's shapes for every method; V2 only reshapes q_proj.)"""
        dex_config = copy.deepcopy(self.config)
        dex_config.diff_mode, dex_config.dex_heads = "dex", None
        with torch.device("meta"):
            state = DiffLlamaForCausalLM(dex_config).state_dict()
        added = ("dex_proj.weight", "lambda_learn", "annealing.step")
        added += ("o_proj.bias",) if self.add_o_proj_bias else ()
        shapes = {name: tuple(t.shape) for name, t in state.items() if not name.endswith(added)}
        if self.config.tie_word_embeddings:
            shapes.pop("lm_head.weight")
        return shapes

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | str, where: str) -> bool:
        """Raise if tensor `name` of the source is unexpected or malformed; False if it is to be dropped."""
        if _IGNORED.fullmatch(name) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return False  # recomputed from the config / tied to the embedding
        if name not in self.source_shapes:
            raise ValueError(f"unexpected tensor {name!r} in {where}: not part of a "
                             f"{self.config.num_hidden_layers}-layer Llama with this config.json")
        if tuple(shape) != self.source_shapes[name]:
            raise ValueError(f"tensor {name!r} in {where} has shape {tuple(shape)}, expected "
                             f"{self.source_shapes[name]} from config.json")
        if str(dtype).removeprefix("torch.") not in ("float32", "float16", "bfloat16", "F32", "F16", "BF16"):
            raise ValueError(f"tensor {name!r} in {where} has dtype {dtype}, expected float32, float16 or bfloat16")
        return True

    def check_complete(self, names, where: str) -> None:
        missing = sorted(set(self.source_shapes) - set(names))
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5])
            shown += f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"tensor {shown} missing from {where}")

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The converted tensor(s) for source tensor `name` (already `check`ed)."""
        layer = _layer_of(name)
        if self.config.diff_mode == "v2" and layer is not None and layer[1].startswith("self_attn.q_proj."):
            return {name: self._signal_noise_pairs(tensor)}
        return {name: tensor}

    def _signal_noise_pairs(self, q_proj: torch.Tensor) -> torch.Tensor:
        """q_proj weight (h*d, hidden) or bias (h*d,) -> (2h*d, ...) with rows of head i at pair slot 2i."""
        signal = q_proj.unflatten(0, (self.config.num_attention_heads, 1, self.config.head_dim))  # (h, 1, d, ...)
        noise = signal if self.noise_init == "copy" else torch.zeros_like(signal)
        return torch.cat([signal, noise], dim=1).flatten(0, 2)  # (h, 2, d, ...) -> (2h*d, ...)

    def layer_extras(self, layer_idx: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Tensors layer `layer_idx` gains, set so that the layer computes what the source layer computes."""
        prefix = f"model.layers.{layer_idx}.self_attn."
        extras = {prefix + "annealing.step": torch.zeros((), dtype=torch.int64)}
        if self.config.diff_mode == "dex":
            d = self.config.head_dim
            extras[prefix + "dex_proj.weight"] = torch.zeros(d, d, dtype=dtype)
            lambda_init = layer_lambda_init(self.config, layer_idx)
            extras[prefix + "dex_lambda.lambda_learn"] = torch.full((1,), lambda_init, dtype=dtype)
        else:
            extras[prefix + "lambda_proj.weight"] = torch.zeros(
                self.config.num_attention_heads, self.config.hidden_size, dtype=dtype
            )
        if self.add_o_proj_bias:
            extras[prefix + "o_proj.bias"] = torch.zeros(self.config.hidden_size, dtype=dtype)
        return extras

    @staticmethod
    def extras_anchor(layer_idx: int) -> str:
        """The source tensor next to which (in the same shard) a layer's extras are written."""
        return f"model.layers.{layer_idx}.self_attn.o_proj.weight"
