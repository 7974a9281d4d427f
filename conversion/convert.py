"""Convert a pretrained Llama-family model into a DiffLlama (`dex` or `v2`) that starts with the same logits.

Three sources: an in-memory `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` (`convert_model`), a
local safetensors directory, single-file or sharded (`convert_checkpoint`, streamed shard by shard), and a
GGUF file (`convert_checkpoint`, dequantised by transformers, then converted in memory).
"""

import contextlib
import copy
import functools
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from modeling_diff.atomic import atomic_directory, check_destination, check_writable, save_tokenizer
from modeling_diff.checkpoint_files import (CHAT_TEMPLATE_DIR, TOKENIZER_CONFIG, TOKENIZER_READS, check_gguf,
                                            check_no_adapter, check_side_files, check_whole_read, checkpoint_root,
                                            fast_tokenizer_files, is_inside, load_tokenizer, read_json_object,
                                            side_files)
from modeling_diff.extras import require
from modeling_diff.modeling_diff_llama import DiffLlamaForCausalLM

from . import diffllama
from .calibration import chooses_heads_by_entropy, with_default_calibration
from .heads import attention_entropy, check_calibration_ids, check_head_fraction, resolve_heads, top_entropy_heads
from .mapping import (TensorMapping, check_finite, check_method, check_source_architecture, tied_as_loaded,
                      tied_renames)
from .sources import INDEX_FILE, SINGLE_FILE, CheckpointDir

logger = logging.getLogger(__name__)

DEFAULT_ANNEAL_STEPS = 1000
DEFAULT_HEAD_FRACTION = 0.5
DEFAULT_NOISE_INIT = "copy"
# Files of a checkpoint directory that are rewritten, not copied: config.json, and the weights and their index
# by these endings (of any name: config.json's transformers_weights may name an index). Every format's index: a
# stale pytorch_model.bin.index.json was carried into DST, which `export` then refused (its shards are not there).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf",
                    ".msgpack", ".msgpack.index.json", ".h5", ".h5.index.json")
# An output directory that `overwrite` may replace holds one of these (an earlier conversion, a checkpoint).
EARLIER_OUTPUT_FILES = ("config.json",)
# A tokenizer's vocabulary lives in one of these (tokenizer_config.json alone holds none).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# AutoTokenizer reads these files next to a .gguf file: tokenizer_config.json and the chat templates, and the files
# of its tokenizer class's `vocab_files_names` (a tokenizer.json there is loaded instead of the .gguf's own
# tokenizer). Checked as a folder's tokenizer files are: a tokenizer.json linking to another model's was carried
# into DST as the source's, a sparse one of 3 GiB read whole.
_GGUF_SIDE_FILES = TOKENIZER_READS
# The name of a versioned tokenizer file, as transformers' `get_fast_tokenizer_file` finds its version in it.
_VERSIONED_TOKENIZER = re.compile(r"tokenizer\.(.+)\.json")
# The dtypes a source's config.json may name: those of the tensors the converter takes (`TensorMapping.check`).
_CONFIG_DTYPES = ("float32", "float16", "bfloat16")


def save_model(model: PreTrainedModel, dst: str | Path, tokenizer=None, overwrite: bool = False) -> Path:
    """`model.save_pretrained(dst)` (and the tokenizer's), written to a temporary directory and renamed."""
    with atomic_directory(dst, overwrite, expected=EARLIER_OUTPUT_FILES) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
    return Path(dst).resolve()


# Text beyond this many characters a calibration token is never reached: no tokenizer's tokens are that long on
# average, and a whole file (gigabytes, or /dev/zero) is never read or tokenized for 512 tokens.
CHARS_PER_TOKEN_AT_MOST = 128


def calibration_ids_from(calibration, tokenizer=None, max_tokens: int = 512) -> torch.Tensor:
    """Token ids (B, L) for head calibration from ids or from text (tokenised, first `max_tokens` tokens)."""
    if isinstance(calibration, torch.Tensor):
        return calibration if calibration.ndim == 2 else calibration[None]
    if isinstance(calibration, str):
        if tokenizer is None:
            raise ValueError("calibration text needs a tokenizer: pass tokenizer=... or token ids")
        text = calibration[: max_tokens * CHARS_PER_TOKEN_AT_MOST]
        try:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
        except Exception as error:  # tokenizers' own, a bare Exception (a WordLevel vocabulary without its unk_token)
            raise ValueError(f"calibration text (--calibration-file, or the packaged text) could not be tokenised "
                             f"with the source's tokenizer: {type(error).__name__}: {error}") from error
        if ids.shape[1] < 2:
            raise ValueError(f"calibration text (--calibration-file) must give at least 2 tokens with the source's "
                             f"tokenizer (an attention row over more than one position), got {ids.shape[1]}")
        return ids
    raise ValueError(f"calibration must be text or a tensor of token ids, got {type(calibration).__name__}")


def check_arguments(method, heads, head_fraction, anneal_steps, noise_init) -> None:
    """The checks that need no model: method, noise_init, anneal_steps and (for an entropy selection) head_fraction."""
    check_method(method, anneal_steps, noise_init)
    if chooses_heads_by_entropy(method, heads):
        check_head_fraction(head_fraction)


class _Plan:
    """A conversion checked before any expensive work (its arguments by `check_arguments` first): every source
    tensor checked against the source config, the heads chosen unless an entropy calibration is still to run (in
    `mapping`)."""

    def __init__(self, source_config, method, heads, head_fraction, calibration, anneal_steps, noise_init,
                 source_tensors, source_name: str):
        """`source_tensors` yields (name, shape, dtype, where) for every tensor of the source."""
        self.args = (source_config, method, anneal_steps, noise_init)
        self.unselected = TensorMapping.for_source(source_config, method, None, anneal_steps, noise_init)
        kept = [name for name, shape, dtype, where in source_tensors if self.unselected.check(name, shape, dtype, where)]
        self.unselected.check_complete(kept, source_name)
        self.head_fraction = head_fraction
        self.dex_heads = _chosen_heads(self.unselected.config, method, heads, calibration)
        self.calibration = calibration if method == "dex" and self.dex_heads is None else None

    def mapping(self, get_tensor, progress: bool) -> TensorMapping:
        """The TensorMapping of the converted model, after the entropy calibration if one is needed (the
        expensive step: it runs the source model layer by layer)."""
        if self.dex_heads is None and self.calibration is not None:
            entropy = attention_entropy(get_tensor, self.unselected, self.calibration, progress)
            self.dex_heads = top_entropy_heads(entropy, self.head_fraction)
        source_config, method, anneal_steps, noise_init = self.args
        return TensorMapping.for_source(source_config, method, self.dex_heads, anneal_steps, noise_init)


def _chosen_heads(config, method: str, heads, calibration) -> list[list[int]] | None:
    """DEX's heads per layer as `heads` names them for a model of `config` (its layer and head counts), None where
    none are named (`method` "v2") or an entropy calibration will choose them, which then needs `calibration` (token
    ids, checked against the vocabulary); a ValueError otherwise."""
    if method != "dex":
        if heads is not None:
            raise ValueError(f"heads applies to method='dex' only; method={method!r} converts every head")
        return None
    chosen = resolve_heads("entropy" if heads is None else heads, config.num_hidden_layers, config.num_attention_heads)
    if chosen is None:
        if calibration is None:
            raise ValueError("heads='entropy' (the default for method='dex') needs calibration text or token ids: "
                             "pass calibration=... (--calibration-file), or choose heads='all' or a list")
        check_calibration_ids(calibration, config.vocab_size)
    return chosen


def convert_model(
    model: PreTrainedModel,
    method: str = "dex",
    heads=None,
    head_fraction: float = DEFAULT_HEAD_FRACTION,
    calibration: torch.Tensor | str | None = None,
    tokenizer=None,
    anneal_steps: int = DEFAULT_ANNEAL_STEPS,
    noise_init: str = DEFAULT_NOISE_INIT,
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
    check_arguments(method, heads, head_fraction, anneal_steps, noise_init)
    # only an entropy selection reads it (a text's tokenizer is not needed otherwise)
    calibration = calibration_ids_from(calibration, tokenizer) if (
        calibration is not None and chooses_heads_by_entropy(method, heads)) else None
    plan = _Plan(tied_as_loaded(model.config, state, state.__getitem__), method, heads, head_fraction, calibration,
                 anneal_steps, noise_init, ((n, t.shape, t.dtype, "the source model") for n, t in state.items()),
                 "the source model")
    mapping = plan.mapping(state.__getitem__, progress)
    converted = {}
    for name, tensor in state.items():
        if mapping.check(name, tensor.shape, tensor.dtype, "the source model"):
            check_finite(name, tensor, "the source model")
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
    carry_rotary_state(model, result)
    result.config._attn_implementation = model.config._attn_implementation
    result.generation_config = copy.deepcopy(model.generation_config)
    return result.train(model.training)


def carry_rotary_state(source: PreTrainedModel, result: DiffLlamaForCausalLM) -> None:
    """The source's RoPE as it computes now, not as a new model would: its inverse frequencies are a buffer outside
    the state dict, which `.to(torch.bfloat16)` or `.half()` casts (the source then rotates with rounded frequencies:
    a fresh float32 copy gave logits 0.19 off a bfloat16 Llama's) and dynamic RoPE rewrites as it meets longer
    sequences, with its scaling and cached length beside them."""
    source_rotary = getattr(getattr(source, "model", None), "rotary_emb", None)
    if source_rotary is None:
        return
    rotary = result.model.rotary_emb
    for name, buffer in source_rotary.named_buffers(recurse=False):
        own = rotary._buffers.get(name)
        if own is not None and own.shape == buffer.shape:
            rotary._buffers[name] = buffer.detach().to(own.device, copy=True)
    for name in ("attention_scaling", "max_seq_len_cached", "original_max_seq_len"):
        if hasattr(source_rotary, name):
            setattr(rotary, name, getattr(source_rotary, name))


def _convert_directory(source: CheckpointDir, tmp: Path, mapping: TensorMapping, progress: bool) -> None:
    """Stream the shards of `source` through `mapping` into `tmp`; one shard in memory at a time. The output's files
    have save_pretrained's names (model.safetensors, or model-0000i-of-0000n.safetensors and the index), whatever the
    source's were: a shard named model.safetensors, which an index named in config.json's transformers_weights may
    list, beside the output's index was loaded alone (the other shards' tensors missing)."""
    anchors = {mapping.extras_anchor(layer_idx): layer_idx for layer_idx in range(mapping.config.num_hidden_layers)}
    count = len(source.files)
    output_files = {file: f"model-{i:05d}-of-{count:05d}.safetensors" if source.is_sharded else SINGLE_FILE
                    for i, file in enumerate(sorted(source.files), start=1)}  # (save_pretrained's shards keep theirs)
    weight_map, total_size = {}, 0
    for file in tqdm(source.files, desc="converting shards", unit="shard", disable=not progress):
        converted = {}
        for name, tensor in source.read_shard(file).items():
            if not mapping.check(name, tensor.shape, tensor.dtype, file):
                continue
            check_finite(name, tensor, file)
            converted.update(mapping.convert(name, tensor))
            if name in anchors:
                converted.update(mapping.layer_extras(anchors[name], tensor.dtype))
        if converted:
            save_file(converted, tmp / output_files[file], metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(converted, output_files[file]))
        total_size += sum(t.numel() * t.element_size() for t in converted.values())
        del converted
    if source.is_sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    method: str | None = None,
    heads=None,
    head_fraction: float | None = None,
    calibration: torch.Tensor | str | None = None,
    anneal_steps: int | None = None,
    noise_init: str | None = None,
    overwrite: bool | str = False,
    progress: bool = True,
    to: str = "diff_llama",
) -> Path:
    """Convert the checkpoint at `src` and write the DiffLlama checkpoint to directory `dst`; returns `dst`
    (absolute).

    `src` is a local transformers directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json), converted shard by shard so that memory stays near the largest shard, or a
    `.gguf` file (dequantised to float32 in memory). Tokenizer and generation files are carried over (links that
    lead out of `src` are skipped with a warning). Every argument and every source tensor is checked before the
    calibration runs or anything is written; the output is written to a temporary directory renamed to `dst` at the
    end (`modeling_diff.atomic.atomic_directory`); a non-empty `dst` is replaced only with `overwrite=True` when it
    holds a config.json, any with `overwrite="force"`; `src` is only read. Other arguments as in `convert_model`
    (None: its default, `method` "dex"; text `calibration` is tokenised with the source's tokenizer; without any,
    DEX's entropy heads are chosen on the packaged text, `calibration.py`). A source that from_pretrained would load
    otherwise than its weights (a PEFT adapter beside them) or whose weights are not finite is refused.

    A transformers `diffllama` checkpoint converts to an exact V1, and our V1 with `to="diffllama"` to transformers'
    DiffLlama (`diffllama.py`); `method`, `heads`, `head_fraction`, `calibration`, `anneal_steps` and `noise_init`
    are then left unset.
    """
    src = Path(src)
    is_gguf = src.is_file() and src.suffix == ".gguf"
    protect = _protected(src, is_gguf)
    started = time.perf_counter()
    between_diffllamas = diffllama.applies(src, to)
    if between_diffllamas:
        diffllama.check_unset(to, method=method, heads=heads, head_fraction=head_fraction, calibration=calibration,
                              anneal_steps=anneal_steps, noise_init=noise_init)
    else:
        method = method or "dex"
        head_fraction = DEFAULT_HEAD_FRACTION if head_fraction is None else head_fraction
        anneal_steps = DEFAULT_ANNEAL_STEPS if anneal_steps is None else anneal_steps
        noise_init = noise_init or DEFAULT_NOISE_INIT
        check_arguments(method, heads, head_fraction, anneal_steps, noise_init)
        calibration = with_default_calibration(method, heads, calibration, progress)
    if is_gguf:
        require("gguf", f"converting the .gguf file {src.name}")
        try:
            check_gguf(src)
        except ValueError as error:
            raise ValueError(f"source {error}") from None
        check_side_files(src.parent, _GGUF_SIDE_FILES)
        check_no_adapter(src.parent)  # from_pretrained(src.parent, gguf_file=...) would apply it
        # transformers' bars off for the whole conversion where progress is off (5.17 shows one while it builds a
        # GGUF tokenizer's merges, before the model is loaded)
        with _transformers_bars(progress):
            # The family, the output's config and the tensors the file must hold, the tokenizer (from the file's
            # metadata, in a moment; the output needs it), the heads and the calibration against the metadata, then
            # the destination: all before the model is dequantised.
            source_config = _source_config(src.parent, gguf_file=src.name)
            check_source_architecture(source_config)
            # The output's DiffLlamaConfig, built (and so validated) now: a rope_freq_base below 1 or anneal_steps
            # beyond its bound was refused only after dequantising, beside DST's lock and staging.
            expected = TensorMapping.for_source(source_config, method, None, anneal_steps, noise_init)
            tokenizer = load_tokenizer(src.parent, " from the file's tokenizer.ggml.* metadata", gguf_file=src.name)
            if isinstance(calibration, str) and chooses_heads_by_entropy(method, heads):
                calibration = calibration_ids_from(calibration, tokenizer)
            _chosen_heads(source_config, method, heads, calibration)
            _check_gguf_tensors(src, source_config, expected)
            dst = _checked_destination(dst, overwrite, protect)
            with atomic_directory(dst, overwrite, protect=protect, expected=EARLIER_OUTPUT_FILES) as tmp:
                try:  # a file gguf's reader parses whose tensors do not match its metadata fails in transformers
                    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32,
                                                                 local_files_only=True)
                except RuntimeError as error:
                    raise ValueError(f"source {str(src)!r} could not be loaded as a model: {error}") from None
                converted = convert_model(model, method, heads, head_fraction, calibration, tokenizer, anneal_steps,
                                          noise_init, progress)
                converted.save_pretrained(tmp)
                save_tokenizer(tokenizer, tmp)
            return dst

    # Everything that can be refused is refused here, before the destination is touched or the calibration runs.
    source = CheckpointDir(src)
    _check_raw_source_config(source.config, src)
    source_config = _source_config(src)
    if not between_diffllamas:
        check_source_architecture(source_config)
    source.load_as(tied_renames(source_config, source.weight_map))  # the tensors as from_pretrained(src) names them
    source_config = tied_as_loaded(source_config, source.weight_map, source.get)
    if isinstance(calibration, str) and chooses_heads_by_entropy(method, heads):
        calibration = calibration_ids_from(calibration, _source_tokenizer(src))
    headers = ((name, shape, dtype, file)
               for file in source.files for name, (shape, dtype) in source.headers(file).items())
    if between_diffllamas:
        plan = diffllama.DiffLlamaPlan(source_config, to, headers, str(src))
    else:
        plan = _Plan(source_config, method, heads, head_fraction, calibration, anneal_steps, noise_init, headers,
                     str(src))
    carried = _carried_files(source)
    tokenizer_config, versioned = _versioned_tokenizers(source, carried)
    carried += versioned
    dst = _checked_destination(dst, overwrite, protect)

    with atomic_directory(dst, overwrite, protect=protect, expected=EARLIER_OUTPUT_FILES) as tmp:
        mapping = plan.mapping(source.get, progress)
        _convert_directory(source, tmp, mapping, progress)
        # Our class's name, and transformers' own (the to="diffllama" target): loaders such as TRL's read it.
        mapping.config.architectures = [DiffLlamaForCausalLM.__name__]
        mapping.config.save_pretrained(tmp)
        for path in carried:
            (tmp / path.relative_to(source.path)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, tmp / path.relative_to(source.path))
        if tokenizer_config is not None:
            (tmp / TOKENIZER_CONFIG).write_bytes(tokenizer_config)
    if progress:
        target = getattr(mapping.config, "diff_mode", mapping.config.model_type)
        tqdm.write(f"converted {src} -> {dst} ({target}) in {time.perf_counter() - started:.1f} s")
    return dst


@contextlib.contextmanager
def _transformers_bars(progress: bool):
    """transformers' own progress bars (dequantising a .gguf, loading, writing shards) off for the block where
    `progress` is off: `--quiet` ("no progress bars") showed three of them for a .gguf SRC. The dequantising one is
    a plain tqdm of transformers' GGUF module, which its progress-bar switch does not reach."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    if progress:
        yield
        return
    shown, gguf_bar = transformers_logging.is_progress_bar_enabled(), getattr(gguf_loading, "tqdm", None)
    transformers_logging.disable_progress_bar()
    if gguf_bar is not None:
        gguf_loading.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        if gguf_bar is not None:
            gguf_loading.tqdm = gguf_bar
        if shown:
            transformers_logging.enable_progress_bar()


def _protected(src: Path, is_gguf: bool) -> tuple[Path, ...]:
    """What DST may not be, contain or lie inside: SRC, and for a Hub cache snapshot its repository folder, whose
    blobs/ the snapshot's files link into. For a .gguf SRC that folder is found from the file's folder, as it is named
    (`models--o--n/snapshots/<rev>/`): the file itself resolves into blobs/, where no snapshot shows, and DST was
    allowed onto refs/ or another snapshot. The folder of a .gguf outside a cache is no part of the source (an
    output may go beside the file)."""
    if not is_gguf:
        return src, checkpoint_root(src)
    root = checkpoint_root(src.parent)
    return (src, root) if root != src.parent.resolve() else (src,)


def _checked_destination(dst, overwrite, protect: tuple[Path, ...]) -> Path:
    """DST, resolved, refused now if `atomic_directory` would refuse it or could not replace it: an immutable (or
    otherwise unreplaceable) earlier output with `overwrite` was refused only after the calibration and the whole
    conversion, by the final rename."""
    checked = check_destination(dst, overwrite, protect=protect, expected=EARLIER_OUTPUT_FILES)
    check_writable(checked)
    return checked


def _check_gguf_tensors(src: Path, source_config, expected: TensorMapping) -> None:
    """Every tensor the source model needs must be in the GGUF file `src`, compared by name before it is dequantised
    by transformers' rule (`get_gguf_hf_weights_map`: gguf's tensor name map for the model type, on the name without
    its .weight / .bias): transformers loads a file missing one (say blk.1.ffn_down.weight) with that tensor left at
    its random start and only prints a report, and the random weights were converted (exit 0)."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == source_config.model_type), None)
    if arch is None:  # transformers cannot map it either (it refuses to load it)
        return
    name_map = get_tensor_name_map(arch, source_config.num_hidden_layers)
    held = {tensor.name for tensor in GGUFReader(src).tensors}
    missing = {}
    for name in sorted(expected.source_shapes):
        stem, _, suffix = name.rpartition(".")
        gguf_name = name_map.get_name(stem)  # None: transformers finds no tensor for it either
        if gguf_name is None or f"{gguf_name}.{suffix}" not in held:
            missing[name] = f"{gguf_name}.{suffix}" if gguf_name else "no GGUF name"
    if missing:
        shown = ", ".join(f"{name!r} ({gguf_name})" for name, gguf_name in list(missing.items())[:5])
        shown += f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"tensor {shown} missing from the GGUF file {str(src)!r}: transformers would leave it at "
                         f"random; every tensor of a {source_config.num_hidden_layers}-layer model is needed")


def _check_raw_source_config(config: dict, src: Path) -> None:
    """What config.json must hold before transformers builds a config of it. The head counts: positive integers
    (transformers divides by them: 0 was "integer modulo by zero", naming no field). The dtype it names (`dtype`,
    or its legacy name `torch_dtype`), carried into the output, which `from_pretrained(dtype="auto")` loads in: one
    of the tensors' dtypes the converter takes. An integer one ("int8") was carried and the output did not load
    ("not a floating-point dtype")."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        value = config.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"config.json in {str(src)!r}: {field} must be a positive integer, got {value!r}")
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if value is not None and (not isinstance(value, str) or value.removeprefix("torch.") not in _CONFIG_DTYPES):
            raise ValueError(f"config.json in {str(src)!r}: {field} must be float32, float16 or bfloat16 (what the "
                             f"output loads in with dtype=\"auto\"), or absent, got {value!r}")


def _source_config(src: Path, gguf_file: str | None = None):
    """SRC's config (or that in the metadata of `gguf_file` in SRC), without running code of SRC's (an `auto_map` in
    its config.json: transformers would offer to)."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False, **kwargs)
    except Exception as error:  # transformers raises ValueError, KeyError, TypeError or @strict's own errors here
        what = f"the metadata of {gguf_file}" if gguf_file else "config.json"
        raise ValueError(f"{what} in {str(src)!r} is not a valid transformers config: {error}") from error


def _source_tokenizer(src: Path):
    """The source's tokenizer, for calibration text; a ValueError saying what is missing otherwise."""
    check_side_files(src, TOKENIZER_READS)
    if not any((src / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"calibration text needs the source's tokenizer, but {str(src)!r} holds none of "
                         f"{', '.join(_TOKENIZER_FILES)}: add the tokenizer files or pass token ids")
    return load_tokenizer(src, " for the calibration text")


def _carried_files(source: CheckpointDir) -> list[Path]:
    """The files copied unchanged (tokenizer, generation config, chat templates, the named ones in their folder,
    ...). A link that leads out of the checkpoint is skipped with a warning: what it points to is not part of the
    checkpoint (`tokenizer.json -> /etc/passwd`). Links inside it (a Hub cache snapshot's links to its blobs) are
    followed. A tokenizer or generation config that transformers could not read whole is refused: the output would
    not load."""
    carried = []
    read_whole = side_files(source.path)
    folders = (source.path, source.path / CHAT_TEMPLATE_DIR)
    for path in (path for folder in folders if folder.is_dir() for path in sorted(folder.iterdir())):
        if not path.is_file() or path.name == "config.json" or path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if not is_inside(path, source.root):
            logger.warning(f"skipped {path.relative_to(source.path)}: it is a link to {str(path.resolve())!r}, "
                           f"outside the source checkpoint {str(source.root)!r}")
            continue
        if path.name == "generation_config.json":  # a JSON list was carried, and the output did not load
            read_json_object(path)
        elif path in read_whole:
            check_whole_read(path)
        carried.append(path)
    return carried


def _versioned_tokenizers(source: CheckpointDir, carried: list[Path]) -> tuple[bytes | None, list[Path]]:
    """The carried tokenizer_config.json rewritten where its `fast_tokenizer_files` must change (its bytes; None to
    copy it unchanged), and the files those entries name that the top-level copy does not carry.

    transformers reads the entry for its version by a name relative to the folder, a subfolder's or `..` included.
    An entry leading out of the source (`../other/tokenizer.4.0.json`, or through a link) would make the output
    read another folder's tokenizer as its own: it is dropped with a warning, as a link out is skipped (the output
    falls back on the entries and the tokenizer.json it holds). An entry inside is kept under its plain name
    (`./v/../v/tokenizer.4.0.json` -> `v/tokenizer.4.0.json`, no `.` or `..` for the output to resolve) and its
    file, in a subfolder too, is carried."""
    if source.path / TOKENIZER_CONFIG not in carried:
        return None, []
    names = fast_tokenizer_files(source.path)
    kept, files = [], []
    for name in names:
        plain = Path(os.path.normpath(name))
        if plain.is_absolute() or plain.parts[:1] == ("..",) or not all(
                is_inside(path, source.root) for path in (source.path / name, source.path / plain)):
            logger.warning(f"dropped {name} from fast_tokenizer_files of the copied {TOKENIZER_CONFIG}: it leads to "
                           f"{str((source.path / name).resolve())!r}, outside the source checkpoint "
                           f"{str(source.root)!r}")
            continue
        kept.append(plain.as_posix())
        # Only what transformers takes for a versioned tokenizer: an entry naming `config.json` or the weights
        # (which it ignores) would otherwise be copied over the converted ones.
        if (_VERSIONED_TOKENIZER.fullmatch(plain.name) and (source.path / plain).exists()
                and source.path / plain not in carried):
            check_whole_read(source.path / plain)
            files.append(source.path / plain)
    if kept == names:
        return None, files
    return _rewritten_tokenizer_config(source.path, kept), files


def _rewritten_tokenizer_config(path: Path, fast_tokenizer_files: list[str]) -> bytes:
    """The bytes of the tokenizer_config.json of checkpoint `path` with `fast_tokenizer_files` in place of its own,
    made now, before the calibration and DST: a string holding a lone surrogate (the JSON escape "\\udc80", which
    Python reads) cannot be written as UTF-8, and failed after the whole conversion, naming no file."""
    config = {**read_json_object(path / TOKENIZER_CONFIG), "fast_tokenizer_files": fast_tokenizer_files}
    try:
        return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{TOKENIZER_CONFIG} in {str(path)!r} must be rewritten (its fast_tokenizer_files), but a "
                         f"string in it holds a lone surrogate ({error.object[error.start:error.end]!r}, a \\u "
                         f"escape of half a character), which UTF-8 cannot hold: remove it") from None


__all__ = ["calibration_ids_from", "convert_checkpoint", "convert_model", "save_model"]
