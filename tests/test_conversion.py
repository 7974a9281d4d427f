"""In-memory conversion of tiny random Llama-family models: identity, layouts, head selection, errors."""

import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from modeling_diff import DiffLlamaForCausalLM, set_anneal_step
from modeling_diff.conversion import attention_entropy, convert_model, resolve_heads, top_entropy_heads
from modeling_diff.conversion.cli import main
from modeling_diff.conversion.mapping import TensorMapping

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
ARCHITECTURES = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig, {}),
    "llama-mqa-tied-bias": (LlamaForCausalLM, LlamaConfig,
                            dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=None)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
}


def tiny_llama(architecture: str = "llama-gqa", seed: int = 0, **overrides):
    """A random 3-layer source model of transformers' own classes (GQA: 4 heads, 2 kv heads by default)."""
    model_class, config_class, fields = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SHAPE, **fields, **overrides})).eval()
    with torch.no_grad():  # q/k/v biases start at zero in transformers: make them matter
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    return model


def token_ids(batch=2, length=24, seed=1):
    return torch.randint(3, SHAPE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("method,heads", [("dex", None), ("dex", "all"), ("dex", [1, 3]), ("v2", None)])
def test_converted_model_has_the_source_logits(architecture, method, heads):
    source, ids = tiny_llama(architecture), token_ids()
    converted = convert_model(source, method=method, heads=heads, calibration=ids, anneal_steps=10, progress=False)
    assert isinstance(converted, DiffLlamaForCausalLM) and converted.config.diff_mode == method
    with torch.no_grad():
        assert (converted(ids).logits - source(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("method", ["dex", "v2"])
def test_converted_model_generates_like_the_source_with_a_kv_cache(method):
    source, prompt = tiny_llama(), token_ids(batch=1, length=5)
    heads = "all" if method == "dex" else None
    converted = convert_model(source, method=method, heads=heads, anneal_steps=10, progress=False)
    generate = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(converted.generate(prompt, **generate), source.generate(prompt, **generate))


def test_v2_pairs_each_source_head_with_its_noise_head():
    source = tiny_llama()
    d, h = source.config.head_dim, source.config.num_attention_heads
    for noise_init in ("copy", "zeros"):
        converted = convert_model(source, method="v2", anneal_steps=5, noise_init=noise_init, progress=False)
        q_source = source.model.layers[1].self_attn.q_proj.weight.view(h, d, -1)
        q_pairs = converted.model.layers[1].self_attn.q_proj.weight.view(h, 2, d, -1)
        torch.testing.assert_close(q_pairs[:, 0], q_source, rtol=0, atol=0)
        expected_noise = q_source if noise_init == "copy" else torch.zeros_like(q_source)
        torch.testing.assert_close(q_pairs[:, 1], expected_noise, rtol=0, atol=0)
        assert not converted.model.layers[1].self_attn.lambda_proj.weight.any()


def test_v2_noise_enters_with_the_anneal_factor():
    """With a copied noise head and lambda_proj = 0, pair i outputs A_i - f * sigmoid(0) * A_i = (1 - f/2) A_i:
    the source Llama with o_proj scaled by (1 - f/2), f = min(1, t/T)."""
    source, ids = tiny_llama(), token_ids()
    converted = convert_model(source, method="v2", anneal_steps=4, progress=False)
    for step, factor in ((2, 0.5), (4, 1.0), (9, 1.0)):
        set_anneal_step(converted, step)
        reference = tiny_llama()
        with torch.no_grad():
            for layer in reference.model.layers:
                layer.self_attn.o_proj.weight.mul_(1 - factor / 2)
            torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method,heads", [("dex", "all"), ("dex", [1, 3]), ("v2", None)])
def test_a_source_cast_to_16_bits_converts_to_its_own_logits_and_tokens(dtype, method, heads):
    """`.to(torch.bfloat16)` casts a Llama's inverse RoPE frequencies too (a buffer outside the state dict), and the
    Llama rotates with the rounded ones: the converted model must, or it is not the source (logits were 0.19 off)."""
    source, ids = tiny_llama(initializer_range=0.2).to(dtype), token_ids()
    assert source.model.rotary_emb.inv_freq.dtype == dtype  # what the test is about
    converted = convert_model(source, method=method, heads=heads, anneal_steps=10, progress=False)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, source(ids).logits)
    prompt = ids[:, :8]
    assert torch.equal(converted.generate(prompt, max_new_tokens=12, do_sample=False),
                       source.generate(prompt, max_new_tokens=12, do_sample=False))


def test_converted_model_does_not_share_or_change_the_source_weights():
    source = tiny_llama()
    before = {name: t.clone() for name, t in source.state_dict().items()}
    converted = convert_model(source, heads="all", progress=False)
    with torch.no_grad():
        for parameter in converted.parameters():
            parameter.add_(1.0)
    for name, tensor in source.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_tied_embeddings_stay_tied():
    converted = convert_model(tiny_llama("llama-mqa-tied-bias"), heads="all", progress=False)
    assert converted.lm_head.weight is converted.model.embed_tokens.weight


def test_dex_adds_zero_f_d_lambda_init_and_step_zero():
    converted = convert_model(tiny_llama(), heads=[[0], [1, 2], [3]], anneal_steps=7, progress=False)
    assert converted.config.dex_heads == [[0], [1, 2], [3]] and converted.config.anneal_steps == 7
    for layer_idx, layer in enumerate(converted.model.layers):
        attention = layer.self_attn
        assert not attention.dex_proj.weight.any() and attention.anneal_step.item() == 0
        assert attention.dex_lambda.lambda_learn.dtype == attention.q_proj.weight.dtype  # one dtype for FSDP2
        assert attention.dex_lambda.lambda_learn.item() == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * layer_idx))


def test_converted_model_round_trips_through_auto_model(tmp_path):
    source, ids = tiny_llama("qwen2"), token_ids()
    converted = convert_model(source, calibration=ids, progress=False)
    converted.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, DiffLlamaForCausalLM) and reloaded.config.dex_heads == converted.config.dex_heads
    with torch.no_grad():
        assert (reloaded(ids).logits - source(ids).logits).abs().max() <= 1e-4


def test_entropy_matches_transformers_attention_maps():
    """Reference: transformers' own eager Llama with output_attentions, entropy written out here."""
    source, ids = tiny_llama(), token_ids(length=16)
    source.set_attn_implementation("eager")
    with torch.no_grad():
        maps = source(ids, output_attentions=True).attentions  # per layer (B, h, L, L)
    reference = torch.stack([-(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean(dim=(0, 2)) for p in maps])
    mapping = TensorMapping.for_source(source.config)
    entropy = attention_entropy(source.state_dict().__getitem__, mapping, ids, progress=False)
    torch.testing.assert_close(entropy, reference, rtol=1e-4, atol=1e-5)

    converted = convert_model(source, head_fraction=0.25, calibration=ids, progress=False)
    assert converted.config.dex_heads == [[int(row.argmax())] for row in reference]  # ceil(0.25 * 4) = 1 head


def test_top_entropy_heads_rounds_the_fraction_up():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7], [5.0, 4.0, 3.0, 2.0, 1.0]])
    assert top_entropy_heads(entropy, 0.5) == [[1, 2, 4], [0, 1, 2]]  # ceil(2.5) = 3 heads
    assert top_entropy_heads(entropy, 1.0) == [[0, 1, 2, 3, 4]] * 2


def test_text_calibration_uses_the_tokenizer():
    class CharTokenizer:
        def __call__(self, text, return_tensors):
            return type("Encoding", (), {"input_ids": torch.tensor([[3 + ord(c) % 200 for c in text]])})

    source = tiny_llama()
    text = "To be, or not to be, that is the question."
    by_text = convert_model(source, calibration=text, tokenizer=CharTokenizer(), progress=False)
    by_ids = convert_model(source, calibration=CharTokenizer()(text, "pt").input_ids, progress=False)
    assert by_text.config.dex_heads == by_ids.config.dex_heads


def test_resolve_heads():
    assert resolve_heads("all", 2, 3) == [[0, 1, 2], [0, 1, 2]]
    assert resolve_heads("entropy", 2, 3) is None
    assert resolve_heads([2, 0], 2, 3) == [[0, 2], [0, 2]]
    assert resolve_heads([[1], []], 2, 3) == [[1], []]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(method="v3"), "method must be one of"),
        (dict(method="v2", anneal_steps=0), "anneal_steps must be >= 1 for method='v2'"),
        (dict(anneal_steps=-1), "anneal_steps must be an integer >= 0"),
        (dict(method="v2", noise_init="random"), "noise_init must be one of"),
        (dict(method="v2", heads="all"), "heads applies to method='dex' only"),
        (dict(), "needs calibration text or token ids"),
        (dict(heads="best"), "heads must be one of"),
        (dict(heads=[[0], [1]]), r"one such list per layer \(3\)"),
        (dict(heads=[[0], [4], [1]]), r"heads\[1\] must hold distinct head indices in \[0, 4\)"),
        (dict(heads=[0, 0]), "distinct head indices"),
        (dict(calibration=token_ids(), head_fraction=0.0), r"head_fraction must be in \(0, 1\]"),
        (dict(calibration=token_ids(), head_fraction=1.5), r"head_fraction must be in \(0, 1\]"),
        (dict(calibration=token_ids(), head_fraction=math.nan), r"head_fraction must be in \(0, 1\], got nan"),
        (dict(heads=[True]), r"heads\[0\] must hold distinct head indices .* not booleans"),
        (dict(heads=[[True], [1], [0]]), r"heads\[0\] must hold distinct head indices .* not booleans"),
        (dict(heads=[[0], 1, [2]]), r"one such list per layer \(3\)"),
        # nested deeper, or a dict in a layer's list: a TypeError (unhashable) before
        (dict(heads=[[[0]], [[0]], [[0]]]), r"heads\[0\] must hold distinct head indices in \[0, 4\)"),
        (dict(heads=[[0], [1], [{"a": 1}]]), r"heads\[2\] must hold distinct head indices in \[0, 4\)"),
        (dict(heads=[]), "heads selects no head"),
        (dict(heads=[[], [], []]), "heads selects no head"),
        (dict(heads=3), "heads must be one of"),
        (dict(calibration=token_ids() + 300), r"calibration token ids must lie in \[0, vocab_size=300\)"),
        (dict(calibration=token_ids() - 10), r"calibration token ids must lie in \[0, vocab_size=300\)"),
        (dict(calibration=token_ids().float()), "calibration must be integer token ids"),
        (dict(calibration=torch.ones(2, 1, dtype=torch.long)),
         r"calibration token ids must have shape \(batch, length >= 2\): at least 2 tokens"),
        (dict(calibration="text"), "calibration text needs a tokenizer"),
    ],
)
def test_bad_arguments_raise_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        convert_model(tiny_llama(), progress=False, **kwargs)


def test_unsupported_sources_raise_value_errors():
    with pytest.raises(ValueError, match="sliding_window must be None"):
        convert_model(tiny_llama("mistral", sliding_window=16), heads="all", progress=False)
    with pytest.raises(ValueError, match=r"use_sliding_window must be False, or max_window_layers >= "
                                         r"num_hidden_layers \(3\), got max_window_layers 1"):
        convert_model(tiny_llama("qwen2", use_sliding_window=True, max_window_layers=1), heads="all", progress=False)
    with pytest.raises(ValueError, match="model_type must be one of"):
        convert_model(DiffLlamaForCausalLM(convert_model(tiny_llama(), heads="all", progress=False).config),
                      heads="all", progress=False)


def test_a_qwen2_whose_sliding_window_reaches_no_layer_converts_exactly():
    """use_sliding_window with max_window_layers >= num_hidden_layers: transformers slides no layer, and the
    conversion was refused all the same."""
    source, ids = tiny_llama("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=3), token_ids()
    converted = convert_model(source, heads="all", progress=False)
    with torch.no_grad():
        assert (converted(ids).logits - source(ids).logits).abs().max() <= 1e-4


def test_readme_dex_section_runs(tmp_path, monkeypatch):
    """The python snippets of the README's DEX section run as written; its `modeling-diff` lines run via `main`."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("<!-- section:dex -->"):text.index("<!-- /section:dex -->")]
    python_blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    command_lines = [line for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
                     for line in block.splitlines() if line.startswith("modeling-diff ")]
    assert python_blocks and len(command_lines) == 2
    monkeypatch.chdir(tmp_path)
    for block in python_blocks:
        exec(compile(block, "README.md", "exec"), {})
    for line in command_lines:
        assert main(shlex.split(line)[1:] + ["--quiet"]) == 0
    assert (tmp_path / "out" / "tiny-v2" / "config.json").is_file()
