"""transformers' built-in DiffLlama checkpoints ("diffllama") <-> our V1: `convert_checkpoint` / `modeling-diff convert`
import one as an exact V1, and `--to diffllama` exports a V1 back (subln's weight folded into o_proj), checked
against transformers' own DiffLlamaForCausalLM on random checkpoints, in float32."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import DiffLlamaConfig as TransformersDiffLlamaConfig
from transformers import DiffLlamaForCausalLM as TransformersDiffLlamaForCausalLM

from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.conversion import convert_checkpoint
from modeling_diff.conversion.cli import main

TOLERANCE = 1e-5


def transformers_diffllama(seed: int = 0, **overrides) -> TransformersDiffLlamaForCausalLM:
    """A random transformers DiffLlama with GQA (8 query heads, 4 kv heads: 4 differential heads, 2 kv groups)
    and lambda vectors drawn away from zero, so that every half of the permutation matters."""
    fields = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, lambda_std_dev=0.3)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = TransformersDiffLlamaForCausalLM(TransformersDiffLlamaConfig(**fields)).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):  # zero-initialised: random, so that a misplaced bias row shows
                parameter.normal_(0.0, 0.5)
    return model


def token_ids(vocab_size: int = 97, length: int = 24) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))


def saved_architectures(tmp_path) -> list[str]:
    """`architectures` as `save_pretrained` writes it for our model (the loaders TRL and pipelines read it)."""
    from conftest import tiny_model

    tiny_model("v1").save_pretrained(tmp_path / "saved_by_save_pretrained")
    return json.loads((tmp_path / "saved_by_save_pretrained" / "config.json").read_text())["architectures"]


def max_logit_difference(model, reference, ids) -> float:
    with torch.no_grad():
        return (model(ids).logits - reference(ids).logits).abs().max().item()


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "tie_word_embeddings": True},
                                       {"num_key_value_heads": 8}, {"num_key_value_heads": 2, "head_dim": 12}],
                         ids=["gqa", "bias-tied", "mha", "one-kv-group-head-dim"])
def test_a_diffllama_checkpoint_converts_to_an_exact_v1(tmp_path, overrides):
    source = transformers_diffllama(**overrides)
    source.save_pretrained(tmp_path / "diffllama")
    dst = convert_checkpoint(tmp_path / "diffllama", tmp_path / "v1", progress=False)

    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "diff_llama" and config["diff_mode"] == "v1"
    assert config["architectures"] == saved_architectures(tmp_path) and config["lambda_init"] is None
    heads, kv_heads = source.config.num_attention_heads, source.config.num_key_value_heads
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads // 2, kv_heads // 2)
    converted = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert type(converted) is DiffLlamaForCausalLM
    converted.set_attn_implementation("eager")
    assert max_logit_difference(converted, source, token_ids()) <= TOLERANCE
    for layer in converted.model.layers:
        assert torch.equal(layer.self_attn.subln.weight, torch.ones(2 * converted.config.head_dim))


def test_the_permutation_written_out_for_one_layer(tmp_path):
    """Independent of the converter's reshapes: differential head i = query heads (i, i + h), kv group g =
    kv heads (g, g + h_kv), V = [v_g | v_{g + h_kv}]."""
    source = transformers_diffllama()
    source.save_pretrained(tmp_path / "diffllama")
    converted = AutoModelForCausalLM.from_pretrained(
        convert_checkpoint(tmp_path / "diffllama", tmp_path / "v1", progress=False), dtype=torch.float32
    )
    d, h, h_kv = 8, 4, 2
    theirs, ours = source.model.layers[1].self_attn, converted.model.layers[1].self_attn
    q, k, v = (p.weight.detach().unflatten(0, (-1, d)) for p in (theirs.q_proj, theirs.k_proj, theirs.v_proj))
    for i in range(h):
        assert torch.equal(ours.q_proj.weight[(2 * i) * d:(2 * i + 1) * d], q[i])  # Q1 of head i
        assert torch.equal(ours.q_proj.weight[(2 * i + 1) * d:(2 * i + 2) * d], q[i + h])  # Q2 of head i
    for g in range(h_kv):
        assert torch.equal(ours.k_proj.weight[2 * g * d:(2 * g + 2) * d], torch.cat([k[g], k[g + h_kv]]))
        assert torch.equal(ours.v_proj.weight[2 * g * d:(2 * g + 2) * d], torch.cat([v[g], v[g + h_kv]]))
    assert torch.equal(ours.o_proj.weight, theirs.o_proj.weight)
    lambdas = {name.rpartition(".")[2]: p for name, p in ours.named_parameters() if "lambda_" in name}
    assert torch.equal(lambdas["lambda_q2"], theirs.lambda_q2) and ours.lambda_init == theirs.lambda_init


def test_the_cli_converts_a_sharded_diffllama_checkpoint(tmp_path, capsys):
    source = transformers_diffllama()
    source.save_pretrained(tmp_path / "diffllama", max_shard_size="20KB")
    assert (tmp_path / "diffllama" / "model.safetensors.index.json").is_file()
    assert main(["convert", str(tmp_path / "diffllama"), str(tmp_path / "v1"), "--quiet"]) == 0
    assert "method     v1" in capsys.readouterr().out
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    converted.set_attn_implementation("eager")
    assert max_logit_difference(converted, source, token_ids()) <= TOLERANCE


def trained_v1(tmp_path, **overrides) -> DiffLlamaForCausalLM:
    """A V1 from an import whose subln weights then moved away from 1 (as training moves them)."""
    transformers_diffllama(**overrides).save_pretrained(tmp_path / "diffllama")
    model = AutoModelForCausalLM.from_pretrained(
        convert_checkpoint(tmp_path / "diffllama", tmp_path / "imported", progress=False), dtype=torch.float32
    ).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.subln.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_a_v1_exports_to_diffllama_with_subln_folded_into_o_proj(tmp_path, shard, capsys):
    model = trained_v1(tmp_path, attention_bias=True)
    model.save_pretrained(tmp_path / "trained", **({"max_shard_size": shard} if shard else {}))
    assert main(["convert", str(tmp_path / "trained"), str(tmp_path / "back"), "--to", "diffllama", "--quiet"]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "diffllama" and config["architectures"] == ["DiffLlamaForCausalLM"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported) is TransformersDiffLlamaForCausalLM  # transformers' own class, in the same process
    exported.set_attn_implementation("eager")
    assert max_logit_difference(exported, model, token_ids()) <= TOLERANCE


def test_a_v1_trained_from_scratch_round_trips(tmp_path):
    """A V1 built by our config (lambda_init None, the depth schedule) -> diffllama -> V1: the same logits."""
    from conftest import tiny_model

    model = tiny_model("v1")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.subln.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "v1")
    convert_checkpoint(tmp_path / "v1", tmp_path / "diffllama", to="diffllama", progress=False)
    convert_checkpoint(tmp_path / "diffllama", tmp_path / "again", progress=False)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    again.set_attn_implementation("eager")
    assert max_logit_difference(again, model, token_ids()) <= TOLERANCE


@pytest.mark.parametrize(("mode", "overrides", "message"), [
    ("dex", {}, "only diff_mode='v1' exports to 'diffllama'"),
    ("v2", {}, "only diff_mode='v1' exports to 'diffllama'"),
    ("v1", {"lambda_init": 0.5}, "lambda_init must be None"),
    ("v1", {"mlp_bias": True}, "mlp_bias must be False"),
    ("v1", {"attention_dropout": 0.1}, "attention_dropout must be 0"),
])
def test_export_refuses_what_transformers_diffllama_cannot_compute(tmp_path, capsys, mode, overrides, message):
    from conftest import tiny_model

    tiny_model(mode, **overrides).save_pretrained(tmp_path / "src")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "diffllama", "--quiet"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_method_and_heads_are_refused_for_a_diffllama_source(tmp_path):
    transformers_diffllama().save_pretrained(tmp_path / "diffllama")
    with pytest.raises(ValueError, match="method and heads must be left unset"):
        convert_checkpoint(tmp_path / "diffllama", tmp_path / "out", method="dex", progress=False)
    with pytest.raises(ValueError, match="to='diffllama' needs a 'diff_llama' source"):
        convert_checkpoint(tmp_path / "diffllama", tmp_path / "out", to="diffllama", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_odd_head_count_in_a_diffllama_config_is_refused(tmp_path):
    transformers_diffllama().save_pretrained(tmp_path / "diffllama")
    config = json.loads((tmp_path / "diffllama" / "config.json").read_text())
    config["num_attention_heads"] = 7
    (tmp_path / "diffllama" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_attention_heads must be even in a diffllama config"):
        convert_checkpoint(tmp_path / "diffllama", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
