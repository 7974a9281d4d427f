"""Distributed training support: real data-parallel training (2 processes, gloo, CPU), a tensor-parallel plan that
keeps differential head pairs on one rank, the shipped FSDP config, and device_map loading."""

import copy
import fnmatch
import json
import subprocess

import pytest
import torch
from accelerate import infer_auto_device_map
from accelerate.commands.config.config_args import load_config_from_file
from ecosystem_helpers import PYTHON, REPO, offline_env, tiny_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from modeling_diff import DiffLlamaConfig, DiffLlamaForCausalLM


def test_data_parallel_training_two_processes_end_identical(tmp_path):
    out = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "tests" / "ddp_worker.py"), str(tmp_path), "v2"],
        cwd=tmp_path, env=offline_env(tmp_path, PYTHONPATH=str(REPO / "tests")), capture_output=True, text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    weights = [load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]

    assert [r["world_size"] for r in records] == [2, 2]
    assert records[0]["wrapper"] == "DistributedDataParallel"
    seen = [set(r["examples"]) for r in records]
    assert seen[0] and seen[1] and not seen[0] & seen[1]  # each rank trained on its own shard of the data

    torch.manual_seed(1234)  # the worker's initial weights
    initial = DiffLlamaForCausalLM(tiny_config("v2")).state_dict()
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    assert not torch.equal(weights[0]["model.layers.0.self_attn.lambda_proj.weight"],
                           initial["model.layers.0.self_attn.lambda_proj.weight"])


def shard(linear: torch.nn.Linear, style: str, rank: int, world: int) -> torch.nn.Linear:
    """The part of `linear` that `rank` holds under transformers' "colwise" (output features) or "rowwise"
    (input features) tensor parallelism; a row-wise bias is added once, after the sum over ranks."""
    local = copy.deepcopy(linear)
    dim = {"colwise": 0, "rowwise": 1}[style]
    local.weight = torch.nn.Parameter(linear.weight.detach().chunk(world, dim=dim)[rank].clone())
    if linear.bias is not None:
        local.bias = torch.nn.Parameter(linear.bias.detach().chunk(world)[rank].clone()) if style == "colwise" else None
    return local


def tensor_parallel_outputs(module: torch.nn.Module, prefix: str, plan: dict, world: int, *inputs) -> list:
    """Each rank's output of `module` with its Linear children sharded as `plan` says."""
    outputs = []
    for rank in range(world):
        local = copy.deepcopy(module)
        for name, child in module.named_children():
            styles = [style for pattern, style in plan.items() if fnmatch.fnmatchcase(f"{prefix}.{name}", pattern)]
            if styles:
                setattr(local, name, shard(child, styles[0], rank, world))
        output = local(*inputs)
        outputs.append(output[0] if isinstance(output, tuple) else output)
    return outputs


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_tensor_parallel_plan_keeps_head_pairs_together(mode):
    """Shard every planned Linear over 2 ranks: each rank computes attention on its own heads only, and the
    row-wise o_proj partial outputs sum to the unsharded output. A V1 Q1/Q2 or V2 (2i, 2i+1) pair split across
    ranks, or a replicated V2 lambda_proj, would break the sum (or the shapes)."""
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config(mode)).eval()
    plan = model.config.base_model_tp_plan
    world = 2
    assert model.config.num_key_value_heads % world == 0
    hidden = torch.randn(2, 7, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(7)[None])
    layer = model.model.layers[0]
    with torch.no_grad():
        expected = layer.self_attn(hidden, position_embeddings)[0]
        parts = tensor_parallel_outputs(layer.self_attn, "layers.0.self_attn", plan, world, hidden,
                                        position_embeddings)
        torch.testing.assert_close(sum(parts), expected, rtol=1e-5, atol=1e-6)
        parts = tensor_parallel_outputs(layer.mlp, "layers.0.mlp", plan, world, hidden)
        torch.testing.assert_close(sum(parts), layer.mlp(hidden), rtol=1e-5, atol=1e-6)
    planned = {name for name, _ in layer.self_attn.named_children()
               if any(fnmatch.fnmatchcase(f"layers.0.self_attn.{name}", p) for p in plan)}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= planned
    assert mode != "v2" or "lambda_proj" in planned


def test_device_map_loading_splits_at_decoder_layers(tmp_path):
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config("v1")).eval()
    model.save_pretrained(tmp_path / "model")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        expected = model(ids).logits

    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto").eval()
    with torch.no_grad():
        torch.testing.assert_close(auto(ids).logits, expected)

    # Half the weights in memory, the rest offloaded to disk: the map splits between decoder layers only.
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    device_map = infer_auto_device_map(model, max_memory={"cpu": budget, "disk": 10**9},
                                       no_split_module_classes=model._no_split_modules)
    assert set(device_map.values()) == {"cpu", "disk"}
    assert all(name.count(".") <= 2 and ".self_attn" not in name and ".mlp" not in name for name in device_map)
    split = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    with torch.no_grad():
        torch.testing.assert_close(split(ids).logits, expected)


def test_fsdp_config_wraps_the_no_split_layer():
    config = load_config_from_file(str(REPO / "configuration" / "fsdp.yaml"))
    assert config.distributed_type == "FSDP"
    assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] in DiffLlamaForCausalLM._no_split_modules
    assert DiffLlamaForCausalLM._no_split_modules == ["DiffLlamaDecoderLayer"]
    assert "accelerate launch --config_file configuration/fsdp.yaml" in (REPO / "configuration" / "fsdp.yaml").read_text()

def test_tensor_parallel_plan_keeps_a_dex_head_selection_whole():
    """With an explicit dex_heads selection the attention is replicated (every rank computes the whole layer's
    attention) and only the MLP is sharded; the partial MLP outputs sum to the unsharded one."""
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config("dex", dex_heads=[[0, 2], [1]])).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.dex_proj.weight.normal_(0.0, 0.3)  # a live operator on the selected heads
    plan = model.config.base_model_tp_plan
    assert not any(".self_attn." in pattern for pattern in plan)
    hidden = torch.randn(2, 7, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(7)[None])
    layer = model.model.layers[0]
    with torch.no_grad():
        expected = layer.self_attn(hidden, position_embeddings)[0]
        for part in tensor_parallel_outputs(layer.self_attn, "layers.0.self_attn", plan, 2, hidden, position_embeddings):
            torch.testing.assert_close(part, expected)
        parts = tensor_parallel_outputs(layer.mlp, "layers.0.mlp", plan, 2, hidden)
        torch.testing.assert_close(sum(parts), layer.mlp(hidden), rtol=1e-5, atol=1e-6)
    assert DiffLlamaConfig.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"  # the class plan is untouched
