"""`DiffLlamaConfig`: a Llama config plus the fields of differential attention.

Field names follow transformers' `LlamaConfig` so that every tool that reads a Llama config (generation,
caches, mask creation, accelerate, PEFT) reads ours unchanged. `model_type` is `"diff_llama"`, distinct
from transformers' built-in V1-only `"diffllama"`.
"""

import math

import torch
from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

DIFF_MODES = ("v1", "v2", "dex")
MAX_ANNEAL_STEPS = 2**31  # anneal_steps lies in [0, MAX_ANNEAL_STEPS): t / T is computed from the int64 step

# Each mode's own parameters in the tensor-parallel plan. V2's lambda_proj (one output per pair) is column-wise, so
# each rank computes the weights of its own pairs. The others are held whole by every rank while they act on its
# heads, and their gradients are summed over the ranks (the styles of `modeling_diff/tensor_parallel.py`).
MODE_TP_PLANS = {
    "v1": {
        "layers.*.self_attn.diff_lambda": "diff_replicated_grad_allreduce",
        "layers.*.self_attn.subln": "diff_replicated_grad_allreduce",
    },
    "v2": {"layers.*.self_attn.lambda_proj": "colwise"},
    "dex": {
        "layers.*.self_attn.dex_proj": "diff_replicated_grad_allreduce",
        "layers.*.self_attn.dex_lambda": "dex_head_slice",
    },
}


def _plain_value_errors(cls):
    """`@strict` wraps the errors of its type checks and validators in its own exception types; users, the CLI and
    DESIGN.md expect a plain ValueError naming the field (a wrong type included)."""
    strict_setattr, strict_validate = cls.__setattr__, cls.validate

    def __setattr__(self, name, value):
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            raise ValueError(f"{name} has the wrong type: {error.__cause__}") from error

    def validate(self):
        try:
            strict_validate(self)
        except StrictDataclassClassValidationError as error:
            raise ValueError(str(error.__cause__)) from error
        except KeyError as error:  # transformers' rope validation: a rope_type's required key missing
            raise ValueError(error.args[0]) from error

    validate.__is_defined_by_strict_decorator__ = True  # lets a @strict subclass replace it, as strict's own
    cls.__setattr__, cls.validate = __setattr__, validate
    return cls


def qualified_architecture(name: str) -> str:
    """`DiffLlamaForCausalLM` -> `modeling_diff.DiffLlamaForCausalLM` (see `DiffLlamaConfig.to_dict`)."""
    return name if "." in name else f"modeling_diff.{name}"


@_plain_value_errors
@strict
class DiffLlamaConfig(PreTrainedConfig):
    r"""
    Configuration of a differential-attention Llama.

    diff_mode (`str`, defaults to `"v1"`):
        `"v1"`: DIFF Transformer (Ye et al., 2024): `num_attention_heads` differential heads, each with two
        query/key halves of `head_dim` and a value of `2 * head_dim`; default `head_dim = hidden_size // (2h)`.
        `"v2"`: DIFF Transformer V2: `2 * num_attention_heads` query heads forming signal/noise pairs
        (2i, 2i+1) in one GQA group, mixed by a token-dependent `sigmoid(lambda_proj(x))`;
        default `head_dim = hidden_size // h`.
        `"dex"`: DEX retrofit (Kong et al., 2025): Llama attention whose output on the heads of `dex_heads`
        becomes `O - lambda * f_D(O)`; default `head_dim = hidden_size // h`.
    lambda_std_dev (`float`, defaults to 0.1):
        Standard deviation of the normal initialisation of V1's `lambda_q1, lambda_k1, lambda_q2, lambda_k2`.
    lambda_init (`float`, *optional*):
        Constant lambda_init for every layer (V1, DEX). `None` uses the depth schedule `0.8 - 0.6 exp(-0.3 l)`.
    dex_heads (`list[list[int]]`, *optional*):
        DEX only: for each layer, the indices of the heads that carry the DEX operator. `None` selects all.
    anneal_steps (`int`, defaults to 0):
        V2 and DEX: number of training steps over which the differential term is annealed in from zero
        (DEX: lambda schedule of the DEX paper; V2: a factor `min(1, t/T)` on the noise term). 0 disables
        annealing: the differential term is at full strength from the start. The current step is stored
        in each attention's `annealing.step` buffer, so it is saved with the weights.
    """

    model_type = "diff_llama"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # The plan of the projections every mode shares (Llama's). Column-wise q/k/v and row-wise o shard along whole
    # head pairs as long as the number of ranks divides num_key_value_heads: V1 keeps Q1/Q2 (and K1/K2) of one head
    # contiguous in q_proj/k_proj rows, V2 keeps the pair (2i, 2i+1) contiguous, so a pair never straddles two
    # ranks. `__post_init__` adds the mode's own parameters (`MODE_TP_PLANS`).
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    diff_mode: str = "v1"
    lambda_std_dev: float = 0.1
    lambda_init: float | None = None
    dex_heads: list | None = None
    anneal_steps: int = 0

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.diff_mode in DIFF_MODES and self.num_attention_heads > 0:
            heads_sharing_hidden = 2 * self.num_attention_heads if self.diff_mode == "v1" else self.num_attention_heads
            if self.hidden_size % heads_sharing_hidden != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by "
                    f"{'2 * num_attention_heads' if self.diff_mode == 'v1' else 'num_attention_heads'} "
                    f"({heads_sharing_hidden}) for diff_mode={self.diff_mode!r} when head_dim is not given"
                )
            self.head_dim = self.hidden_size // heads_sharing_hidden
        # Validate here too: `@strict` wraps errors of its validators in its own exception type, and users
        # (and DESIGN.md) expect a plain ValueError naming the field.
        _check_dtype("torch_dtype", kwargs.get("torch_dtype"))  # the legacy name, turned into dtype by transformers
        self.validate_architecture()
        self.base_model_tp_plan = {**type(self).base_model_tp_plan, **MODE_TP_PLANS[self.diff_mode]}
        # `auto_map` names the model code where it is saved with it (`modeling_diff.hub.save_for_hub`), empty
        # otherwise: loaders such as TRL's read it for every model whose architecture is not in transformers.
        self.auto_map = {}
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict:
        """As `PreTrainedConfig.to_dict`, with `architectures` qualified by the package: `save_pretrained` writes
        the class name, `DiffLlamaForCausalLM`, which is also the name of transformers' built-in (V1-only)
        DiffLlama. Loaders that resolve `architectures[0]` in the `transformers` namespace (TRL's
        `SFTTrainer(model=path)`, pipelines) would build that other model and load our weights into it;
        `modeling_diff.DiffLlamaForCausalLM` resolves to nothing there, so they fall back to the Auto classes,
        which build ours."""
        output = super().to_dict()
        if not output.get("auto_map"):
            output.pop("auto_map", None)
        if output.get("architectures"):
            output["architectures"] = [qualified_architecture(name) for name in output["architectures"]]
        return output

    def validate_architecture(self):
        """Part of `@strict` validation: every rule names the field it checks."""
        if self.diff_mode not in DIFF_MODES:
            raise ValueError(f"diff_mode must be one of {DIFF_MODES}, got {self.diff_mode!r}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act must be one of transformers' activations ({', '.join(sorted(ACT2FN))}), "
                             f"got {self.hidden_act!r}")
        # An epsilon added to the mean square of the hidden state before the division: above 1 it outweighs the mean
        # square of any usual activation (order 1 or less) and the norm no longer normalises. Checkpoints use 1e-12
        # to 1e-5; transformers' tester mixins set 1.0 (`set_config_for_less_flaky_test`).
        _check_range("rms_norm_eps", self.rms_norm_eps, 0, 1, "> 0 and at most 1", low_open=True)
        self._check_token_ids()
        # The standard deviation of the initial weights: a Linear of fan-in n scales its input by about
        # initializer_range * sqrt(n), 8x a layer at 1 and n = 64. Checkpoints use 0.02 or less; 1e300 overflowed
        # float32 and made every logit NaN.
        _check_range("initializer_range", self.initializer_range, 0, 1, ">= 0 and at most 1")
        _check_range("attention_dropout", self.attention_dropout or 0.0, 0, 1, "in [0, 1)", high_open=True)
        self._check_rope_parameters()
        # lambda_std_dev > 1 gives lambda = exp(q1 . k1) - ... of order exp(sqrt(head_dim)): no usable start.
        _check_range("lambda_std_dev", self.lambda_std_dev, 0, 1, "in [0, 1]")
        if self.lambda_init is not None:
            if self.diff_mode == "v2":
                raise ValueError("lambda_init is not used by diff_mode='v2' (its lambda is sigmoid(lambda_proj(x))); "
                                 f"leave it None, got {self.lambda_init!r}")
            # (1 - lambda_init) scales V1's output: 1 would zero every attention output.
            _check_range("lambda_init", self.lambda_init, 0, 1, "in [0, 1)", high_open=True)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _check_dtype("dtype", self.dtype)
        # (t / T is computed from the int64 step: a T beyond int64 overflowed in the first forward)
        if isinstance(self.anneal_steps, bool) or not 0 <= self.anneal_steps < MAX_ANNEAL_STEPS:
            raise ValueError(f"anneal_steps must be an integer in [0, 2**31), got {self.anneal_steps!r}")
        if self.anneal_steps and self.diff_mode == "v1":
            raise ValueError(f"anneal_steps is not used by diff_mode='v1' (only V2 and DEX anneal); leave it 0, got "
                             f"{self.anneal_steps}")
        if self.dex_heads is not None:
            if self.diff_mode != "dex":
                raise ValueError(f"dex_heads is only used with diff_mode='dex', got diff_mode={self.diff_mode!r}")
            if not isinstance(self.dex_heads, (list, tuple)) or len(self.dex_heads) != self.num_hidden_layers:
                raise ValueError(
                    f"dex_heads must hold one list per layer ({self.num_hidden_layers}), got {self.dex_heads!r}"
                )
            for layer_idx, heads in enumerate(self.dex_heads):
                if not isinstance(heads, (list, tuple)):
                    raise ValueError(f"dex_heads must hold one list of head indices per layer "
                                     f"({self.num_hidden_layers}), got {self.dex_heads!r}")
                if any(  # (the types first: a nested list is unhashable)
                    isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < self.num_attention_heads
                    for h in heads
                ) or len(set(heads)) != len(heads):
                    raise ValueError(
                        f"dex_heads[{layer_idx}] must hold distinct head indices in [0, {self.num_attention_heads}), "
                        f"got {heads}"
                    )
            # A layer's list may be empty (that layer keeps Llama attention; the converter writes it for
            # `--heads '[[0],[]]'`); a DEX model without a single DEX head is a Llama with unused parameters.
            if not any(self.dex_heads):
                raise ValueError(f"dex_heads selects no head in any layer: diff_mode='dex' needs at least one (None "
                                 f"selects all), got {self.dex_heads!r}")

    def _check_token_ids(self):
        """pad_token_id is the embedding's padding row (nn.Embedding's padding_idx): a row outside the embedding
        failed only when the model was built, with nn.Embedding's AssertionError. -1 (the last row) stays allowed:
        Llama checkpoints on the Hub carry it, and transformers' own config only warns about it. bos_token_id is what
        generate() starts from without a prompt (outside the embedding: an IndexError), eos_token_id (an id or a
        list) what it stops at (outside the vocabulary: never sampled, so generation silently runs to max_length)."""
        pad = self.pad_token_id
        if pad is not None and not -1 <= pad < self.vocab_size:  # (its type is @strict's: an int)
            raise ValueError(f"pad_token_id must be None, -1 or a token id in [0, {self.vocab_size}), got {pad!r}")
        for field in ("bos_token_id", "eos_token_id"):
            value = getattr(self, field)
            ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in ids):
                what = "a token id or a list of token ids" if field == "eos_token_id" else "a token id"
                raise ValueError(f"{field} must be None or {what} in [0, {self.vocab_size}), got {value!r}")

    def _check_rope_parameters(self):
        """A rope_type transformers knows; rope_theta and a scaling factor >= 1, partial_rotary_factor in (0, 1],
        original_max_position_embeddings a positive integer, every other number (YaRN's betas, Llama 3's frequency
        factors, LongRoPE's lists) finite. The inverse frequencies are rope_theta^(-2i/d) / factor: below 1 either
        makes them grow instead of fall (1e-300 overflowed them, and every logit was NaN; transformers itself only
        warns about a factor below 1), a NaN makes every one NaN; an unknown rope_type was a KeyError and an
        original_max_position_embeddings of 0 a ZeroDivisionError when the model was built."""
        rope = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        rope_types = ("default", *ROPE_INIT_FUNCTIONS)
        rope_type = rope.get("rope_type", "default")
        if rope_type not in rope_types:
            raise ValueError(f"rope_parameters['rope_type'] must be one of {', '.join(rope_types)}, got "
                             f"{rope['rope_type']!r}")
        for key, value in rope.items():
            field = f"rope_parameters[{key!r}]"
            if key in ("rope_theta", "factor"):
                _check_range(field, value, 1, math.inf, ">= 1 and finite")
            elif key == "original_max_position_embeddings":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{field} must be a positive integer, got {value!r}")
            elif key == "partial_rotary_factor":
                _check_range(field, value, 0, 1, "in (0, 1]", low_open=True)
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    _check_range(f"{field}[{i}]", item, -math.inf, math.inf, "a finite number")
            elif isinstance(value, float):
                _check_range(field, value, -math.inf, math.inf, "a finite number")
        self._check_rotated_width(rope, rope_type)

    def _check_rotated_width(self, rope: dict, rope_type: str) -> None:
        """Every query and key head is rotated whole (Llama's RoPE: rotate-half over head_dim). The scaled RoPE types
        compute int(head_dim * partial_rotary_factor) frequencies (Llama's own default ignores the factor), and
        LongRoPE scales them by its lists: fewer than head_dim / 2 of either was a bare shape error in the first
        forward or when the model was built (transformers only warns)."""
        if rope_type == "default":
            return
        factor = rope.get("partial_rotary_factor", 1.0)
        if isinstance(factor, (int, float)) and int(self.head_dim * factor) != self.head_dim:
            raise ValueError(f"rope_parameters['partial_rotary_factor'] must be 1 with rope_type {rope_type!r}: every "
                             f"head is rotated whole (head_dim {self.head_dim}), got {factor!r}")
        for key in ("short_factor", "long_factor"):
            value = rope.get(key)
            if rope_type == "longrope" and isinstance(value, (list, tuple)) and len(value) != self.head_dim // 2:
                raise ValueError(f"rope_parameters[{key!r}] must hold head_dim / 2 = {self.head_dim // 2} factors, "
                                 f"got {len(value)}")


# The dtypes of a model's weights: torch's matmuls take float8 only through scaled kernels.
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_dtype(field: str, value) -> None:
    """The dtype of the saved weights (`dtype`, or its legacy name `torch_dtype`), which `from_pretrained(dtype="auto")`
    loads them in: None, or a torch dtype that the model computes in, or its name. An integer one (`"int8"`) was saved
    and the output did not load, a float8 one failed in `from_pretrained`; an unknown name was an AttributeError
    inside transformers."""
    if value is None:
        return
    resolved = getattr(torch, value, None) if isinstance(value, str) else value
    if resolved not in COMPUTE_DTYPES:
        raise ValueError(f"{field} must be a floating-point torch dtype the model computes in (float32, bfloat16, "
                         f"float16 or float64), got {str(value)!r}")


def _check_range(field: str, value, low: float, high: float, rule: str, low_open=False, high_open=False) -> None:
    """`field` must be a finite real number (not a bool) between `low` and `high` (`rule` says it in words)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or value < low or value > high or (low_open and value == low) or (
        high_open and value == high
    ):
        raise ValueError(f"{field} must be {rule}, got {value!r}")


__all__ = ["DiffLlamaConfig", "DIFF_MODES"]
