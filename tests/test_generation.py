"""The whole-step graph of greedy static-cache generation (`modeling_diff/generation.py`) against transformers' own
decoding loop: the same tokens with left padding, EOS on some rows, the minimum-length rule and an early stop; and
every request it does not implement goes to transformers' generate. On CPU the steps run eagerly (`capture=False`,
the loop and bookkeeping the graph replays); on CUDA the graph itself."""

import gc
import io
from copy import deepcopy

import pytest
import torch
from transformers import LogitsProcessorList, TextStreamer

from conftest import MODES, tiny_model
from modeling_diff import generation
from modeling_diff.generation import graphed_greedy_generate

STATIC = dict(cache_implementation="static", do_sample=False)


def transformers_generate(model, ids, **kwargs):
    """transformers' decoding loop (GenerationMixin.generate), bypassing the model's override."""
    return super(type(model), model).generate(ids, **STATIC, **kwargs)


def left_padded_prompts(generator: torch.Generator):
    """Three prompts of 7, 4 and 5 tokens (ids 3..96), left-padded with the pad token 0, and their mask."""
    lengths = (7, 4, 5)
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, 7 - length:] = torch.randint(3, 97, (length,), generator=generator)
        mask[row, 7 - length:] = 1
    return ids, mask


@pytest.mark.parametrize("mode", MODES)
def test_graphed_steps_give_transformers_greedy_tokens(mode):
    model = tiny_model(mode, attn_implementation="sdpa")
    ids, mask = left_padded_prompts(torch.Generator().manual_seed(1))
    free = transformers_generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    ours = graphed_greedy_generate(model, ids, None, dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None,
                                                          **STATIC), capture=False)
    assert torch.equal(ours, free)

    # EOS = a token that row 0 generates at its 4th step: rows finish at different steps (or not), then get padding
    eos = int(free[0, 7 + 3])
    for extra in (dict(), dict(min_new_tokens=6), dict(pad_token_id=5)):
        expected = transformers_generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, **extra)
        got = graphed_greedy_generate(
            model, ids, None, dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, **STATIC, **extra),
            capture=False,
        )
        assert torch.equal(got, expected), extra


def test_generation_stops_when_every_row_has_finished(monkeypatch):
    """All rows end on EOS well before max_new_tokens: the output stops at the step where the last one finished, as
    transformers' loop does, though the graph only looks every STOP_CHECK_EVERY steps."""
    monkeypatch.setattr(generation, "STOP_CHECK_EVERY", 4)
    model = tiny_model("v2", attn_implementation="sdpa")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    free = transformers_generate(model, ids, max_new_tokens=30, eos_token_id=None)
    eos = int(free[0, 6 + 5])
    expected = transformers_generate(model, ids, max_new_tokens=30, eos_token_id=eos)
    got = graphed_greedy_generate(model, ids, None, dict(max_new_tokens=30, eos_token_id=eos, **STATIC), capture=False)
    assert expected.shape[1] < 6 + 30 and torch.equal(got, expected)


def test_lengths_and_eos_lists_as_transformers_reads_them():
    """`max_length` (prompt + new) instead of `max_new_tokens`, a list of EOS ids, and every row finishing on its
    first token (the prefill's choice): transformers' tokens and length."""
    model = tiny_model("dex", attn_implementation="sdpa")
    ids, mask = left_padded_prompts(torch.Generator().manual_seed(4))
    free = transformers_generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    cases = [
        dict(max_length=7 + 9, eos_token_id=None),
        dict(max_new_tokens=8, eos_token_id=[int(free[0, 7 + 2]), int(free[2, 7 + 4])]),
        dict(max_new_tokens=8, eos_token_id=sorted({int(t) for t in free[:, 7]})),  # all rows end at once
    ]
    for case in cases:
        expected = transformers_generate(model, ids, attention_mask=mask, **case)
        got = graphed_greedy_generate(model, ids, None, dict(attention_mask=mask, **STATIC, **case), capture=False)
        assert torch.equal(got, expected), case
    assert expected.shape[1] == 7 + 1


@pytest.mark.parametrize("request_", [
    dict(do_sample=True), dict(num_beams=2), dict(repetition_penalty=1.3), dict(return_dict_in_generate=True),
    dict(output_scores=True), dict(cache_implementation=None), dict(logits_processor=LogitsProcessorList()),
    dict(streamer=TextStreamer(tokenizer=None)), dict(disable_compile=True), dict(no_repeat_ngram_size=2),
    dict(attention_mask=torch.ones(1, 5, 5, dtype=torch.long)),  # 3-D: a RuntimeError in the graph's prefill
])
def test_everything_else_takes_transformers_generate(request_):
    model = tiny_model("dex", attn_implementation="sdpa")
    ids = torch.randint(3, 97, (1, 5))
    settings = dict(STATIC, max_new_tokens=4)
    settings.update(request_)
    assert graphed_greedy_generate(model, ids, None, settings, capture=False) is None


def test_the_graph_needs_what_replay_preserves():
    """Eager attention (an additive float mask), training mode, Python hooks and a forward bound on a module's
    instance (steering and patching tools; a graph runs neither) keep transformers' loop; so does a CPU model (no
    CUDA graphs). (A bound forward on a layer or its attention was graphed until this was checked: the decoding
    graphs call the layer's parts directly, and its tokens differed from the model's.)"""
    model = tiny_model("v1", attn_implementation="sdpa")
    ids = torch.randint(3, 97, (1, 5))
    assert graphed_greedy_generate(model, ids, None, dict(STATIC, max_new_tokens=4)) is None  # CPU
    assert generation.graphable(model)  # what a CUDA copy of this model would take
    model.config._attn_implementation = "eager"
    assert not generation.graphable(model)
    model.config._attn_implementation = "sdpa"
    handle = model.model.layers[0].register_forward_hook(lambda *args: None)
    assert not generation.graphable(model)
    handle.remove()
    for module in (model.model.layers[0], model.model.layers[0].self_attn):
        module.forward = lambda *args, original=module.forward, **kwargs: original(*args, **kwargs)
        assert not generation.graphable(model)
        del module.forward
        assert generation.graphable(model)
    model.train()
    assert not generation.graphable(model)


def test_plain_peft_models_keep_transformers_loop():
    """A LoRA model from plain `peft.get_peft_model` switches adapters in Python (`disable_adapter()`), which a
    replayed graph would not see."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("dex", attn_implementation="sdpa")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not generation.graphable(peft_model.base_model.model)


def test_the_kept_step_state_is_reused_rebuilt_and_released():
    """The state of a generation (its StaticCache, buffers, and on CUDA the graph) is kept for the next call of the same
    shape, rebuilt when the shape, the attention implementation or the parameters' storage change, kept beside the
    model (deepcopy and pickling copy none of it), and freed by `release_graph` or with the model."""
    model = tiny_model("v2", attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    settings = dict(STATIC, max_new_tokens=6, eos_token_id=None)
    expected = transformers_generate(model, ids, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(graphed_greedy_generate(model, ids, None, settings, capture=False), expected)
    kept = generation._GRAPHS[model]
    assert torch.equal(graphed_greedy_generate(model, ids, None, settings, capture=False), expected)
    assert generation._GRAPHS[model] is kept  # reused, reset in place
    graphed_greedy_generate(model, ids[:1], None, settings, capture=False)
    assert generation._GRAPHS[model] is not kept  # another batch
    copy = deepcopy(model)
    assert generation._GRAPHS.get(copy) is None
    buffer = io.BytesIO()
    torch.save(model, buffer)  # pickles the whole model: the kept state is beside it, not in it
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert generation._GRAPHS.get(loaded) is None
    assert torch.equal(transformers_generate(loaded, ids, max_new_tokens=6, eos_token_id=None), expected)
    kept = generation._GRAPHS[model]
    model.set_attn_implementation("eager")
    graphed_greedy_generate(model, ids, None, settings, capture=False)
    assert generation._GRAPHS[model] is not kept  # another attention implementation
    model.set_attn_implementation("sdpa")
    copy.double()  # new storage for every parameter
    assert torch.equal(graphed_greedy_generate(copy, ids, None, settings, capture=False),
                       transformers_generate(copy, ids, max_new_tokens=6, eos_token_id=None))
    kept = generation._GRAPHS[copy]
    copy.float()
    graphed_greedy_generate(copy, ids, None, settings, capture=False)
    assert generation._GRAPHS[copy] is not kept
    generation.release_graph(model)
    assert generation._GRAPHS.get(model) is None
    entries = len(generation._GRAPHS)
    del copy, kept
    gc.collect()
    assert len(generation._GRAPHS) < entries  # the copy's went with it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replays_give_the_eager_loop_tokens(mode):
    """On the GPU, `model.generate` replays the graph (kept for the next call of the same shape) and gives the tokens
    of transformers' loop run eagerly (`disable_compile=True`) on the same kernels."""
    model = tiny_model(mode, attn_implementation="sdpa", max_position_embeddings=256).cuda()
    ids, mask = left_padded_prompts(torch.Generator().manual_seed(2))
    ids, mask = ids.cuda(), mask.cuda()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None, disable_compile=True, **STATIC)
    eos = int(free[1, 7 + 20])
    for _ in range(2):  # the second call replays the kept graph
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, disable_compile=True,
                                  **STATIC)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, **STATIC)
        assert generation._GRAPHS.get(model) is not None and torch.equal(got, expected)
    copy = deepcopy(model)  # the kept graph is beside the model, not in it
    assert generation._GRAPHS.get(copy) is None and torch.equal(copy.generate(ids, attention_mask=mask, max_new_tokens=40,
                                                                               eos_token_id=eos, **STATIC), expected)
    generation.release_graph(model)
    assert generation._GRAPHS.get(model) is None


def test_an_offloading_static_cache_s_steps_are_not_compiled_unless_a_compile_config_asks(monkeypatch):
    """transformers' generate asks the model's `_valid_auto_compile_criteria` whether to compile the decoding step,
    with the cache it made or was given. For an offloading StaticCache the answer is no unless `compile_config` is
    set: that compiled step died of a segmentation fault on an H200 for transformers' own Llama (benchmarks/RESULTS.md).
    Other caches get transformers' answer (here replaced by "yes", what it says for a StaticCache on CUDA)."""
    from transformers import CompileConfig, DynamicCache, GenerationConfig, StaticCache
    from transformers.generation import GenerationMixin

    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", lambda self, model_kwargs, config: True)
    model = tiny_model("v1")
    offloading = StaticCache(model.config, max_cache_len=16, offloading=True)
    plain = GenerationConfig()
    for key in ("cache", "past_key_values"):  # the keyword transformers uses: `cache` in newer versions
        assert model._valid_auto_compile_criteria({key: offloading}, plain) is False
        assert model._valid_auto_compile_criteria({key: offloading}, GenerationConfig(compile_config=CompileConfig()))
        for other in (StaticCache(model.config, max_cache_len=16), DynamicCache(config=model.config)):
            assert model._valid_auto_compile_criteria({key: other}, plain), type(other).__name__
