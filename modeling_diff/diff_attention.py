"""The three attention variants of modeling_diff: V1, V2 and DEX.

Each module takes `(hidden_states, position_embeddings, attention_mask, cache)` like transformers'
`LlamaAttention`, projects, applies RoPE, updates the cache through `Cache.update`, and computes softmax
attention through transformers' attention interface (`config._attn_implementation`: eager, sdpa,
flex_attention, flash_attention_2, or a kernel registered by `modeling_diff.kernels`). It returns
`(output, attention_maps)`; with eager attention the maps are the *differential* maps.

Shapes: B batch, L new tokens, S cached + new tokens, h = num_attention_heads, h_kv = num_key_value_heads,
d = head_dim.
"""

import abc
import math
import sys
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, eager_attention_forward, repeat_kv
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging

from .configuration import DiffLlamaConfig
from .kernels import (
    DIFF_TRITON, FUSED_DIFF, DexCombine, V1Combine, V2Combine, apply_rope, combined_decode_applies,
    combined_decode_attention, dex_folded_projection, dex_folded_projection_applies, dex_folded_weight,
    differential_lambda, flash_attn_4_applies, flash_diff_applies, flash_diff_attention, has_extra_options,
    is_plain_linear, is_plain_norm, keep_own_forward, linear_maps, mark_written, needs_grad, projection_cache_layer,
    resolve, rotated_projections, rotated_projections_apply, runs_own_forward, split_linear, split_linear_applies,
    update_cache, uses_fast_kernels, v1_combine, v2_combine_projected, written_layer,
)

logger = logging.get_logger(__name__)


def depth_lambda_init(layer_idx: int) -> float:
    """lambda_init of layer l (from 0): 0.8 - 0.6 exp(-0.3 l). DIFF Transformer (arXiv 2410.05258), Sec. 2.1."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def layer_lambda_init(config: DiffLlamaConfig, layer_idx: int) -> float:
    return config.lambda_init if config.lambda_init is not None else depth_lambda_init(layer_idx)


def anneal_fraction(anneal_step: torch.Tensor, anneal_steps: int) -> torch.Tensor | None:
    """t / T as a float32 scalar tensor (t the integer `AnnealingStep` buffer); None when annealing is off (T = 0),
    where the schedule's factor is 1 and its arithmetic is left out (a few launches a layer: host work in training)."""
    if anneal_steps == 0:
        return None
    return anneal_step.float() / anneal_steps


class AnnealingStep(nn.Module):
    """The step t of the annealing schedule (V2's noise factor, DEX's lambda(t)), one per attention, in its `step`
    buffer: an integer, so that no dtype cast of the model (`.to(bfloat16)`, mixed precision) rounds it (a bfloat16
    257 would be 256). A module of its own so that PEFT's `modules_to_save` (`lora_config()` lists `annealing`) gives
    each adapter its own t and saves it with the adapter: t of the base model's buffer was not in an adapter folder,
    so `PeftModel.from_pretrained(base, folder)` computed the schedule at the base's t, and the base model with the
    adapter disabled (TRL's reference model) moved with training."""

    def __init__(self):
        super().__init__()
        self.step = nn.Buffer(torch.zeros((), dtype=torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's loading path (PEFT adapter files, Trainer's resume): t checked as `from_pretrained` checks it
        if prefix + "step" in state_dict:
            check_loaded_anneal_step(prefix + "step", state_dict[prefix + "step"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# Annealing steps t stop here: far beyond any training, and an int64 that counts on from it never wraps.
MAX_ANNEAL_STEP = 2**62


def check_loaded_anneal_step(name: str, step: torch.Tensor) -> None:
    """A ValueError naming the tensor unless a loaded t, read as the int64 buffer reads it, lies in [0,
    MAX_ANNEAL_STEP). A crafted or corrupt checkpoint's NaN or inf became -2**63 as an integer, and lambda -1.7e33
    made every logit 0, silently."""
    if step.device.type == "meta":
        return
    value = int(step.to(torch.int64))
    if not 0 <= value < MAX_ANNEAL_STEP:
        raise ValueError(f"{name} is {value} in the checkpoint: the annealing step t must be a whole number of "
                         f"optimizer steps in [0, 2**62) (NaN and inf read as -2**63)")


# The V2 / DEX attentions with annealing on (anneal_steps > 0). t advances by itself: after every optimizer step
# that updates their model (any optimizer, any training loop: Trainer, TRL, accelerate, a custom loop), t of every
# annealed attention of that model grows by one, so that t = the training steps taken. A step skipped by a gradient
# scaler calls no `step()` and does not count. `AnnealingCallback` also pins t to Trainer's global step (and logs
# the schedule). The models that hold them (`register_annealed_model`, from the models' post_init) are the unit that
# counts: an optimizer over some of a model's parameters (the embeddings, the MLPs, one layer) advanced only the
# attentions whose own parameters it held, so the layers fell out of step, and prompt or prefix tuning (PEFT's
# encoder lies outside the model, which it freezes) advanced none, so the differential term never turned on.
# t counts training steps, not `step()` calls: a training step is a round of optimizer steps over the model in which
# no optimizer steps twice (`_starts_a_training_step`), so that Muon for the matrices beside AdamW for the rest, or
# one optimizer a parameter stepped in the backward (transformers' layerwise optimizers), count one step, as
# Trainer's global step does; they advanced t two or hundreds of times a step, and the schedule ended that early.
_ANNEALED_ATTENTIONS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_ANNEALED_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_ROUNDS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def register_annealed_model(model: nn.Module) -> None:
    """Count optimizer steps for `model` as a whole where it holds annealed attentions (called by post_init). A
    model built inside it (the DiffLlamaModel of a DiffLlamaForCausalLM, whose post_init ran first) is its part."""
    if any(module in _ANNEALED_ATTENTIONS for module in model.modules()):
        _ANNEALED_MODELS.difference_update(model.modules())
        _ANNEALED_MODELS.add(model)


def _parameters_of_outer_steps() -> set[int] | None:
    """For the optimizer step whose post-hook runs (`_advance_annealing`, called by torch's step wrapper): the ids of
    the parameters of the optimizers whose steps enclose it, which count the step themselves when they end (torch's
    ZeroRedundancyOptimizer steps the optimizer of its rank's shard inside its own step: t advanced twice, and once
    only on a rank whose shard held none of a layer's parameters, so the ranks computed different forwards). None
    for torch.distributed.checkpoint's initialisation of an empty optimizer before it loads a saved state
    (`_init_optim_state`: zero gradients at lr 0), which is no training step."""
    frame = sys._getframe(2)  # this <- _advance_annealing <- the step wrapper
    step_wrapper, frame, depth, outer = frame.f_code, frame.f_back, 0, set()
    while frame is not None:
        if frame.f_code is step_wrapper:  # an enclosing step; the wrapper's first argument is its optimizer
            optimizer = frame.f_locals.get("self")
            outer.update(id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"])
        elif depth < 4 and frame.f_code.co_name == "_init_optim_state" and "torch.distributed.checkpoint" in (
                frame.f_globals.get("__name__", "")):
            return None
        frame, depth = frame.f_back, depth + 1
    return outer


def _step_counts_for(owner: nn.Module, stepped: set[int], outer: set) -> bool:
    """Whether an optimizer step over the parameters `stepped`, inside the steps over `outer`, is a training step of
    `owner`: it holds one of owner's parameters and no enclosing step does (that one counts it); or owner is in
    training mode with every parameter frozen and no step encloses this one (torch refuses an optimizer of no
    parameters, so `outer` is empty only then): what trains is outside it (PEFT's prompt or prefix encoder), so every
    optimizer step is one of its training steps."""
    parameters = list(owner.parameters())
    ids = {id(p) for p in parameters}
    if ids & stepped:
        return not ids & outer
    return owner.training and not outer and not any(p.requires_grad for p in parameters)


def _starts_a_training_step(owner: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of `optimizer` that counts for `owner` begins one of its training steps: the first step of a
    round (`_ROUNDS[owner]`, the optimizers that stepped owner since its t last advanced), or a second step of an
    optimizer already in it, which begins the next round. A step of another optimizer joins the round."""
    round_ = _ROUNDS.setdefault(owner, weakref.WeakSet())
    starts = not round_ or optimizer in round_
    if starts:
        round_.clear()
    round_.add(optimizer)
    return starts


def _advance_annealing(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _ANNEALED_ATTENTIONS:
        return
    outer = _parameters_of_outer_steps()
    if outer is None:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pending = set(_ANNEALED_ATTENTIONS)
    owners = []
    for owner in list(_ANNEALED_MODELS):
        attentions = [module for module in owner.modules() if module in pending]
        pending.difference_update(attentions)
        owners.append((owner, attentions))
    # Attentions outside any registered model (built on their own) count for themselves.
    owners += [(module, [module]) for module in pending]
    for owner, attentions in owners:
        if attentions and _step_counts_for(owner, stepped, outer) and _starts_a_training_step(owner, optimizer):
            _advance(attentions)


def _advance(attentions: list[nn.Module]) -> None:
    with torch.no_grad():
        for module in attentions:
            module.anneal_step.add_(1)


register_optimizer_step_post_hook(_advance_annealing)


def differential_maps_output(maps: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Eager path: the head outputs computed from the differential maps themselves, (B, h, L, S) @ V -> (B, L, h, D),
    so that the maps returned with `output_attentions=True` are in the autograd graph of the output. Equal to the
    combine of the two maps' outputs: A1 V - lambda A2 V = (A1 - lambda A2) V. Head i reads kv head i // (h / h_kv)."""
    return torch.matmul(maps, repeat_kv(value, maps.shape[1] // value.shape[1])).transpose(1, 2)


class DifferentialLambda(nn.Module):
    """V1's re-parameterised lambda (arXiv 2410.05258, Eq. 2), one per layer:
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init.

    A module of its own so that tools that name modules reach the four vectors: PEFT's `modules_to_save`, and the
    tensor-parallel plan, which all-reduces their gradients (each rank's heads contribute a share). The vectors are
    in the model's dtype (FSDP2 wants one dtype); the arithmetic is float32 (`kernels.differential_lambda`: one
    launch forward and one backward where the kernels run)."""

    def __init__(self, head_dim: int, lambda_init: float, std_dev: float):
        super().__init__()
        self.lambda_init = lambda_init
        self.lambda_q1 = nn.Parameter(torch.empty(head_dim).normal_(0.0, std_dev))
        self.lambda_k1 = nn.Parameter(torch.empty(head_dim).normal_(0.0, std_dev))
        self.lambda_q2 = nn.Parameter(torch.empty(head_dim).normal_(0.0, std_dev))
        self.lambda_k2 = nn.Parameter(torch.empty(head_dim).normal_(0.0, std_dev))

    def vectors(self) -> tuple[torch.Tensor, ...]:
        return self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2

    def forward(self) -> torch.Tensor:
        """The layer's lambda, a float32 scalar."""
        return differential_lambda(self.vectors(), self.lambda_init)


class DexLambda(nn.Module):
    """DEX's lambda (arXiv 2505.16333), one per layer: lambda(t) = (1 - a) (t/T) lambda_init + a lambda_learn,
    a = min(1, t/T) (lambda_learn alone when T = 0); `per_head` puts it on the selected heads and 0 on the others.

    A module of its own for the same reasons as `DifferentialLambda`. `lambda_learn` is a 1-element vector (FSDP2
    refuses scalars) in the model's dtype; the arithmetic is float32. Under tensor parallelism each rank holds
    its slice of the heads: `head_slice` (set by the plan's `dex_head_slice` style) selects its part of the mask."""

    def __init__(self, lambda_init: float, num_heads: int):
        super().__init__()
        self.lambda_init = lambda_init
        self.num_heads = num_heads
        self.lambda_learn = nn.Parameter(torch.full((1,), lambda_init))
        self.head_slice = slice(None)  # this rank's heads (all of them outside tensor parallelism)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's loading path (PEFT adapter files): lambda_learn was a scalar before FSDP2 support
        # (transformers' `from_pretrained` converts it through the mapping in modeling_diff_llama.py).
        key = prefix + "lambda_learn"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, t_over_T: torch.Tensor | None) -> torch.Tensor:
        """The layer's lambda(t), a float32 tensor of shape (1,); lambda_learn where annealing is off (t_over_T None,
        `anneal_fraction`), exactly what the formula gives at a = 1."""
        if t_over_T is None:
            return self.lambda_learn.float()
        a = t_over_T.clamp(max=1.0)
        return (1 - a) * t_over_T * self.lambda_init + a * self.lambda_learn.float()

    def per_head(self, t_over_T: torch.Tensor | None, head_mask: torch.Tensor) -> torch.Tensor:
        """lambda(t) on this rank's selected heads (head_mask (h,): 1.0 where selected), 0 elsewhere: (h_local,)."""
        return self(t_over_T) * head_mask[self.head_slice].float()  # a call: its hooks run (tensor parallelism's)


# Where the differential parameters and the annealing step were saved before they had modules of their own (PEFT's
# `modules_to_save` and the tensor-parallel plan name modules): old name under `self_attn.` -> current one. DEX's
# lambda_learn was a scalar then; it is a 1-element vector now (FSDP2 refuses scalars). transformers' `from_pretrained`
# and PEFT's adapter loading map them (`modeling_diff_llama.py`), torch's loading path here.
LEGACY_ATTENTION_NAMES = {
    **{name: f"diff_lambda.{name}" for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")},
    "lambda_learn": "dex_lambda.lambda_learn",
    "anneal_step": "annealing.step",
}


class _DiffAttentionBase(nn.Module, metaclass=abc.ABCMeta):
    """What the three variants share: sizes, scaling, dropout and the choice of attention implementation."""

    # Where `diff_triton` (what `sdpa` is on CUDA) takes the flash-diff kernel: up to `flash_diff_max_keys` keys, and
    # at every length where autograd records the attention (a backward follows) if `flash_diff_with_gradients`; where
    # it measured faster than the one SDPA call plus the fused combine on the H200 (benchmarks/RESULTS.md).
    # `fused_diff` always does.
    flash_diff_max_keys: float = 0
    flash_diff_with_gradients: bool = False
    # Whether, under `diff_triton`, a call that FlashAttention-4 takes (`kernels/flash_attn_4.py`: the package
    # installed, plain causal self-attention) goes there, with the combine after it, instead of the flash-diff kernel.
    flash_attn_4_over_flash_diff: bool = False
    # The columns of q_proj and k_proj that must stay on one rank, in head_dim units, and what they are: a rank that
    # holds part of one (tensor parallelism over ranks that do not divide the kv heads, or transformers' unit_colwise
    # plan splitting a head in head_dim units) cannot compute its heads.
    whole_head_widths = (1, 1)
    whole_heads = "a query head and a kv head"

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # torch's loading path (Trainer's resume, `load_state_dict`): a checkpoint of `LEGACY_ATTENTION_NAMES` lost
        # those tensors (unexpected keys), and t and lambda kept the model's values
        for old, new in LEGACY_ATTENTION_NAMES.items():
            if prefix + old in state_dict:
                state_dict.setdefault(prefix + new, state_dict.pop(prefix + old))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def implementation(self, hidden_states: torch.Tensor, kwargs: dict) -> str:
        """The attention implementation of this call (`sdpa` on CUDA -> `diff_triton`). Read once per forward:
        a config attribute costs microseconds, and decoding steps are bound by host work."""
        implementation = resolve(self.config._attn_implementation, hidden_states)
        if kwargs.get("output_attentions") and uses_fast_kernels(implementation):
            # as transformers' sdpa says it: the kernels return no maps, on every path (decode, flash-diff, FA4)
            logger.warning_once(
                f"`{implementation}` attention (what `sdpa` runs on CUDA) does not support `output_attentions=True`."
                " Please set your attention to `eager` if you want the differential maps."
            )
        return implementation

    def attention_interface(self, implementation: str) -> Callable:
        return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)

    def dropout_p(self) -> float:
        return self.attention_dropout if self.training else 0.0

    def project_and_rotate(self, implementation, hidden_states, position_embeddings, *linears, cache=None):
        """(q, k, v, *side) = each of `linears` (q_proj, k_proj, v_proj, side layers) of hidden_states (B, L, .),
        (B, L, N_i) each, with RoPE on every d-wide head of q and k. In a decoding step of at most 32 tokens the
        products split along their input, summed and q and k rotated in the same launch (`kernels/projection.py`),
        which also stores k and v into a StaticCache layer of `cache` (`kernels/cache_write.py`: `decode_heads`
        then takes the layer as it is); else the products in one launch (decoding steps) or each layer's forward,
        then RoPE."""
        cos, sin = position_embeddings  # (B or 1, L, d)
        fused = uses_fast_kernels(implementation)
        if fused and rotated_projections_apply(hidden_states, linears, cos, sin, self.head_dim):
            layer = projection_cache_layer(
                cache, self.layer_idx, hidden_states, linears[1].out_features, linears[2].out_features
            )
            into = None if layer is None else (layer.keys, layer.values, layer.cumulative_length)
            outputs = rotated_projections(hidden_states, linears, cos, sin, self.head_dim, into)
            if layer is not None:
                mark_written(layer, outputs[1])
            return outputs
        query, key, value, *side = linear_maps(hidden_states, *linears, fused=fused)
        self.check_whole_heads(query.shape[-1], key.shape[-1])
        heads = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key = apply_rope(query.view(heads), key.view(heads), cos, sin, fused)
        return query.flatten(-2), key.flatten(-2), value, *side

    def check_whole_heads(self, query_columns: int, key_columns: int) -> None:
        """The q_proj and k_proj outputs this rank computes must be whole heads (`whole_head_widths`)."""
        query_width, key_width = (width * self.head_dim for width in self.whole_head_widths)
        if query_columns % query_width or key_columns % key_width:
            raise ValueError(
                f"{type(self).__name__}: q_proj and k_proj give {query_columns} and {key_columns} columns here, which "
                f"must be whole heads of {query_width} and {key_width} columns ({self.whole_heads}): under tensor "
                f"parallelism the ranks must divide num_key_value_heads ({self.num_key_value_heads}), and a plan "
                f"that splits a head in head_dim units (transformers' unit_colwise) is not supported"
            )

    def flash_diff_applies(self, implementation, pairs, key, value, attention_mask, kwargs) -> bool:
        """Whether both maps and the combine go to the fused flash-diff kernel (`kernels/flash_diff.py`):
        `fused_diff`, or `diff_triton` up to the mode's `flash_diff_max_keys` (at every length where gradients are
        recorded, if the mode's `flash_diff_with_gradients`: not by the module's training mode, which a model built
        from its config is in for inference too); no extra attention options; shapes it covers."""
        keys_taken = key.shape[-2] <= self.flash_diff_max_keys or (
            self.flash_diff_with_gradients and needs_grad(pairs, key, value)
        )
        if implementation == DIFF_TRITON and self.flash_attn_4_over_flash_diff and flash_attn_4_applies(
            pairs.flatten(2, 3).transpose(1, 2), key, value, attention_mask, self.dropout_p()
        ):  # (B, L, h, 2, d) -> (B, 2h, L, d), the attention call's query
            return False
        return (
            (implementation == FUSED_DIFF or (implementation == DIFF_TRITON and keys_taken))
            and not has_extra_options(kwargs)
            and flash_diff_applies(pairs, key, value, attention_mask, self.dropout_p())
        )

    # A decoding step of a module's forward is `project` (the projections and RoPE: what the cache takes),
    # `decode_heads` (the cache updated, the heads' outputs from the decode kernel) and `output` (o_proj); everything
    # else (prefill, training, other backends) updates the cache and takes the general path. The piecewise decoding
    # graphs (`modeling_diff/decode_graphs.py`) call the same three, with `decode_heads` outside the graphs.

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs (B, L, h, dv) of a decoding step -> (B, L, hidden), split along its input
        where the kernel takes it (`kernels/projection.py`)."""
        heads = heads.flatten(2)
        if split_linear_applies(heads, self.o_proj):
            return split_linear(heads, self.o_proj)
        return self.o_proj(heads)

    def decode_applies(self, implementation, query, key, value, attention_mask, kwargs) -> bool:
        """Whether `decode_heads` takes this step; query, key and value as `project` gives them (the new tokens')."""
        return self.combined_decode_applies(
            implementation, self.decode_query(query), key, value, attention_mask, kwargs
        )

    def decode_query(self, query: torch.Tensor) -> torch.Tensor:
        """`project`'s query as the decode kernel reads it, (B, Hq, L, d)."""
        return query

    @abc.abstractmethod
    def decode_combine(self, side):
        """The mode's differential term for the decode kernel's reduce (V1Combine, V2Combine or DexCombine); side as
        `project` gives it. Each mode defines it."""

    def decode_heads(self, implementation, query, key, value, side, attention_mask, cache, kwargs, out=None):
        """A decoding step through the decode kernel, the mode's differential term in its reduce
        (`decode_combine`): the cache updated, -> the heads' outputs (B, L, h, dv) before o_proj (in `out` where
        given); None, the cache untouched, where it does not apply. Inputs as `project` gives them."""
        if not self.decode_applies(implementation, query, key, value, attention_mask, kwargs):
            return None
        advance = None
        if cache is not None:
            layer = written_layer(cache, self.layer_idx, key)
            if layer is not None:  # the projections stored key and value into it; the decode kernel advances it
                key, value, advance = layer.keys, layer.values, layer.cumulative_length
            else:
                key, value = update_cache(cache, self.layer_idx, key, value, kwargs)  # one launch into a StaticCache
        return combined_decode_attention(
            self.decode_query(query), key, value, attention_mask, self.scaling, self.decode_combine(side), out, advance
        )

    def combined_decode_applies(self, implementation, query, key, value, attention_mask, kwargs) -> bool:
        """Whether a decoding step goes to the split-KV kernel with the differential term in its reduce
        (`kernels/decode.py`): on the project's implementations, no extra attention options, shapes it covers.
        query (B, Hq, L, d) as the attention call takes it."""
        return (
            uses_fast_kernels(implementation)
            and not has_extra_options(kwargs)
            and combined_decode_applies(query, key, value, attention_mask, self.dropout_p())
        )


class SublnRMSNorm(LlamaRMSNorm):
    """V1's per-head norm (subln): transformers' LlamaRMSNorm, not taken by its Hub kernelization
    (`kernels.keep_own_forward`), since the flash-diff and decode kernels read its weight where it runs its own
    forward."""

    kernel_condition = staticmethod(keep_own_forward)


class DiffAttentionV1(_DiffAttentionBase):
    """DIFF Transformer V1 (arXiv 2410.05258, Eq. 1-3; layout of unilm `multihead_flashdiff_1.py`).

    out = o_proj((1 - lambda_init) * subln(softmax(Q1 K1^T s) V - lambda * softmax(Q2 K2^T s) V)), s = 1/sqrt(d),
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init.

    Both maps come from ONE attention call of 2h query heads of width 2d against the cached K = K1|K2:
    query head 2i is [Q1_i, 0] and 2i+1 is [0, Q2_i], so [Q1, 0] . [K1, K2] = Q1 . K1 and [0, Q2] . [K1, K2] =
    Q2 . K2. Every backend then sees equal query, key and value widths (FlashAttention accepts it), reads
    K and V once for both maps, and the pair shares a GQA group like V2's. On CUDA the flash-diff kernel
    replaces that call and the combine: both maps per tile at d-wide Q.K, the combine in its epilogue; in a
    decoding step the decode kernel does, reading Q1 and Q2 as they are (`decode_heads`).
    """

    flash_diff_max_keys = math.inf
    whole_head_widths = (2, 2)
    whole_heads = "a differential head, Q1|Q2, and a kv head, K1|K2"

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d = self.head_dim
        # Differential head i reads kv head i // (h / h_kv); as the attention call sees it, query heads 2i and 2i+1
        # (its two maps) read kv head j // (2h / h_kv).
        self.num_key_value_groups = 2 * self.num_heads // self.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * 2 * d, bias=bias)  # (h, 2, d): Q1, Q2
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * 2 * d, bias=bias)  # (h_kv, 2, d)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * 2 * d, bias=bias)  # (h_kv, 2d)
        self.o_proj = nn.Linear(self.num_heads * 2 * d, config.hidden_size, bias=bias)
        self.lambda_init = layer_lambda_init(config, layer_idx)
        # lambda_q1 .. lambda_k2 ~ N(0, lambda_std_dev); DiffLlamaPreTrainedModel._init_weights draws them again
        # when a model is built on the meta device.
        self.diff_lambda = DifferentialLambda(d, self.lambda_init, config.lambda_std_dev)
        self.subln = SublnRMSNorm(2 * d, eps=config.rms_norm_eps)  # one norm shared by all heads

    def project(self, implementation, hidden_states, position_embeddings, cache=None):
        """-> pairs (B, L, h, 2, d) = (Q1, Q2) of each head, key (B, h_kv, L, 2d) = K1|K2 and value (B, h_kv, L, 2d),
        RoPE applied, and no side outputs (V1 has none). The cache holds K and V as they are: a Llama's bytes per
        token. `cache`: where a decoding step's projections may store them (`project_and_rotate`)."""
        input_shape = hidden_states.shape[:-1]  # (B, L)
        d = self.head_dim
        # the same rotation for every d-wide head: Q1, Q2, K1 and K2 alike
        query_states, key_states, value_states = self.project_and_rotate(
            implementation, hidden_states, position_embeddings, self.q_proj, self.k_proj, self.v_proj, cache=cache
        )
        query_states = query_states.view(*input_shape, -1, 2, d)  # (B, L, h, 2, d): (Q1, Q2) per head
        key_states = key_states.view(*input_shape, -1, 2 * d).transpose(1, 2)  # (B, h_kv, L, 2d): K1|K2
        value_states = value_states.view(*input_shape, -1, 2 * d).transpose(1, 2)  # (B, h_kv, L, 2d)
        return query_states, key_states, value_states, ()

    def check_cache_width(self, cache) -> None:
        """Before the cache update: a ValueError if the cache was made with keys of another width than V1's K1|K2,
        2 x head_dim. Caches sized from config.head_dim do not fit, and failed inside torch (a size mismatch in
        torch.cat, or index_copy_ while torch.export traced): transformers' ExecuTorch export
        (`TorchExportableModuleForDecoderOnlyLM`, `convert_and_export_with_cache`) makes its StaticCache so, and PEFT's
        prefix tuning its prefix. The caches that transformers' generate makes take their width from the first
        update, and fit."""
        layers = getattr(cache, "layers", ())
        keys = getattr(layers[self.layer_idx], "keys", None) if self.layer_idx < len(layers) else None
        if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-1] != 2 * self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx}'s cache holds keys {keys.shape[-1]} wide: V1 caches keys and values "
                f"2 x head_dim = {2 * self.head_dim} wide (K1|K2), so a cache sized by config.head_dim does not fit "
                f"(transformers' ExecuTorch export sizes its StaticCache so, and PEFT's prefix tuning its prefix: "
                f"with V1, export with a dynamic cache, and use LoRA or prompt tuning)"
            )

    def decode_applies(self, implementation, pairs, key, value, attention_mask, kwargs) -> bool:
        """subln plain and lambda's module unhooked (the kernel reads subln's weight and lambda's vectors in place of
        calling them), the decode kernel's shapes, and not flash-diff's (which goes first where it applies)."""
        return (
            is_plain_norm(self.subln)
            and runs_own_forward(self.diff_lambda)
            and super().decode_applies(implementation, pairs, key, value, attention_mask, kwargs)
            and not self.flash_diff_applies(implementation, pairs, key, value, attention_mask, kwargs)
        )

    def decode_query(self, pairs: torch.Tensor) -> torch.Tensor:
        return pairs.flatten(2, 3).transpose(1, 2)  # (B, 2h, L, d): heads 2i, 2i+1 = Q1, Q2 of head i

    def decode_combine(self, side) -> V1Combine:
        return V1Combine(
            self.diff_lambda.vectors(), self.lambda_init, self.subln.weight, self.subln.variance_epsilon,
            1 - self.lambda_init,
        )

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs: Unpack[TransformersKwargs]
    ):
        input_shape = hidden_states.shape[:-1]  # (B, L)
        implementation = self.implementation(hidden_states, kwargs)
        if cache is not None:  # before the projections and the decode kernel, which may write the cache
            self.check_cache_width(cache)
        query_states, key_states, value_states, _ = self.project(
            implementation, hidden_states, position_embeddings, cache
        )
        heads = self.decode_heads(
            implementation, query_states, key_states, value_states, (), attention_mask, cache, kwargs
        )
        if heads is not None:  # (B, L, h, 2d), combined
            return self.output(heads), None
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        if is_plain_norm(self.subln) and self.flash_diff_applies(
            implementation, query_states, key_states, value_states, attention_mask, kwargs
        ):  # both maps and the combine in one kernel, o_proj in its autograd node: (B, L, hidden)
            attn_output = flash_diff_attention(
                query_states, key_states, value_states, attention_mask, self.diff_lambda(), self.scaling,
                self.subln, 1 - self.lambda_init, o_proj=self.o_proj,
            )
            return attn_output, None

        # (B, L, h, 2, d) -> (B, L, h, 2, 2d): [Q1, 0] and [0, Q2] -> (B, 2h, L, 2d)
        halves = torch.eye(2, dtype=query_states.dtype, device=query_states.device)[:, :, None]  # (2, 2, 1)
        query_states = (query_states.unsqueeze(-2) * halves).flatten(-2).flatten(2, 3).transpose(1, 2)

        attn_output, attn_weights = self.attention_interface(implementation)(
            self, query_states, key_states, value_states, attention_mask,
            dropout=self.dropout_p(), scaling=self.scaling, **kwargs,
        )  # (B, L, 2h, 2d): the pair (A1 V, A2 V) of each differential head
        lam = self.diff_lambda()
        if attn_weights is None:
            attn_output = v1_combine(attn_output, lam, self.subln, 1 - self.lambda_init)  # (B, L, h, 2d)
        else:  # eager: (B, 2h, L, S) -> differential maps (B, h, L, S), and the output from them
            attn_weights = attn_weights[:, 0::2] - lam.to(attn_weights.dtype) * attn_weights[:, 1::2]
            attn_output = self.subln(differential_maps_output(attn_weights, value_states)) * (1 - self.lambda_init)
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1))
        return attn_output, attn_weights


class _LlamaLayoutAttention(_DiffAttentionBase):
    """Llama's projections with `query_heads` query heads of d, h_kv kv heads and h output heads (V2 and DEX),
    RoPE, the cache update and one attention call; and the annealing schedule's step t (`anneal_step`, held by its
    `annealing` module), which the optimizer steps of its model advance where annealing is on
    (`_ANNEALED_ATTENTIONS`, above)."""

    def __init__(self, config: DiffLlamaConfig, layer_idx: int, query_heads: int):
        super().__init__(config, layer_idx)
        d = self.head_dim
        # Query head j reads kv head j // (query_heads / h_kv).
        self.num_key_value_groups = query_heads // self.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, query_heads * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=bias)
        self.annealing = AnnealingStep()
        self._count_optimizer_steps()

    @property
    def anneal_step(self) -> torch.Tensor:
        """t, the int64 scalar of `annealing` (of the active adapter's copy where PEFT's modules_to_save holds it)."""
        return self.annealing.step

    def __setstate__(self, state):
        # A copy (copy.deepcopy, pickle, torch.save and torch.load of the model) runs no __init__: unregistered, its
        # t stayed 0 however long it trained, and the differential term never turned on.
        super().__setstate__(state)
        self._count_optimizer_steps()

    def _count_optimizer_steps(self) -> None:
        if self.config.anneal_steps > 0:
            _ANNEALED_ATTENTIONS.add(self)

    def project(self, implementation, hidden_states, position_embeddings, cache=None, side=()):
        """-> query (B, query_heads, L, d), key and value (B, h_kv, L, d), RoPE applied, and the outputs of the
        `side` layers of the same input (V2's lambda_proj), (B, L, .) each. `cache`: where a decoding step's
        projections may store key and value (`project_and_rotate`)."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states, key_states, value_states, *side_outputs = self.project_and_rotate(
            implementation, hidden_states, position_embeddings, self.q_proj, self.k_proj, self.v_proj, *side,
            cache=cache,
        )
        query_states = query_states.view(hidden_shape).transpose(1, 2)  # (B, query_heads, L, d)
        key_states = key_states.view(hidden_shape).transpose(1, 2)  # (B, h_kv, L, d)
        value_states = value_states.view(hidden_shape).transpose(1, 2)  # (B, h_kv, L, d)
        return query_states, key_states, value_states, side_outputs

    def attend(self, implementation, query_states, key_states, value_states, attention_mask, **kwargs):
        """-> per-head outputs (B, L, query_heads, d) and, with eager, maps (B, query_heads, L, S)."""
        return self.attention_interface(implementation)(
            self, query_states, key_states, value_states, attention_mask,
            dropout=self.dropout_p(), scaling=self.scaling, **kwargs,
        )


class DiffAttentionV2(_LlamaLayoutAttention):
    """DIFF Transformer V2 (unilm `Diff-Transformer-V2/multihead_flashdiffv2.py`).

    2h query heads; heads 2i (signal) and 2i+1 (noise) form pair i and share a GQA group.
    out = o_proj(A[2i] - f * sigmoid(lambda_proj(x))_i * A[2i+1]), f = min(1, t/T) the anneal factor (1 if T = 0).
    """

    # On the H200, flash-diff against one SDPA call (cuDNN) and the fused combine: training at 2K 1.2-1.8% faster
    # (three sessions' runs), and with keys and values through TMA (the forward and dQ kernels) 2.3% at 8K and 1.4%
    # at 32K; a prefill at 2K-32K within 1.3%, and a prefill's 4096-token chunks against 8K-32K keys 7-31% slower
    # (RESULTS.md, "V2's attention by length", "Keys and values through TMA").
    flash_diff_max_keys = 4096
    flash_diff_with_gradients = True
    # Where FlashAttention-4 is installed, its call of the 2h heads and the combine measured faster than the kernel in
    # training on an H100: one layer's step 10% / 17% at 8K / 32K, level at 2K x 4 (RESULTS.md, "FlashAttention-4 for
    # V2 and DEX").
    flash_attn_4_over_flash_diff = True
    whole_head_widths = (2, 1)
    whole_heads = "a pair of signal and noise query heads, and a kv head"

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        # 2h query heads; 2h / h_kv is even, so the pair (2i, 2i+1) never straddles two GQA groups.
        super().__init__(config, layer_idx, query_heads=2 * config.num_attention_heads)
        self.lambda_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

    def noise_weight(self, noise_logits: torch.Tensor) -> torch.Tensor:
        """Per-token, per-pair weight of the noise head from lambda_proj(x) (B, L, h): (B, L, h)."""
        fraction = anneal_fraction(self.anneal_step, self.config.anneal_steps)
        if fraction is None:  # annealing off: f = 1
            return torch.sigmoid(noise_logits)
        return torch.sigmoid(noise_logits) * fraction.clamp(max=1.0).to(noise_logits.dtype)

    def project(self, implementation, hidden_states, position_embeddings, cache=None):
        """Llama's projections and RoPE, and side = (lambda_proj(x) (B, L, h),)."""
        return super().project(implementation, hidden_states, position_embeddings, cache, side=(self.lambda_proj,))

    def decode_combine(self, side) -> V2Combine:
        return V2Combine(side[0], self.anneal_step, self.config.anneal_steps)  # the noise weight from lambda_proj(x)

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs: Unpack[TransformersKwargs]
    ):
        input_shape = hidden_states.shape[:-1]
        implementation = self.implementation(hidden_states, kwargs)
        query_states, key_states, value_states, side = self.project(
            implementation, hidden_states, position_embeddings, cache
        )
        heads = self.decode_heads(
            implementation, query_states, key_states, value_states, side, attention_mask, cache, kwargs
        )
        if heads is not None:  # (B, L, h, d), combined
            return self.output(heads), None
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        weight = self.noise_weight(side[0])  # (B, L, h) from lambda_proj(x)
        # (B, 2h, L, d) -> (B, L, h, 2, d): the pair (signal, noise) of each differential head
        pairs = query_states.unflatten(1, (-1, 2)).permute(0, 3, 1, 2, 4)
        if self.flash_diff_applies(implementation, pairs, key_states, value_states, attention_mask, kwargs):
            attn_output = flash_diff_attention(
                pairs, key_states, value_states, attention_mask, weight, self.scaling, o_proj=self.o_proj
            )  # (B, L, hidden): combined and projected
            return attn_output, None

        attn_output, attn_weights = self.attend(
            implementation, query_states, key_states, value_states, attention_mask, **kwargs
        )  # (B, L, 2h, d)
        if attn_weights is None:  # (B, L, 2h, d) -> (B, L, h, d) -> o_proj
            return v2_combine_projected(attn_output, weight, self.o_proj), None
        # eager: (B, 2h, L, S) -> differential maps (B, h, L, S), and the output from them
        attn_weights = attn_weights[:, 0::2] - weight.transpose(1, 2)[..., None] * attn_weights[:, 1::2]
        attn_output = differential_maps_output(attn_weights, value_states)
        return self.o_proj(attn_output.reshape(*input_shape, -1)), attn_weights


class DexAttention(_LlamaLayoutAttention):
    """DEX (Kong, Jang, Kwak, arXiv 2505.16333): Llama attention; on the selected heads the output O of a head
    becomes O - lambda(t) * f_D(O), f_D a d x d map shared by the layer's heads (zero at conversion), and
    lambda(t) = (1 - a) (t/T) lambda_init + a lambda_learn, a = min(1, t/T) (lambda_learn alone when T = 0).
    """

    def __init__(self, config: DiffLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx, query_heads=config.num_attention_heads)
        d = self.head_dim
        self.lambda_init = layer_lambda_init(config, layer_idx)
        self.dex_proj = nn.Linear(d, d, bias=False)  # f_D, zero: a fresh DEX layer computes Llama attention
        nn.init.zeros_(self.dex_proj.weight)
        self.dex_lambda = DexLambda(self.lambda_init, self.num_heads)
        # (h,) 1.0 on the heads that carry the operator; derived from config.dex_heads, so not saved.
        self.head_mask = nn.Buffer(self.selected_head_mask(), persistent=False)

    def selected_head_mask(self) -> torch.Tensor:
        heads = self.config.dex_heads[self.layer_idx] if self.config.dex_heads is not None else range(self.num_heads)
        mask = torch.zeros(self.num_heads, dtype=torch.float32)
        mask[list(heads)] = 1.0
        return mask

    def current_lambda(self) -> torch.Tensor:
        """The layer's lambda(t) at the stored step t, float32 of shape (1,)."""
        return self.dex_lambda(anneal_fraction(self.anneal_step, self.config.anneal_steps))

    def operator_folds_into_o_proj(self, attn_output: torch.Tensor) -> bool:
        """Whether `o_proj_with_operator` applies: o_proj a plain Linear, folding costs fewer FLOPs than applying
        the operator to O (hidden x h x d x d against tokens x h x d x d: more tokens than o_proj has rows), and the
        fold computes what `forward` would: f_D its weight (`operator_is_its_weight`), or every head selected, where
        `forward` too applies f_D(I). With some heads selected `forward` calls f_D on O, so a hook on f_D (or an
        adapter's dropout) sees O, not I."""
        tokens = attn_output.numel() // (attn_output.shape[-2] * attn_output.shape[-1])
        return (is_plain_linear(self.o_proj) and tokens > self.o_proj.out_features
                and (self.config.dex_heads is None or self.operator_is_its_weight()))

    def operator(self, x: torch.Tensor) -> torch.Tensor:
        """f_D(x) through the module, so that PEFT's trained copy or adapter and the tensor-parallel hooks apply.
        PEFT's DoRA scales its layer by magnitude / ||W + BA||: on f_D where it is still zero (at conversion, so that
        the model computes its source's attention) that is 0 / 0, and every output was NaN from the first step."""
        use_dora = getattr(self.dex_proj, "use_dora", None)
        if (isinstance(use_dora, dict) and any(use_dora.get(name) for name in self.dex_proj.active_adapters)
                and not self.dex_proj.get_base_layer().weight.any()):
            raise ValueError("DoRA on dex_proj (f_D) divides by the norm of its weight, which is zero where DEX starts: "
                             "every output would be NaN. Train f_D in full (PEFT's modules_to_save, as "
                             "modeling_diff.lora.lora_config does) or leave it out of target_modules "
                             "(exclude_modules=['dex_proj'])")
        return self.dex_proj(x)

    def o_proj_with_operator(self, attn_output: torch.Tensor) -> torch.Tensor:
        """o_proj(O - lambda_h f_D(O)) as one linear map of O (..., h * d). o_proj reads head h's output through its
        columns W_h (hidden, d), and f_D is linear, f_D(O_h) = O_h F with F = f_D(I) (d, d):
        (O_h - lambda_h O_h F) W_h^T = O_h (W_h - W_h (lambda_h F)^T)^T. So training keeps no copy of the
        operator's output for o_proj's backward: o_proj reads the attention's output, which the attention keeps
        anyway. The folded weight is made in o_proj's own layout: with lambda(t), in one launch (its gradients in
        two), where f_D is a plain Linear and lambda's module has no hooks (`kernels.combine.dex_folded_projection`);
        else through the modules (PEFT's copies and adapters, hooks) and `kernels.combine.dex_folded_weight`."""
        if is_plain_linear(self.dex_proj) and runs_own_forward(self.dex_lambda):
            combine = self.decode_combine(())
            if dex_folded_projection_applies(self.o_proj.weight, combine):
                return F.linear(attn_output, dex_folded_projection(self.o_proj.weight, combine), self.o_proj.bias)
        eye = torch.eye(self.head_dim, dtype=attn_output.dtype, device=attn_output.device)
        t_over_T = anneal_fraction(self.anneal_step, self.config.anneal_steps)
        head_lambda = self.dex_lambda.per_head(t_over_T, self.head_mask).to(attn_output.dtype)  # (h,)
        # f_D(I) through the module, so that PEFT's trained copy applies
        operator = head_lambda[:, None, None] * self.operator(eye)  # (h, d, d): lambda_h F
        return F.linear(attn_output, dex_folded_weight(self.o_proj.weight, operator), self.o_proj.bias)

    def operator_is_its_weight(self) -> bool:
        """Whether f_D(x) = x W^T with W = `dex_proj.weight`, as the kernels that read W compute it: f_D a plain
        Linear, or PEFT's `modules_to_save` wrapper of plain Linears (whose `weight` is that of the copy it runs).
        Not an adapter layer on f_D (LoRA, DoRA, IA3, ...: `target_modules="all-linear"` wraps it), whose `weight` is
        its base layer's: the decode kernel read that and dropped the adapter's term (a LoRA on f_D had no effect on
        the logits of a step of up to 16 tokens, generate's every step)."""
        module = self.dex_proj
        if is_plain_linear(module):
            return True
        copies = getattr(module, "modules_to_save", None)
        return (isinstance(copies, nn.ModuleDict) and isinstance(getattr(module, "original_module", None), nn.Module)
                and runs_own_forward(module)
                and all(map(is_plain_linear, (module.original_module, *copies.values()))))

    def decode_applies(self, implementation, query, key, value, attention_mask, kwargs) -> bool:
        """Whether `decode_heads` takes this step: f_D its weight (`operator_is_its_weight`), lambda's module
        unhooked (the kernel reads its `lambda_learn` in place of calling it), and the decode kernel's shapes."""
        return (
            self.operator_is_its_weight()
            and runs_own_forward(self.dex_lambda)
            and super().decode_applies(implementation, query, key, value, attention_mask, kwargs)
        )

    def decode_combine(self, side) -> DexCombine:
        return DexCombine(
            self.dex_proj.weight, self.head_mask[self.dex_lambda.head_slice], self.dex_lambda.lambda_learn,
            self.anneal_step, self.config.anneal_steps, self.lambda_init,
        )

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs: Unpack[TransformersKwargs]
    ):
        input_shape = hidden_states.shape[:-1]
        implementation = self.implementation(hidden_states, kwargs)
        query_states, key_states, value_states, _ = self.project(
            implementation, hidden_states, position_embeddings, cache
        )
        heads = self.decode_heads(
            implementation, query_states, key_states, value_states, (), attention_mask, cache, kwargs
        )
        if heads is not None:  # (B, L, h, d), the operator applied
            return self.output(heads), None
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        attn_output, attn_weights = self.attend(
            implementation, query_states, key_states, value_states, attention_mask, **kwargs
        )  # (B, L, h, d)
        if uses_fast_kernels(implementation) and self.operator_folds_into_o_proj(attn_output):
            return self.o_proj_with_operator(attn_output.reshape(*input_shape, -1)), attn_weights
        if self.config.dex_heads is None:
            # Every head carries the operator: O - lam f_D(O) = O (I - lam f_D(I)), f_D linear: one d x d matmul and
            # no elementwise passes over the attention output (exactly O where lam f_D = 0, as at conversion).
            # f_D(I) goes through the module, so that PEFT's trained copy and the tensor-parallel hooks apply.
            eye = torch.eye(self.head_dim, dtype=attn_output.dtype, device=attn_output.device)
            lam = self.current_lambda().to(attn_output.dtype)
            attn_output = torch.matmul(attn_output, eye - lam * self.operator(eye))
        else:
            t_over_T = anneal_fraction(self.anneal_step, self.config.anneal_steps)
            head_lambda = self.dex_lambda.per_head(t_over_T, self.head_mask).to(attn_output.dtype)  # (h_local,)
            attn_output = attn_output - head_lambda[:, None] * self.operator(attn_output)
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1))
        return attn_output, attn_weights


ATTENTION_CLASSES = {"v1": DiffAttentionV1, "v2": DiffAttentionV2, "dex": DexAttention}
