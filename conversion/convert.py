"""Convert a pretrained Llama-family model into a DiffLlama (`dex` or `v2`) that starts with the same logits.

Three sources: an in-memory `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` (`convert_model`), a
local safetensors directory, single-file or sharded (`convert_checkpoint`, streamed shard by shard), and a
GGUF file (`convert_checkpoint`, dequantised by transformers, then converted in memory).
"""

import copy
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.initialization import no_init_weights

from modeling_diff.atomic import atomic_directory
from modeling_diff.modeling_diff_llama import DiffLlamaForCausalLM

from .heads import attention_entropy, resolve_heads, top_entropy_heads
from .mapping import TensorMapping
from .sources import INDEX_FILE, CheckpointDir

DEFAULT_ANNEAL_STEPS = 1000
# Files of a checkpoint directory that are rewritten, not copied: weights and config.
_REWRITTEN = ("config.json", INDEX_FILE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def save_model(model: PreTrainedModel, dst: str | Path, tokenizer=None, overwrite: bool = False) -> Path:
    """`model.save_pretrained(dst)` (and the tokenizer's), written to a temporary directory and renamed."""
    with atomic_directory(dst, overwrite) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(dst)


def calibration_ids_from(calibration, tokenizer=None, max_tokens: int = 512) -> torch.Tensor:
    """Token ids (B, L) for head calibration from ids or from text (tokenised, first `max_tokens` tokens)."""
    if isinstance(calibration, torch.Tensor):
        return calibration if calibration.ndim == 2 else calibration[None]
    if isinstance(calibration, str):
        if tokenizer is None:
            raise ValueError("calibration text needs a tokenizer: pass tokenizer=... or token ids")
        return tokenizer(calibration, return_tensors="pt").input_ids[:, :max_tokens]
    raise ValueError(f"calibration must be text or a tensor of token ids, got {type(calibration).__name__}")


def _choose_heads(method, heads, head_fraction, calibration, mapping, get_tensor, progress) -> list[list[int]] | None:
    """dex_heads of the converted config: the explicit choice, all heads, or the entropy calibration."""
    config = mapping.config
    if method != "dex":
        if heads is not None:
            raise ValueError(f"heads applies to method='dex' only; method={method!r} converts every head")
        return None
    heads = "entropy" if heads is None else heads
    resolved = resolve_heads(heads, config.num_hidden_layers, config.num_attention_heads)
    if resolved is not None:
        return resolved
    if calibration is None:
        raise ValueError("heads='entropy' (the default for method='dex') needs calibration text or token ids: "
                         "pass calibration=... (--calibration-file), or choose heads='all' or a list")
    return top_entropy_heads(attention_entropy(get_tensor, mapping, calibration, progress), head_fraction)


def _plan(source_config, method, heads, head_fraction, calibration, anneal_steps, noise_init, get_tensor, progress,
          source_tensors, source_name: str) -> TensorMapping:
    """Check every source tensor, then choose the heads: the TensorMapping of the converted model.

    `source_tensors` yields (name, shape, dtype, where) for every tensor of the source.
    """
    unselected = TensorMapping.for_source(source_config, method, None, anneal_steps, noise_init)
    kept = [name for name, shape, dtype, where in source_tensors if unselected.check(name, shape, dtype, where)]
    unselected.check_complete(kept, source_name)
    dex_heads = _choose_heads(method, heads, head_fraction, calibration, unselected, get_tensor, progress)
    return TensorMapping.for_source(source_config, method, dex_heads, anneal_steps, noise_init)


def convert_model(
    model: PreTrainedModel,
    method: str = "dex",
    heads=None,
    head_fraction: float = 0.5,
    calibration: torch.Tensor | str | None = None,
    tokenizer=None,
    anneal_steps: int = DEFAULT_ANNEAL_STEPS,
    noise_init: str = "copy",
    progress: bool = True,
) -> DiffLlamaForCausalLM:
    """Convert an in-memory Llama / Mistral / Qwen2 causal LM into a `DiffLlamaForCausalLM` with the same logits.

    Args:
        model: the source model; it is not modified (the converted model holds copies of its weights).
        method: `"dex"` (DEX operator on selected heads) or `"v2"` (every head becomes a signal/noise pair).
        heads: `method="dex"` only. `None` or `"entropy"`: the `head_fraction` of heads per layer with the highest
            attention entropy on `calibration`; `"all"`; a list of head indices (every layer) or one list per layer.
        head_fraction: fraction of heads per layer selected by entropy (rounded up).
        calibration: token ids (B, L) or text (needs `tokenizer`) for entropy selection.
        anneal_steps: T of the annealing schedule (`config.anneal_steps`); `v2` needs T >= 1.
        noise_init: `v2` only: the noise head 2i+1 starts as a `"copy"` of the signal head or with `"zeros"`.
    """
    state = model.state_dict()
    if calibration is not None:
        calibration = calibration_ids_from(calibration, tokenizer)
    mapping = _plan(model.config, method, heads, head_fraction, calibration, anneal_steps, noise_init,
                    state.__getitem__, progress, ((n, t.shape, t.dtype, "the source model") for n, t in state.items()),
                    "the source model")
    converted = {}
    for name, tensor in state.items():
        if mapping.check(name, tensor.shape, tensor.dtype, "the source model"):
            converted.update(mapping.convert(name, tensor.detach().clone()))
    dtype = state["model.layers.0.self_attn.q_proj.weight"].dtype
    for layer_idx in range(mapping.config.num_hidden_layers):
        converted.update(mapping.layer_extras(layer_idx, dtype))

    with no_init_weights():  # every tensor is loaded below; random initialisation would be wasted time
        result = DiffLlamaForCausalLM._from_config(mapping.config, dtype=dtype)
    missing, unexpected = result.load_state_dict(converted, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"internal error: converted tensors do not fit the model: {missing=} {unexpected=}")
    result.tie_weights()  # lm_head.weight = embed_tokens.weight when tie_word_embeddings
    result.config._attn_implementation = model.config._attn_implementation
    result.generation_config = copy.deepcopy(model.generation_config)
    return result.train(model.training)


def _convert_directory(source: CheckpointDir, tmp: Path, mapping: TensorMapping, progress: bool) -> None:
    """Stream the shards of `source` through `mapping` into `tmp`; one shard in memory at a time."""
    anchors = {mapping.extras_anchor(layer_idx): layer_idx for layer_idx in range(mapping.config.num_hidden_layers)}
    weight_map, total_size = {}, 0
    for file in tqdm(source.files, desc="converting shards", unit="shard", disable=not progress):
        converted = {}
        for name, tensor in source.read_shard(file).items():
            if not mapping.check(name, tensor.shape, tensor.dtype, file):
                continue
            converted.update(mapping.convert(name, tensor))
            if name in anchors:
                converted.update(mapping.layer_extras(anchors[name], tensor.dtype))
        if converted:
            save_file(converted, tmp / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(converted, file))
        total_size += sum(t.numel() * t.element_size() for t in converted.values())
        del converted
    if source.is_sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    method: str = "dex",
    heads=None,
    head_fraction: float = 0.5,
    calibration: torch.Tensor | str | None = None,
    anneal_steps: int = DEFAULT_ANNEAL_STEPS,
    noise_init: str = "copy",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the checkpoint at `src` and write the DiffLlama checkpoint to directory `dst`; returns `dst`.

    `src` is a local transformers directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json), converted shard by shard so that memory stays near the largest shard, or a
    `.gguf` file (dequantised to float32 in memory). Tokenizer and generation files are carried over. Every
    source tensor is checked against config.json before anything is written; the output is written to a
    temporary directory renamed to `dst` at the end; `dst` is replaced only with `overwrite=True`; `src` is only
    read. Other arguments as in `convert_model` (text `calibration` is tokenised with the source's tokenizer).
    """
    src = Path(src)
    started = time.perf_counter()
    if src.is_file() and src.suffix == ".gguf":
        with atomic_directory(dst, overwrite, protect=(src,)) as tmp:
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            converted = convert_model(model, method, heads, head_fraction, calibration, tokenizer, anneal_steps,
                                      noise_init, progress)
            converted.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        return Path(dst)

    source = CheckpointDir(src)
    source_config = AutoConfig.from_pretrained(src, local_files_only=True)
    if isinstance(calibration, str):
        calibration = calibration_ids_from(calibration, AutoTokenizer.from_pretrained(src, local_files_only=True))
    # Check every tensor (headers only) and choose the heads before the destination is touched.
    headers = ((name, shape, dtype, file)
               for file in source.files for name, (shape, dtype) in source.headers(file).items())
    mapping = _plan(source_config, method, heads, head_fraction, calibration, anneal_steps, noise_init,
                    source.get, progress, headers, str(src))

    with atomic_directory(dst, overwrite, protect=(src,)) as tmp:
        _convert_directory(source, tmp, mapping, progress)
        mapping.config.save_pretrained(tmp)
        for path in src.iterdir():  # tokenizer, generation config, chat template, ...
            if path.is_file() and path.name not in _REWRITTEN and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(path, tmp / path.name)
    if progress:
        tqdm.write(f"converted {src} -> {dst} ({method}) in {time.perf_counter() - started:.1f} s")
    return Path(dst)


__all__ = ["calibration_ids_from", "convert_checkpoint", "convert_model",
           "save_model"]
