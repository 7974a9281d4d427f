"""Attention-noise diagnostics: measure the claims made for differential attention on your own model.

The DIFF Transformer paper (arXiv 2410.05258) claims that differential attention cancels attention noise
(Sec. 3.5, Fig. 1), puts more weight on the relevant context (the needle), shrinks activation outliers
(Sec. 3.8, Table 6) and tolerates low-bit attention logits (Fig. 8). Critics point out that the
cancellation needs the two maps to be correlated on irrelevant keys, that differential maps are signed
rather than sparse, and that the quantization result covers attention logits only. `diagnose` measures
each of these, per layer and head, on one batch of text, for a DiffLlama (V1, V2, DEX) or a plain Llama:

| measure                | what                                                                           | applies to |
|------------------------|--------------------------------------------------------------------------------|------------|
| `entropy`              | entropy (nats) of each query's map, |map| normalised to sum 1; mean over queries | all        |
| `signal/noise_entropy` | the same for the two softmax maps A1, A2 of a differential head                | V1, V2     |
| `negative_mass`        | sum of the negative weights' magnitudes in each query's map; mean over queries  | all (0 for softmax) |
| `noise_correlation`    | Pearson correlation of A1 and A2 over the non-salient keys of each query         | V1, V2     |
| `logit_outliers`       | top-1, top-100 and (lower) median of |attention logits| per layer and head       | all        |
| `hidden_outliers`      | the same for |hidden states| (each decoder layer's output) per layer              | all        |
| `quantized_loss`       | LM loss after absmax-quantizing attention logits to 8/6/4 bits                   | all        |
| `clamped_loss`         | LM loss after clamping negative differential weights to zero                     | V1, V2     |

`needle_attention_share` adds the share of attention on a planted needle as the context grows.

"map" is the attention the layer applies to V: the differential map A1 - lambda A2 for V1 and V2, the
softmax map for Llama and DEX (DEX acts on head outputs, after the map). DEX and Llama have one map per
head, so the measures that compare A1 with A2 do not apply to them.

How: `AttentionProbe` switches the model to a recording eager attention registered with transformers'
`AttentionInterface`, so the maps come from the model's own projections and RoPE, not from a copy of them
here. V1 and V2 call the attention interface once per layer with 2h query heads, pair i being heads
(2i, 2i+1) = (A1, A2); Llama and DEX call it with h heads.
"""

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv

from .diff_attention import DiffAttentionV1, DiffAttentionV2
from .extras import require

PROBE_ATTENTION = "modeling_diff_probe"
OUTLIER_STATS = ("top1", "top100", "median")
_PROBES: dict[int, "AttentionProbe"] = {}  # id(attention module) -> the probe watching it
# The attention logits are quantized in float32 (`probe_attention_forward` computes them so), whose significand has
# 24 bits. At 24 bits the absmax grid's step, max|x| / (2^23 - 1), is already float32's own spacing at max|x|
# (2^-23 max|x|): more bits simulate nothing, and past 2^24 levels the ratios x / s are no longer exact integers in
# float32 (at 100 bits 2^99 did not even fit the int64 torch divides by, and 2**40 bits never finished computing
# 2^(bits-1)). Fewer than 2 bits leave no level but 0.
MIN_LOGIT_BITS, MAX_LOGIT_BITS = 2, 24
# noise_correlation correlates A1 and A2 over the keys other than the num_salient most salient ones, and needs at
# least this many keys left for a query to count.
MIN_CORRELATED_KEYS = 3


def _is_integer(value) -> bool:
    """An int (or a NumPy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_logit_bits(value) -> bool:
    return _is_integer(value) and MIN_LOGIT_BITS <= value <= MAX_LOGIT_BITS


_BITS_RULE = (f"in [{MIN_LOGIT_BITS}, {MAX_LOGIT_BITS}] (the attention logits are float32: {MAX_LOGIT_BITS} bits "
              f"already give float32's own resolution, and fewer than {MIN_LOGIT_BITS} leave no level but 0)")


# ----------------------------------------------------------------------------------------------------------
# The measures: plain functions of maps and masks, checked by hand in tests/test_diagnostics.py.
# Shapes: B batch, H heads, L queries, S keys; `valid` (B, 1, L, S) marks the keys a query may attend to,
# `rows` (B, 1, L) the queries to average over (real tokens with at least one valid key).
# ----------------------------------------------------------------------------------------------------------


def _mean_over_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, H, L) -> (H,): mean over the rows marked in `rows`; NaN for a head without any."""
    rows = rows.expand_as(values)
    total = torch.where(rows, values, 0.0).sum(dim=(0, 2))
    return total / rows.sum(dim=(0, 2))


def attention_entropy(maps: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(H,) mean over queries of the entropy of |map| normalised to sum 1 over the valid keys (0 log 0 = 0)."""
    weights = torch.where(valid, maps.abs(), 0.0)
    p = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    entropy = -torch.where(p > 0, p * p.clamp_min(torch.finfo(p.dtype).tiny).log(), 0.0).sum(-1)
    return _mean_over_rows(entropy, rows)


def negative_mass(maps: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(H,) mean over queries of sum_k max(0, -map[k]) over the valid keys."""
    return _mean_over_rows(torch.where(valid, (-maps).clamp_min(0.0), 0.0).sum(-1), rows)


def noise_correlation(
    signal: torch.Tensor, noise: torch.Tensor, maps: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
    num_salient: int = 1,
) -> torch.Tensor:
    """(H,) mean over queries of the Pearson correlation of A1 (`signal`) and A2 (`noise`) over the valid keys
    that are not salient, the salient ones being the `num_salient` keys with the largest differential weight
    (`maps`). The cancellation argument needs this correlation to be high. Queries with fewer than 3 such keys,
    or a constant map over them, are left out."""
    if not _is_integer(num_salient) or num_salient < 0:
        raise ValueError(f"num_salient must be an integer >= 0, got {num_salient!r}")
    num_salient = int(num_salient)
    keep = valid.expand_as(maps).clone()
    if num_salient > 0:
        salience = torch.where(keep, maps, -torch.inf)
        top = salience.topk(min(num_salient, maps.shape[-1]), dim=-1).indices
        keep.scatter_(-1, top, False)
    count = keep.sum(-1)  # (B, H, L)
    mean_1 = torch.where(keep, signal, 0.0).sum(-1) / count.clamp_min(1)
    mean_2 = torch.where(keep, noise, 0.0).sum(-1) / count.clamp_min(1)
    centred_1 = torch.where(keep, signal - mean_1[..., None], 0.0)
    centred_2 = torch.where(keep, noise - mean_2[..., None], 0.0)
    var_1, var_2 = centred_1.square().sum(-1), centred_2.square().sum(-1)
    correlation = (centred_1 * centred_2).sum(-1) / (var_1 * var_2).sqrt().clamp_min(torch.finfo(var_1.dtype).tiny)
    # A map constant over the kept keys (up to rounding: relative spread below 1e-6) has no correlation.
    def varies(variance, mean):
        return variance > (1e-6 * mean).square() * count

    usable = rows & (count >= MIN_CORRELATED_KEYS) & varies(var_1, mean_1) & varies(var_2, mean_2)
    return _mean_over_rows(correlation, usable)


def outlier_stats(magnitudes: torch.Tensor) -> dict[str, torch.Tensor]:
    """(G, N) magnitudes -> {"top1", "top100", "median"}: (G,) each. top100 is the 100th largest value (NaN
    when N < 100); median is the lower median, the ceil(N/2)-th smallest value."""
    n = magnitudes.shape[-1]
    top100 = magnitudes.kthvalue(n - 99, dim=-1).values if n >= 100 else torch.full_like(magnitudes[:, 0], torch.nan)
    return {
        "top1": magnitudes.amax(dim=-1),
        "top100": top100,
        "median": magnitudes.kthvalue((n + 1) // 2, dim=-1).values,
    }


def real_query_keys(valid: torch.Tensor) -> torch.Tensor:
    """`valid` (B, 1, L, S) without the rows of padding queries. A real token's query may attend to its own position
    (the last L keys are the queries' own); a padding query may not, but right of the text it attends to the real
    keys before it, and its logits counted in the logit outliers and the quantization scale of the real tokens."""
    length, keys = valid.shape[-2:]
    own = valid.diagonal(offset=keys - length, dim1=-2, dim2=-1)  # (B, 1, L)
    return valid & own[..., None]


def absmax_quantize(logits: torch.Tensor, bits: int, valid: torch.Tensor) -> torch.Tensor:
    """Symmetric absmax quantization to `bits` bits, one scale per (batch, head) over the valid entries:
    x -> round(x / s) * s with s = max|x| / (2^(bits-1) - 1)."""
    if not _is_logit_bits(bits):
        raise ValueError(f"bits must be an integer {_BITS_RULE}, got {bits!r}")
    levels = 2 ** (int(bits) - 1) - 1
    absmax = torch.where(valid, logits.abs(), 0.0).amax(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
    scale = absmax.clamp_min(torch.finfo(logits.dtype).tiny) / levels
    return (logits / scale).round().clamp(-levels, levels) * scale


# ----------------------------------------------------------------------------------------------------------
# The probe: a recording eager attention, switched on for one model inside a `with` block.
# ----------------------------------------------------------------------------------------------------------


@dataclass
class LayerAttention:
    """What one decoder layer's attention computed on one batch (float32, detached).

    For V1 and V2 the attention call had H = 2h query heads: head 2i is A1 (signal), 2i+1 is A2 (noise) of pair i.
    """

    layer_idx: int
    logits: torch.Tensor  # (B, H, L, S) scaled scores Q K^T / sqrt(d), after quantization if any, before the mask
    probs: torch.Tensor  # (B, H, L, S) softmax maps
    valid: torch.Tensor  # (B, 1, L, S) bool: keys each query may attend to
    maps: torch.Tensor  # (B, h, L, S) the maps the layer applies to V (differential for V1 and V2)
    paired: bool  # whether probs holds (A1, A2) pairs

    @property
    def signal(self) -> torch.Tensor | None:
        return self.probs[:, 0::2] if self.paired else None

    @property
    def noise(self) -> torch.Tensor | None:
        return self.probs[:, 1::2] if self.paired else None

    def head_logits(self) -> torch.Tensor:
        """(h, N): the magnitudes of the valid logits of the real queries of each output head (both maps of a pair
        together)."""
        num_heads = self.maps.shape[1]
        magnitudes = self.logits.abs().unflatten(1, (num_heads, -1)).transpose(0, 1)  # (h, B, n, L, S)
        keep = real_query_keys(self.valid).expand(-1, magnitudes.shape[2], -1, -1)  # (B, n, L, S)
        return magnitudes[:, keep]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-like model (`model.base_model.layers`, each with `.self_attn`)."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"model must be Llama-like (base_model.layers[i].self_attn), got {type(model).__name__}")
    return layers


def is_differential(model: nn.Module) -> bool:
    """Whether the model's attention has differential (paired) maps: DiffLlama V1 or V2."""
    return isinstance(decoder_layers(model)[0].self_attn, (DiffAttentionV1, DiffAttentionV2))


def _pair_weight(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The weight of A2 in the differential map, broadcastable to (B, h, L, S): V1's lambda, V2's per-token one."""
    if isinstance(module, DiffAttentionV1):
        return module.diff_lambda().reshape(1, 1, 1, 1)
    return module.noise_weight(module.lambda_proj(hidden_states)).transpose(1, 2)[..., None].float()  # (B, h, L, 1)


def probe_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention, plus what the probe watching `module` asks for: its logits quantized,
    negative differential weights clamped to zero, the logits and maps recorded."""
    probe = _PROBES.get(id(module))
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    logits = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # (B, H, L, S)
    valid = torch.ones_like(logits[:, :1], dtype=torch.bool) if attention_mask is None else attention_mask == 0
    if probe is not None and probe.logit_bits is not None:
        logits = absmax_quantize(logits, probe.logit_bits, real_query_keys(valid))
    # A query without any valid key gets a uniform map, as in eager attention.
    probs = logits.masked_fill(~valid, torch.finfo(torch.float32).min).softmax(dim=-1)
    if probe is not None and probe.clamp_negative:
        # The layer computes A[2i] V - w A[2i+1] V; handing it (max(0, A1 - w A2), 0) makes that max(0, A1 - w A2) V.
        weight = _pair_weight(module, probe.hidden_states[id(module)])
        clamped = (probs[:, 0::2] - weight * probs[:, 1::2]).clamp_min(0.0)
        probs = torch.stack([clamped, torch.zeros_like(clamped)], dim=2).flatten(1, 2)
    if probe is not None:
        probe.calls[id(module)] = (logits.detach(), probs.detach(), valid)
    weights = nn.functional.dropout(probs.to(query.dtype), p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, L, H, d_v)
    return output, weights


def register_probe_attention() -> None:
    """Make `attn_implementation=PROBE_ATTENTION` valid (eager's float mask: 0 = attend, dtype min = masked)."""
    AttentionInterface.register(PROBE_ATTENTION, probe_attention_forward)
    AttentionMaskInterface.register(PROBE_ATTENTION, eager_mask)


def check_no_probe(model: nn.Module) -> None:
    """A ValueError unless no AttentionProbe is attached to `model`. Probes do not nest: a second one would take
    the model's attention over from the first (whose hooks would then find nothing recorded) and, on leaving,
    detach the first and restore the probe attention as the model's own."""
    if any(id(layer.self_attn) in _PROBES for layer in decoder_layers(model)):
        raise ValueError("an AttentionProbe is already attached to this model: AttentionProbe, lm_loss and diagnose "
                         "do not nest; run this after the probe's `with` block has ended")


class AttentionProbe:
    """Inside `with AttentionProbe(model, on_layer) :`, every forward of `model` runs the probing eager
    attention and hands each layer's `LayerAttention` to `on_layer` as soon as the layer has run, so only one
    layer's maps are alive at a time. On exit the model's attention implementation is restored.

    logit_bits: absmax-quantize the attention logits to this many bits.
    clamp_negative: clamp the negative weights of the differential maps to zero (V1 and V2 only).

    One probe at a time per model: entering a second one (or `lm_loss`, `diagnose`) inside raises a ValueError.
    """

    def __init__(
        self,
        model: nn.Module,
        on_layer: Callable[[LayerAttention], None] | None = None,
        logit_bits: int | None = None,
        clamp_negative: bool = False,
    ):
        if logit_bits is not None and not _is_logit_bits(logit_bits):
            raise ValueError(f"logit_bits must be None or an integer {_BITS_RULE}, got {logit_bits!r}")
        if clamp_negative and not is_differential(model):
            raise ValueError("clamp_negative needs differential maps (a DiffLlama with diff_mode 'v1' or 'v2'), "
                             f"got {type(decoder_layers(model)[0].self_attn).__name__}")
        self.model = model
        self.on_layer = on_layer
        self.logit_bits = logit_bits
        self.clamp_negative = clamp_negative
        self.calls: dict[int, tuple] = {}
        self.hidden_states: dict[int, torch.Tensor] = {}
        self._hooks = []

    def __enter__(self) -> "AttentionProbe":
        check_no_probe(self.model)  # before anything is changed: the probe already there keeps the model
        register_probe_attention()
        self._previous = self.model.config._attn_implementation
        try:
            self.model.set_attn_implementation(PROBE_ATTENTION)
            for layer_idx, layer in enumerate(decoder_layers(self.model)):
                attention = layer.self_attn
                _PROBES[id(attention)] = self
                self._hooks.append(attention.register_forward_pre_hook(self._keep_input, with_kwargs=True))
                self._hooks.append(attention.register_forward_hook(self._make_layer_hook(layer_idx)))
        except BaseException:  # half attached: undo what was done
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for layer in decoder_layers(self.model):
            if _PROBES.get(id(layer.self_attn)) is self:
                del _PROBES[id(layer.self_attn)]
        self.calls.clear()
        self.hidden_states.clear()
        self.model.set_attn_implementation(self._previous)

    def _keep_input(self, module, args, kwargs):
        # V2's weight of A2 depends on the layer's input; kept for clamp_negative.
        self.hidden_states[id(module)] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def _make_layer_hook(self, layer_idx: int):
        def hook(module, args, output):
            logits, probs, valid = self.calls.pop(id(module))
            self.hidden_states.pop(id(module), None)
            maps = output[1].detach().float()  # (B, h, L, S): the layer's own combination of its maps
            if self.on_layer is not None:
                paired = probs.shape[1] == 2 * maps.shape[1]
                self.on_layer(LayerAttention(layer_idx, logits, probs, valid, maps, paired))

        return hook


# ----------------------------------------------------------------------------------------------------------
# Running the measures on a model (real text and a real model, offline: modeling_diff.data).
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def lm_loss(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **probe_kwargs) -> float:
    """Causal LM loss on the batch (padding excluded), under an `AttentionProbe(model, **probe_kwargs)`. A token is a
    target where it and the token before it, whose query predicts it, are real: with left padding the last pad's query
    predicted the first real token, a target no unpadded row has."""
    labels = input_ids
    if attention_mask is not None:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, 1:] = labels[:, 1:].masked_fill(attention_mask[:, :-1] == 0, -100)
    with AttentionProbe(model, **probe_kwargs):
        return float(model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss)


@dataclass
class NoiseReport:
    """The measures of `diagnose` on one batch. Per-head tensors are (num_layers, h); None where a measure does
    not apply to the model (see the module docstring)."""

    entropy: torch.Tensor
    negative_mass: torch.Tensor
    logit_outliers: dict[str, torch.Tensor]  # OUTLIER_STATS -> (num_layers, h)
    hidden_outliers: dict[str, torch.Tensor]  # OUTLIER_STATS -> (num_layers,)
    loss: float
    quantized_loss: dict[int, float]  # bits -> loss
    signal_entropy: torch.Tensor | None = None
    noise_entropy: torch.Tensor | None = None
    noise_correlation: torch.Tensor | None = None
    clamped_loss: float | None = None
    per_layer: dict[str, torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self):
        heads = {"entropy": self.entropy, "negative_mass": self.negative_mass, "signal_entropy": self.signal_entropy,
                 "noise_entropy": self.noise_entropy, "noise_correlation": self.noise_correlation}
        self.per_layer = {name: value.nanmean(dim=1) for name, value in heads.items() if value is not None}

    def summary(self) -> str:
        """Head means of every measure, one line per layer, then the losses."""
        names = list(self.per_layer) + [f"logit_{s}" for s in OUTLIER_STATS] + [f"hidden_{s}" for s in OUTLIER_STATS]
        columns = list(self.per_layer.values()) + [self.logit_outliers[s].amax(dim=1) for s in OUTLIER_STATS]
        columns += [self.hidden_outliers[s] for s in OUTLIER_STATS]
        lines = ["layer " + " ".join(f"{name:>17}" for name in names)]
        for layer in range(self.entropy.shape[0]):
            lines.append(f"{layer:>5} " + " ".join(f"{float(column[layer]):>17.4g}" for column in columns))
        losses = [f"loss {self.loss:.4f}"] + [f"{bits}-bit logits {loss:.4f}" for bits, loss in self.quantized_loss.items()]
        if self.clamped_loss is not None:
            losses.append(f"negatives clamped {self.clamped_loss:.4f}")
        return "\n".join(lines + ["; ".join(losses)])

    def to_dict(self) -> dict:
        """Plain lists and floats (JSON-ready)."""
        def plain(value):
            if isinstance(value, torch.Tensor):
                return value.tolist()
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in value.items()}
            return value

        names = ("entropy", "negative_mass", "logit_outliers", "hidden_outliers", "loss", "quantized_loss",
                 "signal_entropy", "noise_entropy", "noise_correlation", "clamped_loss")
        return {name: plain(getattr(self, name)) for name in names}


class _LayerMeasures:
    """`on_layer` callback of `diagnose`: reduces each layer's maps to per-head numbers at once."""

    def __init__(self, rows: torch.Tensor, num_salient: int):
        self.rows = rows
        self.num_salient = num_salient
        self.values: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values.setdefault(name, []).append(value)

    def __call__(self, layer: LayerAttention) -> None:
        rows, valid = self.rows, layer.valid
        self.add("entropy", attention_entropy(layer.maps, valid, rows))
        self.add("negative_mass", negative_mass(layer.maps, valid, rows))
        for name, value in outlier_stats(layer.head_logits()).items():
            self.add(f"logit_{name}", value)
        if layer.paired:
            self.add("signal_entropy", attention_entropy(layer.signal, valid, rows))
            self.add("noise_entropy", attention_entropy(layer.noise, valid, rows))
            self.add("noise_correlation",
                     noise_correlation(layer.signal, layer.noise, layer.maps, valid, rows, self.num_salient))

    def stacked(self, name: str) -> torch.Tensor | None:
        return torch.stack(self.values[name]) if name in self.values else None


@torch.no_grad()
def diagnose(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    bits: tuple[int, ...] = (8, 6, 4),
    num_salient: int = 1,
    progress: bool = True,
) -> NoiseReport:
    """All measures of the module docstring on one batch: one probed forward pass, one per entry of `bits`,
    and one with negative weights clamped (V1, V2).

    bits: distinct integers in [2, 24] (see MAX_LOGIT_BITS), one quantized loss each.
    num_salient: an integer in [0, n - 3], n the real tokens of the batch's longest row: the keys left out of
    noise_correlation (which needs 3 keys left), checked for every model kind."""
    bits = _checked_bits(bits)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    if not real.any():
        raise ValueError("attention_mask marks no real token: the batch is all padding")
    if not real[:, 1:].any():  # the loss predicts token t + 1 from tokens <= t: there must be a token to predict
        raise ValueError(f"input_ids must hold a token to predict (a real token after the first position) for the "
                         f"losses, got shape {tuple(input_ids.shape)} with {int(real.sum())} real token(s)")
    _check_num_salient(num_salient, longest=int(real.sum(dim=1).max()))
    check_no_probe(model)
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    was_training = model.training
    model.eval()
    try:
        return _diagnose(model, input_ids, attention_mask, real, bits, num_salient, progress)
    finally:  # also when a measure fails: the model is left as it was found
        model.train(was_training)


def _checked_bits(bits) -> tuple[int, ...]:
    """`bits` of `diagnose` as a tuple of ints; a ValueError before any forward pass unless it is a sequence of
    distinct integers in [MIN_LOGIT_BITS, MAX_LOGIT_BITS]."""
    rule = f"bits must be a sequence of distinct integers {_BITS_RULE}, one quantized loss each"
    if isinstance(bits, (str, bytes)) or not isinstance(bits, Iterable):
        raise ValueError(f"{rule}, got {bits!r}")
    values = tuple(bits)
    if not all(_is_logit_bits(value) for value in values) or len(set(values)) != len(values):
        raise ValueError(f"{rule}, got {bits!r}")
    return tuple(int(value) for value in values)


def _check_num_salient(num_salient, longest: int) -> None:
    """A ValueError unless `num_salient` leaves noise_correlation MIN_CORRELATED_KEYS keys for at least one query:
    the last real query of the longest row sees `longest` keys. (Past that every query was left out and the
    correlation came back NaN without a word; a float was a TypeError from topk.)"""
    limit = longest - MIN_CORRELATED_KEYS
    why = (f"noise_correlation leaves out the num_salient most salient keys of each query and needs "
           f"{MIN_CORRELATED_KEYS} keys left")
    if limit < 0:
        raise ValueError(f"num_salient: {why}, and the longest row of this batch has only {longest} real tokens; "
                         f"pass a batch with a row of at least {MIN_CORRELATED_KEYS} + num_salient real tokens")
    if not _is_integer(num_salient) or not 0 <= num_salient <= limit:
        raise ValueError(f"num_salient must be an integer in [0, {limit}] for this batch, whose longest row has "
                         f"{longest} real tokens: {why}, got {num_salient!r}")


def _diagnose(model, input_ids, attention_mask, real, bits, num_salient, progress) -> NoiseReport:
    differential = is_differential(model)
    steps = tqdm(total=1 + len(bits) + differential, desc="diagnose", disable=not progress)

    measures = _LayerMeasures(rows=real[:, None, :], num_salient=num_salient)
    hidden: list[dict[str, torch.Tensor]] = []

    def keep_hidden(module, args, output):
        states = output[0] if isinstance(output, tuple) else output  # (B, L, D)
        hidden.append(outlier_stats(states.detach().float().abs()[real].reshape(1, -1)))

    hooks = [layer.register_forward_hook(keep_hidden) for layer in decoder_layers(model)]
    try:
        loss = lm_loss(model, input_ids, attention_mask, on_layer=measures)
    finally:
        for hook in hooks:
            hook.remove()
    steps.update()
    quantized_loss = {}
    for n_bits in bits:
        quantized_loss[n_bits] = lm_loss(model, input_ids, attention_mask, logit_bits=n_bits)
        steps.update()
    clamped_loss = lm_loss(model, input_ids, attention_mask, clamp_negative=True) if differential else None
    steps.update(int(differential))
    steps.close()

    return NoiseReport(
        entropy=measures.stacked("entropy"),
        negative_mass=measures.stacked("negative_mass"),
        logit_outliers={s: measures.stacked(f"logit_{s}") for s in OUTLIER_STATS},
        hidden_outliers={s: torch.cat([layer[s] for layer in hidden]) for s in OUTLIER_STATS},
        loss=loss,
        quantized_loss=quantized_loss,
        signal_entropy=measures.stacked("signal_entropy"),
        noise_entropy=measures.stacked("noise_entropy"),
        noise_correlation=measures.stacked("noise_correlation"),
        clamped_loss=clamped_loss,
    )


def needle_share(maps: torch.Tensor, valid: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """(B, H, S) maps of one query -> (H,): weight on the keys [start, end) over the total |weight|, batch mean.
    For a softmax map this is the plain share of attention; a differential map's negative weights count as mass."""
    weights = torch.where(valid, maps, 0.0)
    share = weights[..., span[0] : span[1]].sum(-1) / weights.abs().sum(-1).clamp_min(torch.finfo(maps.dtype).tiny)
    return share.mean(dim=0)


@torch.no_grad()
def needle_attention_share(
    model: nn.Module,
    tokenizer,
    lengths: list[int],
    depth: float = 0.5,
    haystack: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> torch.Tensor:
    """(len(lengths), num_layers, h): the share of attention that the last question token (the one that predicts
    the answer) puts on the value tokens of a needle planted at `depth` in a context of each length."""
    import random

    from .data import shakespeare
    from .needle import NeedlePromptBuilder, make_needles

    builder = NeedlePromptBuilder(tokenizer, shakespeare("hamlet") if haystack is None else haystack)
    device = next(model.parameters()).device
    shares = []
    was_training = model.training
    model.eval()  # as diagnose: in training mode attention dropout made the shares random
    try:
        for length in tqdm(lengths, desc="needle share", disable=not progress):
            rng = random.Random(f"{seed}-{length}")
            (prompt,) = builder.build(length, depth, make_needles(1, rng), 1, rng)
            per_layer = []

            def on_layer(layer: LayerAttention) -> None:
                per_layer.append(needle_share(layer.maps[:, :, -1], layer.valid[:, :, -1], prompt.value_span))

            with AttentionProbe(model, on_layer):
                model(input_ids=torch.tensor([prompt.input_ids], device=device), use_cache=False)
            shares.append(torch.stack(per_layer))
    finally:  # the model is left in the mode it was found in
        model.train(was_training)
    return torch.stack(shares)


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib is imported only when one is drawn).
# ----------------------------------------------------------------------------------------------------------


def plot_maps(layer: LayerAttention, head: int = 0, batch: int = 0, tokens: list[str] | None = None):
    """Draw A1, A2 and the differential map of one head (V1, V2), or the one map (Llama, DEX). Returns the Figure.
    Needs matplotlib: pip install 'modeling-diff[needle]'."""
    plt = require("matplotlib.pyplot", "plot_maps")

    panels = [("A1 (signal)", layer.signal), ("A2 (noise)", layer.noise)] if layer.paired else []
    panels.append(("A1 - lambda A2" if layer.paired else "attention map", layer.maps))
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (title, maps) in zip(axes[0], panels):
        image = maps[batch, head].masked_fill(~layer.valid[batch, 0], torch.nan).cpu()
        limit = float(image.nan_to_num().abs().max())
        signed = bool((image.nan_to_num() < 0).any())
        shown = ax.imshow(image, cmap="RdBu_r" if signed else "viridis", vmin=-limit if signed else 0, vmax=limit)
        figure.colorbar(shown, ax=ax, fraction=0.046)
        ax.set_title(f"layer {layer.layer_idx} head {head}: {title}")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if tokens is not None and len(tokens) <= 48:
            ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
    figure.tight_layout()
    return figure


def plot_report(reports: dict[str, NoiseReport]):
    """Compare models: per-layer curves of every measure and the losses under interventions. Returns the Figure.
    Needs matplotlib: pip install 'modeling-diff[needle]'."""
    plt = require("matplotlib.pyplot", "plot_report")

    curves = ["entropy", "negative_mass", "noise_correlation", "logit_top1", "hidden_top1", "hidden_median"]
    figure, axes = plt.subplots(2, 4, figsize=(18, 7))
    for ax, name in zip(axes.flat, curves):
        for label, report in reports.items():
            if name.startswith(("logit_", "hidden_")):
                kind, stat = name.split("_", 1)
                values = report.logit_outliers[stat].amax(dim=1) if kind == "logit" else report.hidden_outliers[stat]
            elif name in report.per_layer:
                values = report.per_layer[name]
            else:
                continue
            if not values.isnan().all():
                ax.plot(values.cpu(), marker=".", label=label)
        ax.set_title(name.replace("_", " ") + (" (max over heads)" if name.startswith("logit_") else ""))
        ax.set_xlabel("layer")
        if not ax.lines:
            ax.text(0.5, 0.5, "does not apply to these models", ha="center", va="center", transform=ax.transAxes)
    for ax, (title, key) in zip(axes[1, 2:], [("loss, quantized attention logits", "bits"), ("loss, negatives clamped", "clamp")]):
        labels = list(reports)
        if key == "bits":
            for label, report in reports.items():
                bits = ["full"] + [str(b) for b in report.quantized_loss]
                ax.plot(bits, [report.loss, *report.quantized_loss.values()], marker="o", label=label)
            ax.set_xlabel("bits")
        else:
            base = [reports[label].loss for label in labels]
            clamped = [reports[label].clamped_loss if reports[label].clamped_loss is not None else torch.nan for label in labels]
            x = torch.arange(len(labels))
            ax.bar(x - 0.2, base, 0.4, label="as is")
            ax.bar(x + 0.2, clamped, 0.4, label="negatives clamped")
            ax.set_xticks(x.tolist(), labels)
        ax.set_title(title)
        ax.set_ylabel("loss")
    for ax in axes.flat:
        if ax.lines or ax.patches:
            ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


__all__ = [
    "MAX_LOGIT_BITS",
    "MIN_LOGIT_BITS",
    "PROBE_ATTENTION",
    "AttentionProbe",
    "LayerAttention",
    "NoiseReport",
    "absmax_quantize",
    "attention_entropy",
    "check_no_probe",
    "diagnose",
    "lm_loss",
    "needle_attention_share",
    "needle_share",
    "negative_mass",
    "noise_correlation",
    "outlier_stats",
    "plot_maps",
    "plot_report",
]
