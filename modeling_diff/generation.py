"""Greedy generation with a StaticCache in which every decoding step is one CUDA graph replay (gpt-fast's
whole-step graph).

With `cache_implementation="static"`, transformers' `generate` compiles the forward (torch.compile,
"reduce-overhead") and runs its decoding loop around it: per token the loop's Python (input preparation, logits
processors, stopping criteria) and a synchronisation for the stopping check, which at ~1B parameters cost about as
much as the step itself (benchmarks/RESULTS.md). Where the generation is plain greedy decoding,
`DiffLlamaForCausalLM.generate` takes this path instead: the whole step (forward, greedy choice, the minimum-length
rule, EOS bookkeeping with the pad token on finished rows, the mask and position of the next token) is captured
once in a CUDA graph and replayed, with a look at "all rows finished?" every `STOP_CHECK_EVERY` steps. The tokens
are transformers' greedy tokens (tests/test_generation.py); everything else takes transformers' `generate`.

The graph, its StaticCache and buffers are kept for the model's next call of the same shape, beside the model (not
in it: `copy.deepcopy(model)` and pickling stay as they were), and rebuilt when the shape, the parameters'
storage or the attention implementation change; they go with the model, or with `release_graph(model)`.
"""

import weakref

import torch
from transformers import GenerationConfig, StaticCache

from .kernels import greedy_step, greedy_tokens, runs_own_forward

STOP_CHECK_EVERY = 16  # replays between two looks at "all rows finished?" (each one a synchronisation)

# GenerationConfig fields that may differ from their defaults here: the lengths and special tokens, which this path
# implements; the sampling parameters, which greedy decoding ignores (as transformers' does); bookkeeping.
HANDLED_FIELDS = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id", "pad_token_id", "bos_token_id",
    "decoder_start_token_id", "cache_implementation", "use_cache", "temperature", "top_k", "top_p", "min_p",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "compile_config", "transformers_version", "_from_model_config",
})
# Attention implementations that read a boolean 4-D mask (True = visible), which the graph updates in place.
BOOLEAN_MASK_IMPLEMENTATIONS = ("sdpa", "diff_triton", "fused_diff")
# A field is at its default when it equals GenerationConfig's (often None) or the global default that
# generate fills in for None (`_get_default_generation_params`: num_beams 1, repetition_penalty 1.0, ...).
_DEFAULTS = GenerationConfig().to_dict()
_GLOBAL_DEFAULTS = GenerationConfig._get_default_generation_params()


def _plain_greedy(config: GenerationConfig) -> bool:
    """Whether `config` asks for nothing but greedy decoding with a StaticCache: every other field at its default."""
    if config.cache_implementation != "static" or config.do_sample or config.num_beams != 1:
        return False
    settings = config.to_dict()
    return all(
        settings.get(name) in (default, _GLOBAL_DEFAULTS.get(name, default))
        or (default is None and settings.get(name) is False)  # output_attentions=False from the model's config
        for name, default in _DEFAULTS.items()
        if name not in HANDLED_FIELDS and name not in ("do_sample", "num_beams")
    )


def graphable(model) -> bool:
    """Whether a replayed graph computes what the model's forward computes: in eval mode, on one device, plain
    parameters (no DTensor, no PEFT layers), no Python hooks and no forward bound on a module's instance (a graph
    runs neither: `runs_own_forward`), a boolean-mask implementation. (The caller checks the device is CUDA.)"""
    parameters = list(model.parameters())
    return (
        not model.training
        and model.config._attn_implementation in BOOLEAN_MASK_IMPLEMENTATIONS
        and all(type(p) is torch.nn.Parameter for p in parameters)
        and len({p.device for p in parameters}) == 1
        and all(
            runs_own_forward(m) and not hasattr(m, "base_layer") and not hasattr(m, "_hf_hook")
            for m in model.modules()
        )
    )


def off_the_default_stream(fn):
    """fn() on a side stream, the default stream waiting for it: the eager warm-up before a CUDA graph capture, as
    torch.cuda.graph wants it (kernels compiled, cuBLAS set up, off the stream the capture records)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = fn()
    torch.cuda.current_stream().wait_stream(side)
    return result


class GreedyStepGraph:
    """A StaticCache of (batch, max_cache_len) and the buffers of one greedy decoding step, which `capture` puts in a
    CUDA graph. Shapes: B = batch, S = max_cache_len, N = the most new tokens, E = the EOS ids."""

    def __init__(self, model, batch: int, max_cache_len: int, eos_count: int, device: torch.device):
        self.model = weakref.proxy(model)  # so that the kept graph does not keep its model alive
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        long = dict(dtype=torch.long, device=device)
        self.token = torch.zeros(batch, 1, **long)  # the token the next forward reads
        self.position = torch.zeros(batch, 1, **long)  # its position id
        self.visible = torch.zeros(batch, 1, 1, max_cache_len, dtype=torch.bool, device=device)  # its mask
        # (generated: tokens chosen so far, min_generated: EOS is suppressed while generated < this, cache_index:
        # the next token's slot in the cache, pad), one buffer for the kernel (`greedy_step`), a view each
        self.counters = torch.zeros(4, **long)
        self.generated, self.min_generated, self.cache_index, self.pad = (self.counters[i:i + 1] for i in range(4))
        self.eos = torch.zeros(eos_count, **long)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, max_cache_len, **long)  # (B, N): the chosen tokens, N <= S
        self.alive = torch.ones(max_cache_len, dtype=torch.bool, device=device)  # (N,) any row unfinished after each
        self.graph = None

    def choose(self, scores: torch.Tensor) -> None:
        """Record the greedy choice of the scores (B, V) of the last position, as transformers' greedy search with
        its minimum-length processors and EOS stopping makes it, and set up the next step's inputs: in the choice's
        one launch where the kernel applies (`kernels.greedy_step`; about fifteen launches fewer a step), else
        `record`."""
        if not greedy_step(
            scores, token=self.token, position=self.position, visible=self.visible, counters=self.counters,
            eos=self.eos, unfinished=self.unfinished, chosen=self.tokens, alive=self.alive, owner=self,
        ):
            self.record(scores)

    def record(self, scores: torch.Tensor) -> None:
        """`choose` in PyTorch operations (the kernel's reference)."""
        if self.eos.numel():
            suppressed = self.generated < self.min_generated  # (1,)
            eos_scores = scores.index_select(1, self.eos)
            scores = scores.index_copy(1, self.eos, torch.where(suppressed, float("-inf"), eos_scores))
        chosen = greedy_tokens(scores, owner=self)  # (B,): argmax in one launch (the model's dtype: the same order)
        if self.eos.numel():
            chosen = torch.where(self.unfinished, chosen, self.pad)
            self.unfinished &= ~torch.isin(chosen, self.eos)
        self.tokens.index_copy_(1, self.generated, chosen[:, None])
        self.alive.index_copy_(0, self.generated, self.unfinished.any()[None])
        self.generated += 1
        self.token.copy_(chosen[:, None])
        self.position += 1
        self.cache_index += 1
        self.visible.index_fill_(-1, self.cache_index, True)  # the new token sees itself and everything before

    def step(self) -> None:
        logits = self.model(
            self.token, attention_mask=self.visible, position_ids=self.position, cache=self.cache,
            use_cache=True,
        ).logits  # (B, 1, V)
        self.choose(logits[:, -1])

    def capture(self) -> None:
        """One eager step off the default stream (it compiles the kernels; a real step of this generation), then
        the graph of the next one (recorded, not run)."""
        off_the_default_stream(self.step)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def prefill(self, input_ids, attention_mask, eos, pad: int, min_generated: int) -> None:
        """Reset the cache and buffers in place (the graph reads them), run the prompt through the model, choose the
        first token."""
        batch, prompt_len = input_ids.shape
        self.cache.reset()
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # as transformers'
        self.position.copy_(positions[:, -1:])
        self.visible.zero_()
        self.visible[:, 0, 0, :prompt_len] = attention_mask.bool()
        self.cache_index.fill_(prompt_len - 1)
        self.generated.zero_()
        self.min_generated.fill_(min_generated)
        self.eos.copy_(torch.as_tensor(eos, dtype=torch.long))
        self.pad.fill_(pad)
        self.unfinished.fill_(True)
        self.alive.fill_(True)
        logits = self.model(
            input_ids, attention_mask=attention_mask, position_ids=positions, cache=self.cache,
            use_cache=True, logits_to_keep=1,
        ).logits
        self.choose(logits[:, -1])

    def run(self, new_tokens: int, capture: bool = True) -> torch.Tensor:
        """Generate after `prefill`: -> the chosen tokens (B, n), n <= new_tokens, cut after the step that finished
        the last row. `capture=False` runs the steps eagerly (CPU; the reference of the graph in tests)."""
        done = 1
        while done < new_tokens:
            if done % STOP_CHECK_EVERY == 0 and self.eos.numel() and not self.unfinished.any():
                break
            if not capture:
                self.step()
            elif self.graph is None:
                self.capture()  # the eager step it runs is this iteration's step
            else:
                self.graph.replay()
            done += 1
        alive = self.alive[:done].tolist()
        length = alive.index(False) + 1 if False in alive else done
        return self.tokens[:, :length].clone()


# Each model's kept graph; an entry goes with its model (weak keys; the graph holds the model through a weak proxy).
_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, GreedyStepGraph]" = weakref.WeakKeyDictionary()


def release_graph(model) -> None:
    """Free the graph, StaticCache and buffers kept for `model`'s next greedy static-cache generation."""
    _GRAPHS.pop(model, None)


def _key(model, batch: int, max_cache_len: int, eos_count: int) -> tuple:
    """What a graph depends on besides its buffers: the shapes, the parameters' and buffers' storage (a `.to()`, a
    reload or new weights move it) and the attention implementation."""
    storage = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    return batch, max_cache_len, eos_count, storage, model.config._attn_implementation


def graphed_greedy_generate(model, inputs, generation_config, kwargs: dict, capture: bool | None = None):
    """`model.generate(inputs, generation_config, **kwargs)` through the whole-step graph, or None where this path
    does not apply (then transformers' generate runs). `capture` (default: on CUDA) replays a CUDA graph."""
    input_ids = kwargs.get("input_ids", inputs)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or (inputs is not None and "input_ids" in kwargs):
        return None
    if capture is None:
        if not (input_ids.is_cuda and model.device == input_ids.device and graphable(model)):
            return None
        capture = True
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    model_kwargs.pop("input_ids", None)
    if model_kwargs or not _plain_greedy(config) or getattr(config, "disable_compile", False):
        return None  # other model inputs (a cache, embeddings, processors, a streamer...) or another strategy
    batch, prompt_len = input_ids.shape
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len
    if new_tokens < 1:
        return None  # transformers' generate explains
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        return None  # transformers' generate refuses it (a 3-D mask was a RuntimeError inside the graph's prefill)
    if attention_mask is None:
        if config.pad_token_id is not None and config.pad_token_id not in eos and (input_ids == pad).any():
            return None  # transformers infers a padding mask here
        attention_mask = torch.ones_like(input_ids)
    min_generated = max(config.min_new_tokens or 0, (config.min_length or 0) - prompt_len)
    with torch.no_grad():
        key = _key(model, batch, prompt_len + new_tokens, len(eos))
        steps = _GRAPHS.get(model)
        if steps is None or steps.key != key:
            release_graph(model)  # free the previous graph's memory first
            steps = GreedyStepGraph(model, batch, prompt_len + new_tokens, len(eos), input_ids.device)
            steps.key = key
            _GRAPHS[model] = steps  # captured by its first `run` with `capture`
        steps.prefill(input_ids, attention_mask.to(input_ids.device), eos, pad, min_generated)
        return torch.cat([input_ids, steps.run(new_tokens, capture)], dim=-1)
