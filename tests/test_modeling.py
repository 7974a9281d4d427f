"""DiffLlamaForCausalLM as a transformers model: parameter counts against transformers' Llama, backends,
generation with every cache, loss, dtypes, gradient checkpointing, save/load and the Auto classes."""

import inspect

import pytest
import torch
from conftest import MODES, tiny_config, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import modeling_diff
from modeling_diff import DiffLlamaForCausalLM, DiffLlamaModel


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def llama_like(config, heads, kv_heads) -> LlamaForCausalLM:
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=config.head_dim,
        )
    )


# ----------------------------------------------------------------------------------------------- parameters
def test_v1_parameter_count_is_llama_with_2h_heads_plus_6d_per_layer():
    config = tiny_config("v1")
    h, h_kv, d, layers = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 2
    llama = llama_like(config, heads=2 * h, kv_heads=2 * h_kv)
    assert count(DiffLlamaForCausalLM(config)) == count(llama) + layers * 6 * d


def test_v2_parameter_count_is_llama_plus_noise_queries_and_lambda_proj():
    config = tiny_config("v2")
    h, d, hidden, layers = config.num_attention_heads, config.head_dim, config.hidden_size, 2
    llama = llama_like(config, heads=h, kv_heads=config.num_key_value_heads)
    # per layer: h extra query heads (hidden x h*d) and lambda_proj (hidden x h)
    assert count(DiffLlamaForCausalLM(config)) == count(llama) + layers * (hidden * h * d + hidden * h)


def test_dex_parameter_count_is_llama_plus_f_d_and_lambda_per_layer():
    config = tiny_config("dex")
    llama = llama_like(config, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads)
    assert count(DiffLlamaForCausalLM(config)) == count(llama) + 2 * (config.head_dim**2 + 1)


def test_v1_cache_holds_the_bytes_of_the_equivalent_llama():
    config = tiny_config("v1")
    model = tiny_model("v1")
    llama = llama_like(config, heads=2 * config.num_attention_heads, kv_heads=2 * config.num_key_value_heads).eval()
    ids = torch.randint(3, 97, (1, 6))
    ours = model(ids, use_cache=True)[1]
    theirs = llama(ids, use_cache=True)[1]
    layer_bytes = lambda cache: sum(t.numel() for t in (cache.layers[0].keys, cache.layers[0].values))  # noqa: E731
    assert layer_bytes(ours) == layer_bytes(theirs)
    assert ours.layers[0].keys.shape == (1, config.num_key_value_heads, 6, 2 * config.head_dim)


# ----------------------------------------------------------------------------------------------- backends
def padded_batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    ids[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (6, 3), (3, 3)], ids=lambda h: f"h{h[0]}-kv{h[1]}")
def test_sdpa_matches_eager(mode, padded, heads):
    """Any h_kv dividing h (README), odd group sizes and no grouping included; the cache gives the no-cache tokens."""
    ids, mask = padded_batch()
    mask = mask if padded else None
    shape = dict(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=16)
    eager = tiny_model(mode, **shape)
    sdpa = tiny_model(mode, attn_implementation="sdpa", **shape)
    with torch.no_grad():
        expected, got = eager(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    keep = mask.bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-4)
    if not padded:
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(sdpa.generate(ids[:1], **kw), sdpa.generate(ids[:1], use_cache=False, **kw))


def test_flex_attention_matches_eager():
    """One padded batch per mode. flex_attention compiles on first use, slowly on a CPU, so the three modes are
    shaped to make identical attention calls (8 query heads of 32 against 2 kv heads of 32) and compile once."""
    ids, mask = padded_batch()
    shapes = {"v1": dict(head_dim=16), "v2": dict(head_dim=32), "dex": dict(num_attention_heads=8, head_dim=32)}
    for mode, shape in shapes.items():
        eager = tiny_model(mode, **shape)
        flex = tiny_model(mode, attn_implementation="flex_attention", **shape)
        with torch.no_grad():
            expected, got = eager(ids, attention_mask=mask).logits, flex(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_output_attentions_returns_differential_maps(mode):
    model = tiny_model(mode)
    ids = torch.randint(3, 97, (1, 7))
    with torch.no_grad():
        maps = model(ids, output_attentions=True).attentions
    assert len(maps) == 2 and maps[0].shape == (1, 4, 7, 7)
    causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1)
    assert (maps[0][..., causal] == 0).all()
    if mode == "dex":  # DEX keeps softmax maps: rows sum to 1
        torch.testing.assert_close(maps[0].sum(-1), torch.ones(1, 4, 7))
    elif mode == "v1":  # rows of A1 - lam*A2 sum to 1 - lam
        lam = model.model.layers[0].self_attn.diff_lambda()
        torch.testing.assert_close(maps[0].sum(-1), (1 - lam).expand(1, 4, 7))


def test_hub_kernelization_leaves_the_models_norms_their_own_forward(monkeypatch):
    """transformers >= 5.25 kernelizes every model in from_pretrained (`integrations.hub_kernels.kernelize`, through
    the `kernels` library, one of its requirements): the layers of its `use_kernel_forward_from_hub("RMSNorm")`
    classes, LlamaRMSNorm and its subclasses, get the mapped Hub layer's forward bound on the instance (Liger's
    RMSNorm on CUDA). Here the mapping is an in-memory layer on the CPU. It takes transformers' Llama's norms, so it
    applies, and none of ours: DiffLlamaRMSNorm runs the project's kernel (its residual add joins its pass only where
    no forward is bound), and V1's subln is read by the flash-diff kernel only where it runs its own forward."""
    # a requirement of transformers >= 5.25, installed by `make test`; with an older transformers without it,
    # from_pretrained kernelizes nothing
    kernels = pytest.importorskip("kernels", reason="the `kernels` package, which transformers' Hub kernels need")
    from transformers.integrations import hub_kernels

    if hub_kernels.is_kernels_available():  # transformers' own kernelize, as from_pretrained calls it
        def kernelize(model):
            hub_kernels.kernelize(model, mode=kernels.Mode.TRAINING)
    else:  # transformers 5.17 takes kernels < 0.17 only and then leaves LlamaRMSNorm undecorated: decorated here
        # as kernels' `use_kernel_forward_from_hub("RMSNorm")` does, and kernelized by the call transformers makes
        monkeypatch.setattr(LlamaRMSNorm, "kernel_layer_name", "RMSNorm", raising=False)
        monkeypatch.setattr(LlamaRMSNorm, "kernel_condition", staticmethod(lambda module: True), raising=False)

        def kernelize(model):
            kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")

    class ConstantNorm(torch.nn.Module):  # stateless, LlamaRMSNorm.forward's signature, as kernels requires
        def forward(self, hidden_states):
            return torch.full_like(hidden_states, 7.0)

    class InMemoryRepository:  # kernels' layer-repository protocol, without the Hub
        layer_name = "RMSNorm"

        def load(self):
            return ConstantNorm

    def rms_norms(model):
        return [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]

    llama = llama_like(tiny_config("v1"), heads=4, kv_heads=2)
    ids = torch.randint(3, 97, (1, 6))
    with kernels.use_kernel_mapping({"RMSNorm": {"cpu": InMemoryRepository()}}, inherit_mapping=False):
        kernelize(llama)
        assert rms_norms(llama) and all("forward" in m.__dict__ for m in rms_norms(llama))  # the mapping applies
        for mode in MODES:
            model = tiny_model(mode)
            with torch.no_grad():
                expected = model(ids).logits
            kernelize(model)
            norms = rms_norms(model)
            assert len(norms) == 2 * 2 + 1 + (2 if mode == "v1" else 0)  # two a layer, the final one, V1's subln
            assert not any("forward" in m.__dict__ for m in norms)
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("mode", MODES)
def test_greedy_generation_with_cache_equals_full_recomputation(mode):
    model = tiny_model(mode, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    no_cache = model.generate(ids, use_cache=False, **kw)
    assert dynamic.shape == (2, 14)
    assert torch.equal(dynamic, no_cache)
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_cache_generates_through_its_quantized_keys_and_values(mode, monkeypatch):
    """transformers' quantized KV cache (`cache_implementation="quantized"`, optimum-quanto): its layers keep the
    prompt's keys and values quantized and the last `residual_length` tokens as they are. With quantization made
    lossless, generation is the dynamic cache's to the token (V1's keys are 2 x head_dim wide); with 4-bit
    quantization the logits move (the cache is used) by under 0.15 of their largest (a Llama of the same sizes:
    0.044; V1 0.099, V2 0.022, DEX 0.035)."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantoQuantizedLayer

    model = tiny_model(mode, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    quantized = dict(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4,
                                                                      "residual_length": 2})
    dynamic = model.generate(ids, **kw)
    lossy = model.generate(ids, **kw, **quantized)
    first_step_error = ((lossy.logits[1] - dynamic.logits[1]).abs().max() / dynamic.logits[1].abs().max()).item()
    assert 0 < first_step_error < 0.15  # step 1: the first to read the quantized prompt
    monkeypatch.setattr(QuantoQuantizedLayer, "_quantize", lambda self, tensor, axis: tensor.clone())
    monkeypatch.setattr(QuantoQuantizedLayer, "_dequantize", lambda self, tensor: tensor)
    assert torch.equal(model.generate(ids, **kw, **quantized).sequences, dynamic.sequences)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="an offloading cache moves keys and values between an accelerator and the CPU: with no "
                           "accelerator there is nowhere to offload from (transformers asserts CUDA)")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cache_implementation", ["offloaded", "offloaded_static"])
def test_offloading_caches_generate_the_dynamic_cache_s_tokens(mode, cache_implementation):
    """transformers' offloading caches keep each layer's keys and values on the CPU but the next layer's, which they
    prefetch on a side stream: lossless, so the tokens are the dynamic cache's. `offloaded_static` runs uncompiled
    (compiled, transformers' step crashed its own Llama on an H200: test_generation.py's
    `test_an_offloading_static_cache_s_steps_are_not_compiled_unless_a_compile_config_asks`). On the GPU only
    (gpu_tests.sh runs it); what the CPU can check, that the kernels' direct StaticCache write leaves an offloading
    cache to `Cache.update` (which offloads and prefetches), is test_cache_write.py's
    `test_other_caches_and_layers_take_cache_update`."""
    model = tiny_model(mode, attn_implementation="sdpa").cuda()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(4)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, cache_implementation=cache_implementation, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_left_padded_batch_generates_as_each_prompt_alone(mode, cache_implementation):
    model = tiny_model(mode, attn_implementation="sdpa")
    torch.manual_seed(2)
    long, short = torch.randint(3, 97, (1, 8)), torch.randint(3, 97, (1, 5))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
    together = model.generate(batch, attention_mask=mask, **kw)[:, 8:]
    alone = [model.generate(p, attention_mask=torch.ones_like(p), **kw)[:, p.shape[1] :] for p in (long, short)]
    assert torch.equal(together[0], alone[0][0])
    assert torch.equal(together[1], alone[1][0])


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_and_sampling(mode):
    model = tiny_model(mode, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 5))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, pad_token_id=0)
    beams = model.generate(ids, num_beams=3, do_sample=False, **kw)
    assert torch.equal(beams, model.generate(ids, num_beams=3, do_sample=False, use_cache=False, **kw))
    torch.manual_seed(0)
    sampled = model.generate(ids, do_sample=True, top_k=20, temperature=0.9, **kw)
    torch.manual_seed(0)
    assert torch.equal(sampled, model.generate(ids, do_sample=True, top_k=20, temperature=0.9, **kw))
    assert sampled.shape == (2, 10)


@pytest.mark.parametrize("mode", MODES)
def test_assisted_and_prompt_lookup_decoding_give_the_greedy_tokens(mode):
    """Speculative decoding verifies the candidates with the model and crops its cache back past the rejected ones
    (`DynamicCache.crop`), so its greedy tokens are the model's own. The draft is a plain Llama of the same vocabulary
    (a DEX model's source is the natural draft): with random weights it proposes mostly wrong tokens, and every
    rejection crops the differential layers' cache."""
    model = tiny_model(mode, attn_implementation="sdpa")
    config = model.config
    torch.manual_seed(3)
    draft = llama_like(config, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads).eval()
    ids = torch.randint(3, 97, (1, 7))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    greedy = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(model.generate(ids, assistant_model=draft, **kw), greedy)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kw), greedy)


@pytest.mark.parametrize("mode", ["v2", "dex"])
def test_continuous_batching_generates_each_prompt_s_greedy_tokens(mode):
    """transformers' continuous batching (`generate_batch`, and `generate(cache_implementation="paged")`, which
    switches to it): its paged cache takes the attention's kwargs in `cache.update`; without them its worker logged
    an error and every request came back with no tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    model = tiny_model(mode, attn_implementation="sdpa")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]
    # a small paged cache: transformers 5.17 sizes it by default from the machine's memory (21 GB here, killed)
    small = ContinuousBatchingConfig(block_size=16, num_blocks=8, max_batch_tokens=32)
    if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:  # transformers 5.17 and 5.18
        with pytest.raises(ValueError, match="needs transformers >= 5.19"):
            model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=small)
        return
    results = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=small,
                                   progress_bar=False)
    assert sorted(r.generated_tokens for r in results.values()) == sorted(expected)
    paged = model.generate(torch.tensor([prompts[0]]), generation_config=config, cache_implementation="paged",
                           continuous_batching_config=small)
    assert torch.as_tensor(paged).flatten().tolist()[-4:] == expected[0]


def test_continuous_batching_refuses_a_transformers_whose_paged_cache_our_layers_cannot_update(monkeypatch):
    """transformers 5.17 and 5.18 pass the paged cache to the attention function as `cache`, which the layers take as
    their own cache and update with the layers' call: every request failed (logged only) and came back empty."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    def update(self, key_states, value_states, layer_idx, read_index, write_index):  # 5.17's signature
        raise AssertionError("not reached")

    monkeypatch.setattr(PagedAttentionCache, "update", update)
    with pytest.raises(ValueError, match=r"continuous batching of a DiffLlama needs transformers >= 5\.19"):
        tiny_model("v2").generate_batch(inputs=[[5, 6, 7]], progress_bar=False)


def test_continuous_batching_refuses_v1_whose_cache_is_twice_as_wide():
    from transformers import GenerationConfig

    model = tiny_model("v1", attn_implementation="sdpa")
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(ValueError, match="continuous batching .* does not take diff_mode='v1'"):
        model.generate_batch(inputs=[[5, 6, 7]], generation_config=config, progress_bar=False)
    with pytest.raises(ValueError, match="continuous batching .* does not take diff_mode='v1'"):
        model.generate(torch.tensor([[5, 6, 7]]), generation_config=config, cache_implementation="paged")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["TorchExportableModuleForDecoderOnlyLM", "convert_and_export_with_cache"])
def test_executorch_export_with_a_static_cache_gives_the_eager_logits_or_says_why_not(mode, recipe):
    """transformers' ExecuTorch recipes (strict torch.export, a StaticCache sized from config.head_dim): V2 and DEX
    export and decode token by token to the eager logits; V1, whose cache is 2 x head_dim wide, failed in a fake
    tensor's index_copy_ that never named it, and now fails with the reason."""
    from transformers.integrations import executorch

    model = tiny_model(mode)
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 16}
    first = dict(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    export = {
        "TorchExportableModuleForDecoderOnlyLM": lambda: executorch.TorchExportableModuleForDecoderOnlyLM(model).export(
            **first),
        "convert_and_export_with_cache": lambda: executorch.convert_and_export_with_cache(
            model, example_input_ids=first["input_ids"], example_cache_position=first["cache_position"]),
    }[recipe]
    if mode == "v1":
        with pytest.raises(Exception, match=r"(?s)V1 caches keys and values 2 x head_dim .* ExecuTorch export"):
            export()
        return
    exported, ids = export().module(), [5, 6, 7, 8]
    for position, token in enumerate(ids):
        logits = exported(input_ids=torch.tensor([[token]]), cache_position=torch.tensor([position]))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[:, -1]
    torch.testing.assert_close(logits[:, -1], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_executorch_export_with_a_dynamic_cache_gives_the_eager_logits(mode):
    """README: V1, refused by the StaticCache recipes above, exports with transformers' `export_with_dynamic_cache`
    (as do V2 and DEX), and the exported program gives the eager logits. The program takes the cache under the
    keyword transformers traced it with (`cache` in 5.25, `past_key_values` in 5.17), read from its input spec."""
    from transformers.cache_utils import DynamicCache
    from transformers.integrations.executorch import export_with_dynamic_cache

    model = tiny_model(mode)
    ids = torch.randint(3, 97, (1, 6))
    program = export_with_dynamic_cache(model, ids, torch.ones_like(ids))
    keywords = program.call_spec.in_spec.children_specs[1].context  # the keyword arguments it was traced with
    (cache_keyword,) = set(keywords) - {"input_ids", "attention_mask", "use_cache"}
    logits = program.module()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                              **{cache_keyword: DynamicCache(config=model.config)}).logits
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("mode", MODES)
def test_loss_is_shifted_cross_entropy_and_logits_to_keep(mode):
    model = tiny_model(mode)
    ids = torch.randint(3, 97, (2, 8))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, 97).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, expected)
    # num_items_in_batch (Trainer's gradient accumulation): sum over tokens / given count
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(20)).loss
    torch.testing.assert_close(summed, expected * (labels[:, 1:] != -100).sum() / 20)
    last = model(ids, logits_to_keep=3).logits
    assert last.shape == (2, 3, 97)
    torch.testing.assert_close(last, out.logits[:, -3:])


def test_a_training_forward_builds_a_cache_only_where_asked():
    """In train mode with gradients, a forward without use_cache returns no cache (and writes none); use_cache=True
    still gets one, and so do eval mode and train mode under no_grad (the config's default, as transformers' Llama).
    The logits are the same either way."""
    model = tiny_model("v1").train()
    ids = torch.randint(3, 97, (2, 8))
    plain = model(ids)
    assert plain.past_key_values is None
    asked = model(ids, use_cache=True)
    assert asked.past_key_values is not None and asked.past_key_values.get_seq_length() == 8
    torch.testing.assert_close(plain.logits, asked.logits)
    assert model.model(ids).past_key_values is None  # the base model too
    with torch.no_grad():
        assert model(ids).past_key_values is not None
    assert model.eval()(ids).past_key_values is not None


@pytest.mark.parametrize("mode", MODES)
def test_packed_sequences_are_found_only_in_positions_a_caller_passes(mode, monkeypatch):
    """Two sequences packed in one row with their own positions (TRL's padding-free batches) see only themselves: the
    row's logits are each sequence's alone. Without positions, transformers' search for packed sequences (a host
    synchronization) does not run: the default positions are one sequence a row."""
    import transformers.masking_utils as masking_utils

    searches = []
    search = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: searches.append(p) or search(p))
    model = tiny_model(mode).train()
    first, second = torch.randint(3, 97, (1, 5)), torch.randint(3, 97, (1, 3))
    packed = model(torch.cat([first, second], 1), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])).logits
    assert len(searches) == 1
    torch.testing.assert_close(packed[:, :5], model(first).logits)
    torch.testing.assert_close(packed[:, 5:], model(second).logits)
    assert len(searches) == 1  # not for the default positions


@pytest.mark.parametrize("implementation", ["eager", "diff_triton"])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_checkpointing_gives_the_same_gradients(mode, implementation, monkeypatch):
    """Also on the fast paths, whose autograd nodes recompute what they do not keep (the MLP's product, V2's
    combined heads) and where DEX's operator is folded into o_proj (80 tokens > hidden 64). Checkpointed layers are
    called as modules (their call is what is replayed): no residual add is handed to the next layer."""
    import modeling_diff.modeling_diff_llama as modeling

    deferred, defers = [], modeling.defers_residual_adds
    monkeypatch.setattr(modeling, "defers_residual_adds",
                        lambda layers: deferred.append(defers(layers)) or deferred[-1])
    ids = torch.randint(3, 97, (2, 40 if mode == "dex" else 8))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(mode, attn_implementation=implementation).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert deferred == [True, False]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)
    # every differential parameter learns (DEX f_D at t = T = 0 has lambda = lambda_learn != 0)
    differential = [n for n in grads[0] if any(k in n for k in ("lambda", "subln", "dex_proj"))]
    assert differential and all(grads[0][n].abs().sum() > 0 for n in differential)


@pytest.mark.filterwarnings("ignore:For backward hooks to be called", "ignore:Full backward hook is firing")
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", MODES)
def test_decoder_layers_run_every_hook_a_llama_layer_runs(mode, implementation):
    """Backward hooks on a decoder layer and torch's global module hooks (what FlopCounterMode's module tracker and
    activation-steering tools register) fire for our layers as often as for transformers' Llama's, in a training
    step and in a forward without gradients, and a global hook's changed output is the one the next layer reads.
    (The model's loop hands residual adds from layer to layer, `defers_residual_adds`, only where no hook watches.)"""
    from torch.nn.modules.module import (register_module_forward_hook, register_module_forward_pre_hook,
                                         register_module_full_backward_hook)

    model = tiny_model(mode, attn_implementation=implementation).train()
    llama = llama_like(model.config, model.config.num_attention_heads, model.config.num_key_value_heads).train()
    llama.set_attn_implementation(implementation)
    ids = torch.randint(3, 97, (2, 7))

    def hook_calls(model) -> dict[str, int]:
        calls = dict.fromkeys(("backward", "backward_pre", "global_pre", "global", "global_backward"), 0)

        def counter(name, layers_only=True):
            def count(module, *args):
                if not layers_only or module in model.model.layers:
                    calls[name] += 1
            return count

        layer = model.model.layers[0]
        handles = [layer.register_full_backward_hook(counter("backward", False)),
                   layer.register_full_backward_pre_hook(counter("backward_pre", False)),
                   register_module_forward_pre_hook(counter("global_pre")),
                   register_module_forward_hook(counter("global")),
                   register_module_full_backward_hook(counter("global_backward"))]
        try:
            model(ids, labels=ids).loss.backward()
            with torch.no_grad():
                model(ids)
        finally:
            for handle in handles:
                handle.remove()
        return calls

    layers = model.config.num_hidden_layers
    expected = {"backward": 1, "backward_pre": 1, "global_pre": 2 * layers, "global": 2 * layers,
                "global_backward": layers}  # the forwards: the training step's and the one without gradients
    assert hook_calls(model) == hook_calls(llama) == expected

    model.eval()
    with torch.no_grad():  # a global hook that doubles layer 0's output: the same as a hook of that layer alone
        steer = lambda module, args, out: 2 * out if module is model.model.layers[0] else None  # noqa: E731
        handle = register_module_forward_hook(steer)
        try:
            steered = model(ids).logits
        finally:
            handle.remove()
        handle = model.model.layers[0].register_forward_hook(lambda module, args, out: 2 * out)
        reference = model(ids).logits
        handle.remove()
        assert not torch.allclose(steered, model(ids).logits)
    torch.testing.assert_close(steered, reference, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_half_precision_forward_is_close_to_fp32(mode, dtype):
    model = tiny_model(mode, attn_implementation="sdpa")
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        expected = model(ids).logits
        half = model.to(dtype)(ids).logits
    assert half.dtype == dtype
    assert (half.float() - expected).abs().max() < 0.1


# ----------------------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("mode", MODES)
def test_save_load_round_trip_through_auto(mode, tmp_path):
    model = tiny_model(mode)
    if mode != "v1":
        model.model.layers[0].self_attn.anneal_step.fill_(7)  # training state travels with the weights
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is DiffLlamaForCausalLM
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    if mode != "v1":
        assert loaded.model.layers[0].self_attn.anneal_step.item() == 7
    assert type(AutoModel.from_pretrained(tmp_path)) is DiffLlamaModel


def test_auto_classes_resolve_ours_and_leave_transformers_diffllama_alone(tmp_path):
    assert type(AutoConfig.for_model("diff_llama")) is modeling_diff.DiffLlamaConfig
    ours = AutoModelForCausalLM.from_config(tiny_config("v2"))
    assert type(ours) is DiffLlamaForCausalLM

    from transformers import DiffLlamaConfig as BuiltinConfig
    from transformers import DiffLlamaForCausalLM as BuiltinModel

    builtin_config = AutoConfig.for_model(
        "diffllama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    assert type(builtin_config) is BuiltinConfig
    builtin = AutoModelForCausalLM.from_config(builtin_config)
    assert type(builtin) is BuiltinModel
    builtin.save_pretrained(tmp_path / "builtin")  # a "diffllama" checkpoint loads transformers' classes
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "builtin")) is BuiltinModel


@pytest.mark.parametrize("mode", MODES)
def test_every_parameter_and_buffer_follows_the_device_context(mode):
    """from_pretrained and accelerate build models under `torch.device("meta")`: nothing may stay on the CPU."""
    with torch.device("meta"):
        model = DiffLlamaForCausalLM(tiny_config(mode))
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
