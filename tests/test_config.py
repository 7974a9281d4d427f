"""DiffLlamaConfig: defaults per mode, presets, and a clear ValueError for every invalid combination."""

import re

import pytest
import torch
from transformers import AutoConfig

from modeling_diff import DiffLlamaConfig, preset_config
from modeling_diff.configuration import PRESETS


@pytest.mark.parametrize("mode, head_dim", [("v1", 2048 // (2 * 16)), ("v2", 2048 // 16), ("dex", 2048 // 16)])
def test_default_head_dim_per_mode(mode, head_dim):
    config = DiffLlamaConfig(diff_mode=mode, hidden_size=2048, num_attention_heads=16)
    assert config.head_dim == head_dim
    assert config.num_key_value_heads == 16
    assert config.model_type == "diff_llama"


def test_explicit_head_dim_is_kept():
    assert DiffLlamaConfig(diff_mode="v1", hidden_size=96, num_attention_heads=4, head_dim=16).head_dim == 16


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name):
    config = preset_config(name)
    assert config.diff_mode == PRESETS[name]["diff_mode"]


def test_round_trip_through_dict_and_auto_config(tmp_path):
    config = DiffLlamaConfig(diff_mode="dex", num_hidden_layers=2, dex_heads=[[0, 3], [1]], anneal_steps=10)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is DiffLlamaConfig
    assert loaded.dex_heads == [[0, 3], [1]] and loaded.anneal_steps == 10 and loaded.diff_mode == "dex"


@pytest.mark.parametrize(
    "fields, field_named",
    [
        (dict(diff_mode="v3"), "diff_mode"),
        (dict(num_attention_heads=6, num_key_value_heads=4, head_dim=8), "num_key_value_heads"),
        (dict(diff_mode="v1", hidden_size=100, num_attention_heads=8), "hidden_size"),
        (dict(diff_mode="v2", hidden_size=100, num_attention_heads=8), "hidden_size"),
        (dict(head_dim=7), "head_dim"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(lambda_std_dev=-0.1), "lambda_std_dev"),
        (dict(anneal_steps=-1), "anneal_steps"),
        (dict(diff_mode="v1", dex_heads=[[0], [0]]), "dex_heads"),
        (dict(diff_mode="dex", dex_heads=[[0]]), "dex_heads"),
        (dict(diff_mode="dex", dex_heads=[[0], [16]]), "dex_heads[1]"),
        (dict(diff_mode="dex", dex_heads=[[0, 0], [1]]), "dex_heads[0]"),
        # issue 14: values that used to be accepted silently, or crashed with another error
        (dict(diff_mode="dex", dex_heads=[[True], [1]]), "dex_heads[0]"),
        (dict(diff_mode="dex", dex_heads=[0, 1]), "dex_heads must hold one list of head indices per layer"),
        (dict(diff_mode="v1", lambda_init=1.0), r"lambda_init must be in [0, 1), got 1.0"),
        (dict(diff_mode="v1", lambda_init=-0.1), "lambda_init must be in [0, 1)"),
        (dict(diff_mode="dex", lambda_init=float("nan")), "lambda_init must be in [0, 1), got nan"),
        (dict(diff_mode="v1", lambda_init=float("inf")), "lambda_init must be in [0, 1), got inf"),
        (dict(diff_mode="v2", lambda_init=0.5), "lambda_init is not used by diff_mode='v2'"),
        (dict(lambda_std_dev=float("inf")), "lambda_std_dev must be in [0, 1]"),
        (dict(lambda_std_dev=1e6), "lambda_std_dev must be in [0, 1]"),
        (dict(lambda_std_dev=float("nan")), "lambda_std_dev must be in [0, 1], got nan"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps must be > 0 and at most 1"),
        (dict(rms_norm_eps=-1e-5), "rms_norm_eps must be > 0"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be > 0 and at most 1, got nan"),
        (dict(rms_norm_eps=float("inf")), "rms_norm_eps must be > 0 and at most 1, got inf"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), r"rope_parameters['rope_theta'] must be >= 1"),
        (dict(rope_theta=-10000.0), r"rope_parameters['rope_theta'] must be >= 1"),  # the legacy keyword
        # a NaN factor made every rotary frequency, and every logit, NaN; transformers only warns below 1
        (dict(rope_parameters={"rope_type": "linear", "factor": float("nan")}),
         "rope_parameters['factor'] must be >= 1 and finite, got nan"),
        (dict(rope_parameters={"rope_type": "linear", "factor": float("inf")}), "rope_parameters['factor'] must be >= 1"),
        (dict(rope_parameters={"rope_type": "linear", "factor": -2.0}), "rope_parameters['factor'] must be >= 1"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": float("nan")}),
         "rope_parameters['partial_rotary_factor'] must be in (0, 1], got nan"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.5}),
         "rope_parameters['partial_rotary_factor'] must be in (0, 1]"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": float("nan"),
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
         "rope_parameters['low_freq_factor'] must be a finite number, got nan"),
        # audit: below 1 the inverse frequencies theta^(-2i/d) / factor grow; 1e-300 overflowed them (NaN logits)
        (dict(rope_theta=1e-300), "rope_parameters['rope_theta'] must be >= 1 and finite, got 1e-300"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 1e-300}),
         "rope_parameters['factor'] must be >= 1 and finite, got 1e-300"),
        # a KeyError and a ZeroDivisionError when the model was built
        (dict(rope_parameters={"rope_type": "foo", "rope_theta": 10000.0}),
         "rope_parameters['rope_type'] must be one of default, linear, dynamic, yarn"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 0}),
         "rope_parameters['original_max_position_embeddings'] must be a positive integer, got 0"),
        # every head is rotated whole: a bare shape error in the first forward (partial) or when the model was built
        # (LongRoPE's lists); Llama's default RoPE ignores partial_rotary_factor, and so does ours
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}),
         "rope_parameters['partial_rotary_factor'] must be 1 with rope_type 'linear': every head is rotated whole "
         "(head_dim 8), got 0.5"),
        (dict(diff_mode="v2", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 3,
                                               "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}),
         "rope_parameters['short_factor'] must hold head_dim / 2 = 8 factors, got 3"),
        # a KeyError out of transformers' validation
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0}),
         "Missing required keys in `rope_parameters` for 'rope_type'='linear': {'factor'}"),
        # a dtype the saved weights cannot have: the output did not load with dtype="auto"; an AttributeError
        (dict(dtype="int8"), "dtype must be a floating-point torch dtype the model computes in (float32, bfloat16, "
                             "float16 or float64), got 'int8'"),
        (dict(dtype="float8_e4m3fn"), "dtype must be a floating-point torch dtype the model computes in"),
        (dict(dtype=torch.float8_e5m2), "dtype must be a floating-point torch dtype the model computes in"),
        (dict(torch_dtype="float99"), "torch_dtype must be a floating-point torch dtype"),
        # t / T overflowed int64 in the first forward
        (dict(diff_mode="v2", anneal_steps=10**23), "anneal_steps must be an integer in [0, 2**31), got 1000000000"),
        # a nested list was a TypeError (unhashable)
        (dict(diff_mode="dex", dex_heads=[[[0]], [[0]]]), "dex_heads[0] must hold distinct head indices in [0, 16)"),
        (dict(attention_dropout=1.0), "attention_dropout must be in [0, 1)"),
        (dict(attention_dropout=-0.1), "attention_dropout must be in [0, 1)"),
        (dict(intermediate_size=0), "intermediate_size must be a positive integer"),
        (dict(max_position_embeddings=-1), "max_position_embeddings must be a positive integer"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(initializer_range=float("inf")), "initializer_range must be >= 0 and at most 1, got inf"),
        # audit: a standard deviation of 1e300 overflowed float32 and made every logit NaN
        (dict(initializer_range=1e300), "initializer_range must be >= 0 and at most 1, got 1e+300"),
        (dict(initializer_range=-0.02), "initializer_range must be >= 0 and at most 1"),
        # a bos id outside the embedding was an IndexError in generate() without a prompt; an eos id outside the
        # vocabulary is never sampled, so generation ran to max_length (transformers itself does not check either)
        (dict(bos_token_id=32000), "bos_token_id must be None or a token id in [0, 32000), got 32000"),
        (dict(bos_token_id=-1), "bos_token_id must be None or a token id in [0, 32000), got -1"),
        (dict(eos_token_id=40000), "eos_token_id must be None or a token id or a list of token ids in [0, 32000)"),
        (dict(eos_token_id=[2, 32000]), "eos_token_id must be None or a token id or a list of token ids in [0, 32000), "
                                        "got [2, 32000]"),
        (dict(hidden_act="swoosh"), "hidden_act must be one of transformers' activations"),
        (dict(diff_mode="v1", anneal_steps=100), "anneal_steps is not used by diff_mode='v1'"),
        # audit: an epsilon that outweighs the mean square it is added to no longer normalises (1e300 was accepted)
        (dict(rms_norm_eps=1e300), "rms_norm_eps must be > 0 and at most 1, got 1e+300"),
        (dict(rms_norm_eps=2.0), "rms_norm_eps must be > 0 and at most 1, got 2.0"),
        # a padding row outside the embedding was an AssertionError from nn.Embedding when the model was built
        (dict(pad_token_id=32000), "pad_token_id must be None, -1 or a token id in [0, 32000), got 32000"),
        (dict(pad_token_id=-2), "pad_token_id must be None, -1 or a token id in [0, 32000), got -2"),
        # a DEX model without a single DEX head (the converter refuses that selection too)
        (dict(diff_mode="dex", dex_heads=[[], []]), "dex_heads selects no head in any layer"),
        # wrong types: a ValueError naming the field, not @strict's own exception type
        (dict(hidden_size="256"), "hidden_size has the wrong type"),
        (dict(num_hidden_layers=2.0), "num_hidden_layers has the wrong type"),
        (dict(lambda_std_dev="0.1"), "lambda_std_dev has the wrong type"),
        (dict(diff_mode=2), "diff_mode has the wrong type"),
        (dict(hidden_size=True), "hidden_size"),
    ],
)
def test_invalid_configs_name_the_field(fields, field_named):
    base = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=2)
    with pytest.raises(ValueError, match=re.escape(field_named)):
        DiffLlamaConfig(**{**base, **fields})


@pytest.mark.parametrize("fields", [
    dict(pad_token_id=None), dict(pad_token_id=0), dict(pad_token_id=31999),
    dict(pad_token_id=-1),  # some Llama checkpoints on the Hub carry it (transformers only warns; nn.Embedding's last row)
    dict(rms_norm_eps=1e-12),
    dict(initializer_range=0.0), dict(initializer_range=1.0),
    dict(dtype=torch.bfloat16), dict(diff_mode="v2", anneal_steps=2**31 - 1),
    dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8192}),
    dict(bos_token_id=None, eos_token_id=None), dict(bos_token_id=31999, eos_token_id=[0, 31999]),
    dict(rms_norm_eps=1.0),  # what transformers' tester mixins set (set_config_for_less_flaky_test)
    # Llama's default RoPE ignores partial_rotary_factor (a Llama checkpoint carrying it loads); LongRoPE's lists of
    # head_dim / 2 (V1: head_dim 8)
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                          "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}),
    dict(diff_mode="dex", dex_heads=[[0], []]),  # a layer without DEX heads is Llama attention: `--heads '[[0],[]]'`
])
def test_values_real_checkpoints_and_conversions_carry_are_accepted(fields):
    base = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=2)
    config = DiffLlamaConfig(**{**base, **fields})
    assert all(getattr(config, field) == value for field, value in fields.items())


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        preset_config("huge-v9")


@pytest.mark.parametrize("field, value, field_named", [
    ("num_attention_heads", 2, "dex_heads[0] must hold distinct head indices in [0, 2), got [0, 3]"),
    ("num_key_value_heads", 3, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be > 0 and at most 1, got nan"),
    ("vocab_size", 16, "pad_token_id must be None, -1 or a token id in [0, 16), got 20"),
])
def test_a_config_changed_after_it_was_made_is_checked_when_a_model_is_built(field, value, field_named):
    """Attributes set after the config was made (as transformers' tester mixins do) are checked again by the model."""
    from modeling_diff import DiffLlamaForCausalLM

    config = DiffLlamaConfig(diff_mode="dex", dex_heads=[[0, 3], [1]], hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64, vocab_size=32,
                             pad_token_id=20)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=re.escape(field_named)):
        DiffLlamaForCausalLM(config)
