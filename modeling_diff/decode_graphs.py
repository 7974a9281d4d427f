"""Decoding steps with a DynamicCache (what `generate()` uses by default) as piecewise CUDA graphs.

An eager decoding step of the ~1.1B models issues a few hundred launches for 1.5 ms (batch 1) to 4 ms (batch 32)
of GPU work, and the host needs 13-24 ms to issue them (benchmarks/RESULTS.md): the step is bound by Python and
launch overhead. A DynamicCache grows by a concatenation every step, so the whole step cannot be one graph (gpt-fast's
graph needs a StaticCache, `generation.py`). Everything but the cache is the same every step, though: each layer's
norm, projections and RoPE, and after the attention its o_proj, residual add, norm and MLP. Those are captured once
per shape as CUDA graphs, cut where the cache is (vLLM's piecewise graphs):

    embeddings, RoPE's cos and sin (eager; copied into the graphs' inputs)
    graph 0:      layer 0's norm, projections, RoPE                         -> q, k, v (and V2's lambda_proj(x))
    eager:        layer 0's cache.update and decode-kernel attention (`decode_heads`) -> heads, in graph 1's input
    graph i:      layer i-1's o_proj, add + norm, MLP, add; layer i's norm, projections, RoPE (where down_proj
                  does not add the residual in its pass, the add is in the pass of layer i's norm)
    eager:        layer i's cache.update and attention ...
    graph L:      layer L-1's o_proj ... MLP, add; the final norm          -> the last hidden state (a copy)

A step then costs the host L + 1 graph launches, L cache updates and L two-kernel attention calls. The graphs run the
same kernels on the same shapes as the eager step, so the outputs are the eager step's (tests/test_decode_graphs.py).

They apply to a decoding step (one new token per row) of a model in eval mode on CUDA, without gradients, outside
torch.compile, with a DynamicCache already holding tokens, where the decode kernel takes every layer; not where
outputs of the layers are asked for (attentions, hidden states), a module has hooks, or parameters are not plain
(PEFT, DTensor, several devices: `generation.graphable`). Set `model.model.decode_graphs = False` to turn them off.
The graphs and their buffers are kept beside the model for its next step of the same shape, rebuilt when the batch,
the mask's kind, the attention implementation, the modules, their hooks or forwards, or the parameters' storage
change (`ModelSnapshot`), and freed with the model or `release_decode_graphs`.
"""

import operator
import weakref

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .generation import graphable, off_the_default_stream
from .kernels import GLOBAL_MODULE_HOOKS, has_extra_options, resolve


def segment(model, index: int, residual: torch.Tensor, heads: torch.Tensor | None, position_embeddings, implementation):
    """Piece `index` of a step (see the module docstring): for index > 0 layer index-1 from its attention heads
    (B, L, h, dv) on, then layer `index` up to its attention's inputs -> (residual, q, k, v, side); the last piece
    -> (the final norm's output,)."""
    pending = None  # layer index-1's update, added to its residual in the next norm's pass
    if index > 0:
        layer = model.layers[index - 1]
        residual, pending = layer.after_attention(residual, layer.self_attn.output(heads))
    if index == len(model.layers):
        return (model.final_norm(residual, pending),)
    layer = model.layers[index]
    residual, hidden_states = layer.before_attention(residual, pending)
    query, key, value, side = layer.self_attn.project(implementation, hidden_states, position_embeddings)
    return residual, query, key, value, side


def attend(model, index: int, pieces, attention_mask, cache, kwargs, implementation, out=None) -> torch.Tensor:
    """Layer `index`'s attention of a step, outside the graphs: the cache updated, -> the heads (B, L, h, dv), in
    `out` where given (the next graph's input)."""
    _, query, key, value, side = pieces
    return model.layers[index].self_attn.decode_heads(
        implementation, query, key, value, side, attention_mask, cache, kwargs, out
    )


def eager_step(model, hidden_states, position_embeddings, attention_mask, cache, kwargs, implementation,
               heads: list | None = None):
    """A decoding step through the pieces without graphs: the model's decoding step, cut as the graphs cut it.
    -> the final norm's output, or None (the cache untouched) where the decode kernel does not take every layer;
    `heads` (a list) gets each layer's heads."""
    pieces = segment(model, 0, hidden_states, None, position_embeddings, implementation)
    _, query, key, value, side = pieces
    if not all(
        layer.self_attn.decode_applies(implementation, query, key, value, attention_mask, kwargs)
        for layer in model.layers
    ):
        return None
    for index in range(len(model.layers)):
        layer_heads = attend(model, index, pieces, attention_mask, cache, kwargs, implementation)
        if heads is not None:
            heads.append(layer_heads)
        pieces = segment(model, index + 1, pieces[0], layer_heads, position_embeddings, implementation)
    return pieces[0]


class DecodeGraphs:
    """The graphs of one step shape (batch B, L new tokens) and their buffers: the inputs (embeddings, cos, sin, the
    heads of each layer) and the outputs each graph writes."""

    def __init__(self, model, hidden_states, position_embeddings, heads: list[torch.Tensor]):
        self.model = weakref.proxy(model)
        self.pool = torch.cuda.graph_pool_handle()
        self.hidden_states = torch.empty_like(hidden_states)
        self.position_embeddings = tuple(torch.empty_like(t) for t in position_embeddings)
        self.heads = [torch.empty_like(h) for h in heads]  # (B, L, h, dv) per layer
        self.graphs, self.outputs = [], []

    def capture(self, implementation) -> None:
        """Record each piece as a graph reading the buffers (recorded, not run: the eager step that came first ran
        this step and compiled the kernels)."""
        residual, heads = self.hidden_states, None
        for index in range(len(self.model.layers) + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                pieces = segment(self.model, index, residual, heads, self.position_embeddings, implementation)
            self.graphs.append(graph)
            self.outputs.append(pieces)
            residual, heads = pieces[0], self.heads[index] if index < len(self.heads) else None

    def replay(self, hidden_states, position_embeddings, attention_mask, cache, kwargs, implementation):
        self.hidden_states.copy_(hidden_states)
        for buffer, value in zip(self.position_embeddings, position_embeddings):
            buffer.copy_(value)
        for index, graph in enumerate(self.graphs[:-1]):
            graph.replay()
            attend(self.model, index, self.outputs[index], attention_mask, cache, kwargs, implementation,
                   self.heads[index])
        self.graphs[-1].replay()
        return self.outputs[-1][0].clone()  # the next replay writes the buffer


# Each model's graphs and what they depend on; an entry goes with its model (weak keys: the graphs hold the model
# through a weak proxy).
_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def release_decode_graphs(model) -> None:
    """Free the decoding graphs and buffers kept for `model` (a DiffLlamaModel, or the model holding it)."""
    _GRAPHS.pop(getattr(model, "model", model), None)


def step_qualifies(model, new_tokens: int, cache, kwargs) -> bool:
    """The step's conditions of the module docstring but the device, checked every step (the modules' own ones,
    hooks and plain parameters at capture, and then by the `ModelSnapshot`)."""
    config = model.config
    return (
        model.decode_graphs
        and new_tokens == 1
        and not torch.is_grad_enabled()
        and not model.training
        and not torch.compiler.is_compiling()
        and type(cache) is DynamicCache
        and len(cache.layers) == len(model.layers)
        and all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)
        and cache.get_seq_length() > 0
        and not has_extra_options(kwargs)
        and not any(
            kwargs.get(name, getattr(config, name, False)) for name in ("output_attentions", "output_hidden_states")
        )
    )


def _global_hooks() -> tuple[int, ...]:
    """How many of torch's global module hooks of each kind are registered."""
    return tuple(map(len, GLOBAL_MODULE_HOOKS))


class ModelSnapshot:
    """What a decision about the graphs rests on: every module's submodules, parameters and buffers (by identity),
    the tensors' storage, the modules' own `forward` (what accelerate's and Liger's instance patches set) and their
    hooks (how many). `holds()` checks that it is all still so (each step: ~0.1 ms for 16 layers on a laptop core),
    so that PEFT's layers, a new hook, a patched forward, `.to()` or loaded weights in new storage end the graphs, or
    a decision that they do not apply."""

    def __init__(self, model):
        modules = list(model.modules())
        entries = [(d, name, value) for m in modules for d in (m._modules, m._parameters, m._buffers)
                   for name, value in d.items()]
        # the submodules' own forward (the model's is the caller: a patch of it decides whether this runs at all,
        # and a bound method kept here would keep the model alive)
        entries += [(vars(m), "forward", vars(m).get("forward")) for m in modules[1:]]
        self.dicts, self.names, self.values = (list(column) for column in zip(*entries))
        self.tensors = [value for value in self.values if isinstance(value, torch.Tensor)]
        self.pointers = list(map(torch.Tensor.data_ptr, self.tensors))
        self.hooks = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.hook_counts = list(map(len, self.hooks))
        self.global_hooks = _global_hooks()

    def holds(self) -> bool:
        # map() over builtins: a step asks this of a few hundred entries
        return (
            _global_hooks() == self.global_hooks
            and list(map(len, self.hooks)) == self.hook_counts
            and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values))
            and list(map(torch.Tensor.data_ptr, self.tensors)) == self.pointers
        )


def decode_step(model, hidden_states, position_embeddings, attention_mask, cache, kwargs) -> torch.Tensor | None:
    """The final norm's output of a decoding step through the graphs (the first step of a shape runs eagerly through
    the pieces and captures them), or None where they do not apply (the caller runs its layers)."""
    if not (hidden_states.is_cuda and step_qualifies(model, hidden_states.shape[1], cache, kwargs)):
        return None
    implementation = resolve(model.config._attn_implementation, hidden_states)
    mask = None if attention_mask is None else (attention_mask.dtype, attention_mask.dim(), attention_mask.shape[1])
    key = hidden_states.shape, hidden_states.dtype, hidden_states.device, mask, implementation
    entry = _GRAPHS.get(model)
    if entry is not None and entry[0] == key and entry[1].holds():
        if entry[2] is None:  # decided for this key and model: the layers run
            return None
        return entry[2].replay(hidden_states, position_embeddings, attention_mask, cache, kwargs, implementation)
    release_decode_graphs(model)  # free the previous graphs first
    heads = []
    output = None
    if graphable(model):  # this step, eagerly through the pieces: it compiles the kernels the graphs record
        output = off_the_default_stream(lambda: eager_step(
            model, hidden_states, position_embeddings, attention_mask, cache, kwargs, implementation, heads
        ))
    if output is None:  # kept, so that the next steps do not ask again
        _GRAPHS[model] = (key, ModelSnapshot(model), None)
        return None
    graphs = DecodeGraphs(model, hidden_states, position_embeddings, heads)
    graphs.capture(implementation)
    _GRAPHS[model] = (key, ModelSnapshot(model), graphs)
    return output
