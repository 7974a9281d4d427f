"""Decoding steps with a DynamicCache as piecewise CUDA graphs (`modeling_diff/decode_graphs.py`).

On the CPU (CI) the pieces run eagerly under Triton's interpreter: a step cut as the graphs cut it must equal the
model's own decoding step, bit for bit, and leave the same cache. On a GPU the graphs are captured and replayed:
generate() with the default DynamicCache gives the tokens and the scores of the eager steps."""

import pytest
import torch
from conftest import MODES, tiny_model  # conftest sets TRITON_INTERPRET=1 where there is no GPU
from transformers import DynamicCache, StaticCache

from modeling_diff import decode_graphs
from modeling_diff.kernels import resolve

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FAST = "sdpa" if GPU else "diff_triton"  # what a model on CUDA gets by default; the kernels' name on the CPU


def fast_model(mode):
    """Two layers, heads of 16 (the kernels' smallest tile); bfloat16 on a GPU."""
    model = tiny_model(mode, attn_implementation=FAST, head_dim=16)
    return model.to(DEVICE, torch.bfloat16 if GPU else torch.float32)


def prefilled(model, batch=2, length=9, pad=3):
    """A DynamicCache after a left-padded prompt, the next token, its 2-D mask and its position."""
    ids = torch.randint(3, model.config.vocab_size, (batch, length), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    token = torch.randint(3, model.config.vocab_size, (batch, 1), device=DEVICE)
    mask = torch.cat([mask, torch.ones_like(token)], dim=1)
    return cache, token, mask, mask.sum(-1, keepdim=True) - 1


def step_inputs(model, token, mask, position, cache):
    """What DiffLlamaModel.forward hands `decode_step`: embeddings, RoPE's cos and sin, the attention mask."""
    from transformers.masking_utils import create_causal_mask

    from modeling_diff.modeling_diff_llama import CACHE_KWARG

    inner = model.model
    embeds = inner.embed_tokens(token)
    causal_mask = create_causal_mask(
        config=inner.config, inputs_embeds=embeds, attention_mask=mask, position_ids=position, **{CACHE_KWARG: cache}
    )
    return embeds, inner.rotary_emb(embeds, position_ids=position), causal_mask


def cache_copy(cache):
    copy = DynamicCache(config=None)
    for layer in cache.layers:
        copy.update(layer.keys.clone(), layer.values.clone(), len(copy.layers))
    return copy


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_a_step_cut_as_the_graphs_cut_it_equals_the_models_step(mode, monkeypatch):
    """The pieces of `eager_step` (each layer's norm, projections, RoPE; then the cache update and the decode
    kernel; then o_proj, add + norm, MLP, add) give the model's decoding step exactly, with a padding mask, and the
    same cache; each layer's attention goes through `decode_heads`."""
    model = fast_model(mode)
    cache, token, mask, position = prefilled(model)
    reference_cache, pieces_cache = cache, cache_copy(cache)
    model.model.decode_graphs = False
    reference = model.model(token, attention_mask=mask, position_ids=position, past_key_values=reference_cache)
    calls = []
    for layer in model.model.layers:
        heads = layer.self_attn.decode_heads
        monkeypatch.setattr(layer.self_attn, "decode_heads", lambda *a, f=heads: calls.append(1) or f(*a))
    embeds, position_embeddings, causal_mask = step_inputs(model, token, mask, position, pieces_cache)
    implementation = resolve(model.config._attn_implementation, embeds)
    recorded = []
    hidden = decode_graphs.eager_step(
        model.model, embeds, position_embeddings, causal_mask, pieces_cache, {}, implementation, recorded
    )
    assert torch.equal(hidden, reference.last_hidden_state)
    assert len(calls) == len(recorded) == model.config.num_hidden_layers
    for ours, theirs in zip(pieces_cache.layers, reference_cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@torch.no_grad()
def test_a_step_the_decode_kernel_does_not_take_leaves_the_cache_untouched():
    """With an implementation the decode kernel does not serve (eager attention) `eager_step` declines before any
    layer's cache is updated, and the model's own layers run the step."""
    model = fast_model("dex")
    cache, token, mask, position = prefilled(model)
    length = cache.get_seq_length()
    embeds, position_embeddings, causal_mask = step_inputs(model, token, mask, position, cache)
    assert decode_graphs.eager_step(model.model, embeds, position_embeddings, causal_mask, cache, {}, "eager") is None
    assert cache.get_seq_length() == length


@torch.no_grad()
def test_the_graphs_take_only_plain_decoding_steps():
    """`step_qualifies`: one new token a row, no gradients, eval mode, a DynamicCache holding tokens, no outputs of
    the layers asked for, the switch on; everything else runs the layers."""
    model = fast_model("v1")
    inner = model.model
    cache, *_ = prefilled(model)
    assert decode_graphs.step_qualifies(inner, 1, cache, {})
    assert not decode_graphs.step_qualifies(inner, 2, cache, {})  # a chunk of a prompt
    assert not decode_graphs.step_qualifies(inner, 1, DynamicCache(config=model.config), {})  # nothing cached yet
    static = StaticCache(config=model.config, max_cache_len=16)
    assert not decode_graphs.step_qualifies(inner, 1, static, {})  # the whole-step graph's (generation.py)
    assert not decode_graphs.step_qualifies(inner, 1, cache, {"output_attentions": True})
    assert not decode_graphs.step_qualifies(inner, 1, cache, {"output_hidden_states": True})
    assert not decode_graphs.step_qualifies(inner, 1, cache, {"sliding_window": 4})
    with torch.enable_grad():
        assert not decode_graphs.step_qualifies(inner, 1, cache, {})
    inner.train()
    assert not decode_graphs.step_qualifies(inner, 1, cache, {})
    inner.eval()
    inner.decode_graphs = False
    assert not decode_graphs.step_qualifies(inner, 1, cache, {})


def test_the_snapshot_sees_what_would_make_the_graphs_stale():
    """`ModelSnapshot.holds()` is False after a new hook (module or global), a replaced submodule (what PEFT's
    injection does), a replaced parameter, or a parameter moved to new storage; True again where it is undone."""
    model = fast_model("v2").model
    snapshot = decode_graphs.ModelSnapshot(model)
    assert snapshot.holds()
    attention = model.layers[1].self_attn
    handle = attention.o_proj.register_forward_pre_hook(lambda *a: None)
    assert not snapshot.holds()
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    assert not snapshot.holds()
    handle.remove()
    assert snapshot.holds()
    q_proj = attention.q_proj
    attention.q_proj = torch.nn.Linear(q_proj.in_features, q_proj.out_features, bias=False)
    assert not snapshot.holds()
    attention.q_proj = q_proj
    weight = q_proj.weight
    q_proj.weight = torch.nn.Parameter(weight.detach().clone())
    assert not snapshot.holds()
    q_proj.weight = weight
    assert snapshot.holds()
    weight.data = weight.data.clone()  # what .to() does to a parameter
    assert not snapshot.holds()
    snapshot = decode_graphs.ModelSnapshot(model)
    norm = model.layers[0].input_layernorm
    norm.forward = lambda x: x  # an instance patch (accelerate's hooks, Liger's instance patch)
    assert not snapshot.holds()
    del norm.forward
    assert snapshot.holds()


def test_peft_on_a_model_with_graphs_ends_them_and_the_graphs_decline_it():
    """Plain `peft.get_peft_model` after a model's graphs were built (LoRA injected into the same model): the
    graphs' snapshot no longer holds, and `graphable` declines the LoRA model, whose layers then run eagerly."""
    from peft import LoraConfig, get_peft_model

    from modeling_diff.generation import graphable

    model = fast_model("dex")
    snapshot = decode_graphs.ModelSnapshot(model.model)
    assert snapshot.holds() and graphable(model.model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not snapshot.holds()
    assert not graphable(peft_model.base_model.model.model)


def test_a_decision_against_the_graphs_holds_while_the_model_is_as_it_was():
    """A model with a hook runs its layers; the snapshot kept with that decision holds while the hooks stay as they
    are (so a hooked model is not examined again every step), and ends when one goes."""
    model = fast_model("dex").model
    handle = model.layers[0].mlp.register_forward_hook(lambda *a: None)
    snapshot = decode_graphs.ModelSnapshot(model)
    assert snapshot.holds()
    handle.remove()
    assert not snapshot.holds()


def greedy(model, ids, graphs: bool, **kwargs):
    model.model.decode_graphs = graphs
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, min_new_tokens=12,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs,
    )
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_generate_with_a_dynamic_cache_replays_the_graphs_and_gives_the_eager_tokens(mode, monkeypatch):
    """generate() with the default DynamicCache: every step after the first replays the graphs, and the tokens and
    scores equal those of the eager steps; a new batch size captures new graphs; a module that gains a hook, or
    parameters that move, take the eager steps again."""
    model = fast_model(mode)
    replays = []
    replay = decode_graphs.DecodeGraphs.replay
    monkeypatch.setattr(decode_graphs.DecodeGraphs, "replay", lambda *a: replays.append(1) or replay(*a))
    for batch in (1, 3):
        ids = torch.randint(3, model.config.vocab_size, (batch, 7), device=DEVICE)
        eager_tokens, eager_scores = greedy(model, ids, graphs=False)
        replays.clear()
        tokens, scores = greedy(model, ids, graphs=True)
        assert torch.equal(tokens, eager_tokens) and torch.equal(scores, eager_scores)
        assert len(replays) == 12 - 2  # the first step is the prefill, the second captures
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: replays.append("hook"))
    replays.clear()
    tokens, _ = greedy(model, ids, graphs=True)
    assert torch.equal(tokens, eager_tokens) and "hook" in replays and 1 not in replays
    handle.remove()
    decode_graphs.release_decode_graphs(model)
    assert model.model not in decode_graphs._GRAPHS


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("strategy", [dict(do_sample=True, top_k=20), dict(num_beams=3)])
@torch.no_grad()
def test_sampling_and_beam_search_with_the_graphs_give_the_eager_tokens(strategy):
    """Sampling (the same seed) and beam search (transformers reorders the DynamicCache between steps, outside the
    graphs) give the eager steps' tokens."""
    model = fast_model("v1")
    ids = torch.randint(3, model.config.vocab_size, (2, 7), device=DEVICE)
    outputs = []
    for graphs in (False, True):
        model.model.decode_graphs = graphs
        torch.manual_seed(0)
        outputs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                                      pad_token_id=0, **strategy))
    assert model.model in decode_graphs._GRAPHS  # the second generation took the graphs
    assert torch.equal(outputs[1], outputs[0])


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_decode_heads_write_into_the_buffer_they_are_given(mode):
    """`decode_heads(..., out=buffer)` (what a replay hands it: the next graph's input) writes the heads there,
    equal to the heads of a call without it on a copy of the cache."""
    model = fast_model(mode)
    cache, token, mask, position = prefilled(model)
    embeds, position_embeddings, causal_mask = step_inputs(model, token, mask, position, cache)
    implementation = resolve(model.config._attn_implementation, embeds)
    layer = model.model.layers[0]
    query, key, value, side = layer.self_attn.project(
        implementation, layer.input_layernorm(embeds), position_embeddings
    )
    heads = layer.self_attn.decode_heads(implementation, query, key, value, side, causal_mask, cache_copy(cache), {})
    buffer = torch.full_like(heads, float("nan"))
    written = layer.self_attn.decode_heads(
        implementation, query, key, value, side, causal_mask, cache, {}, out=buffer
    )
    assert written is buffer and torch.equal(buffer, heads)
