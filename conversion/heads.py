"""Which heads of each layer carry the DEX operator.

DEX (arXiv 2505.16333) adapts the heads whose attention is diffuse (high entropy, low importance). The paper
gives no exact recipe, so ours is:
- score of head (l, i) = mean over calibration sequences and query positions of the entropy (nats) of its
  softmax attention row, -sum_s p_s log p_s, computed on the source model itself;
- per layer, the ceil(fraction * h) heads of highest score (default fraction 0.5).

Calibration streams the checkpoint layer by layer (a layer's tensors are read, run, released), so it needs
the memory of one layer plus the activations, whatever the size of the model.
"""

import copy
import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers.initialization import no_init_weights
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from modeling_diff import diagnostics
from modeling_diff.modeling_diff_llama import DiffLlamaDecoderLayer

from .mapping import TensorMapping

HEAD_CHOICES = ("entropy", "all")


def resolve_heads(heads, num_layers: int, num_heads: int) -> list[list[int]] | None:
    """`"all"` or an explicit choice -> one sorted list per layer; `"entropy"` -> None (calibrate).
    An explicit choice is one list of head indices for every layer, or one list per layer."""
    if isinstance(heads, str):
        if heads not in HEAD_CHOICES:
            raise ValueError(f"heads must be one of {HEAD_CHOICES} or a list of head indices, got {heads!r}")
        return None if heads == "entropy" else [list(range(num_heads)) for _ in range(num_layers)]
    if not isinstance(heads, (list, tuple)):
        raise ValueError(f"heads must be one of {HEAD_CHOICES}, a list of head indices or one such list per layer, "
                         f"got {heads!r}")
    heads = list(heads)
    if not any(isinstance(layer, (list, tuple)) for layer in heads):
        heads = [heads] * num_layers  # one list for every layer
    if len(heads) != num_layers or not all(isinstance(layer, (list, tuple)) for layer in heads):
        raise ValueError(
            f"heads must be a list of head indices or one such list per layer ({num_layers}), got {heads!r}"
        )
    for layer_idx, layer in enumerate(heads):
        # indices first: a list or a dict in place of one cannot be put in a set (a TypeError)
        if not all(is_head_index(h, num_heads) for h in layer) or len(set(layer)) != len(layer):
            raise ValueError(
                f"heads[{layer_idx}] must hold distinct head indices in [0, {num_heads}) (integers, not booleans), "
                f"got {list(layer)}"
            )
    if not any(heads):
        raise ValueError("heads selects no head: a DEX conversion needs at least one head; pass 'all', 'entropy' "
                         "or a non-empty list")
    return [sorted(layer) for layer in heads]


def is_head_index(h, num_heads: int) -> bool:
    """An int (a bool is not a head) in [0, num_heads)."""
    return isinstance(h, int) and not isinstance(h, bool) and 0 <= h < num_heads


def check_calibration_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Calibration ids must be integer token ids of shape (batch, length >= 2), each in [0, vocab_size)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"calibration must be integer token ids, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"calibration token ids must have shape (batch, length >= 2): at least 2 tokens a sequence, "
                         f"got {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"calibration token ids must lie in [0, vocab_size={vocab_size}), got ids from "
                         f"{int(ids.min())} to {int(ids.max())}")


def check_head_fraction(fraction) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"head_fraction must be in (0, 1], got {fraction!r}")


@torch.no_grad()
def attention_entropy(
    get_tensor: Callable[[str], torch.Tensor],
    mapping: TensorMapping,
    calibration_ids: torch.Tensor,
    progress: bool = True,
) -> torch.Tensor:
    """Mean attention entropy of every head of the source model on `calibration_ids` (B, L): (num_layers, h).

    `get_tensor(name)` returns a source tensor; `mapping` is the DEX mapping of the source, whose layers (with
    f_D = 0) compute the source's attention exactly.
    """
    check_calibration_ids(calibration_ids, mapping.config.vocab_size)
    config = copy.deepcopy(mapping.config)
    config._attn_implementation = "eager"  # the only backend that materialises the softmax maps
    hidden = torch.nn.functional.embedding(calibration_ids, get_tensor("model.embed_tokens.weight").float())
    length = calibration_ids.shape[1]
    position_embeddings = LlamaRotaryEmbedding(config=config)(hidden, torch.arange(length)[None])
    causal_mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # added to the scores by eager
    causal_keys = causal_mask == 0  # (1, 1, L, L)
    every_query = torch.ones(1, 1, length, dtype=torch.bool)

    entropies = []
    for layer_idx in tqdm(range(config.num_hidden_layers), desc="calibrating heads", disable=not progress):
        prefix = f"model.layers.{layer_idx}."
        state = {name: get_tensor(name).float() for name in mapping.source_shapes if name.startswith(prefix)}
        state.update({name: t.float() for name, t in mapping.layer_extras(layer_idx, torch.float32).items()})
        with no_init_weights():  # loaded right below
            layer = DiffLlamaDecoderLayer(config, layer_idx)
        layer.load_state_dict({name.removeprefix(prefix): t for name, t in state.items()})
        captured = {}
        hook = layer.self_attn.register_forward_hook(lambda module, args, output: captured.update(maps=output[1]))
        hidden = layer(hidden, attention_mask=causal_mask, position_embeddings=position_embeddings)
        hook.remove()
        maps = captured["maps"]  # (B, h, L, L), rows sum to 1, zeros above the diagonal
        if not torch.isfinite(maps).all():  # NaN maps scored an entropy of 0: the heads chosen were arbitrary
            raise ValueError(f"the attention of layer {layer_idx} is not finite (NaN or inf) on the calibration: the "
                             f"source's weights or activations hold non-finite values, so its heads cannot be ranked by "
                             f"entropy; check the checkpoint, or choose the heads (heads='all' or a list)")
        entropies.append(diagnostics.attention_entropy(maps, causal_keys, every_query))  # (h,)
    return torch.stack(entropies)


def top_entropy_heads(entropy: torch.Tensor, fraction: float = 0.5) -> list[list[int]]:
    """Per layer, the ceil(fraction * h) heads of highest entropy, sorted by index."""
    check_head_fraction(fraction)
    count = math.ceil(fraction * entropy.shape[1])
    return [sorted(row.topk(count).indices.tolist()) for row in entropy]
