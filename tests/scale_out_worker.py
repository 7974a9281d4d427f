"""One rank of the scale-out tests (launched by tests/test_distributed.py through torchrun: 2 processes, gloo, CPU).

For every model variant saved in DIR by the test, each engine runs one training step on a fixed global batch and
writes, per variant and engine, the loss and the full (unsharded) gradient of every parameter; rank 0 also runs
the same step in one process, the reference the test compares against:
- `fsdp2`: `torch.distributed.fsdp.fully_shard` on every decoder layer and the root (each rank half the batch);
- `fsdp2_fast`: the same on the project's kernels (`attn_implementation="diff_triton"`);
- `hsdp`: `fully_shard` on a 2-D (replicate, shard) mesh, two micro-batches of gradient accumulation per rank;
- `ddp`: `DistributedDataParallel` (each rank half the batch);
- `tp`: `from_pretrained(..., tp_plan="auto")` (every rank the whole batch, heads split over the ranks);
- `fsdp2_bf16`: `fully_shard` of the bfloat16-loaded model (one dtype for every parameter), one step;
- `zero_anneal_steps`: every rank's annealing steps t after one step of DDP with torch's ZeroRedundancyOptimizer;
and, for each model `*-one-kv-head`, the error of a tensor-parallel forward (2 ranks cannot divide one kv head);
and after the FSDP2 step an optimizer step, the full state dict gathered and saved with `save_pretrained`,
reloaded with `from_pretrained` (rank 0), its logits written next to the sharded model's; `save_for_hub` called on
every rank for the FSDP2 model (DIR/VARIANT-hub-fsdp2) and the tensor-parallel one (DIR/VARIANT-hub-tp).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

import modeling_diff  # noqa: F401  (registers the Auto classes)
from modeling_diff import modeling_diff_llama
from modeling_diff.hub import save_for_hub

torch.set_num_threads(1)


def load(path: Path, attn_implementation: str = "eager", **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # every sequence as long as the others: the mean of the means


def gradients(model) -> dict[str, list[float]]:
    return {name: full(p.grad).flatten().tolist() for name, p in model.named_parameters() if p.grad is not None}


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def shard_layers(model, mesh) -> None:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_variant(path: Path, out: Path, batch: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = batch.chunk(world)[rank]  # (B / world, L)
    results = {}

    if rank == 0:  # the reference: one process, the whole batch
        reference = load(path)
        loss = loss_of(reference, batch)
        loss.backward()
        results["reference"] = {"loss": loss.item(), "grads": gradients(reference)}

    fsdp = load(path)
    shard_layers(fsdp, init_device_mesh("cpu", (world,)))
    loss = loss_of(fsdp, local)
    loss.backward()
    results["fsdp2"] = {"loss": mean_over_ranks(loss), "grads": gradients(fsdp)}
    # A sharded model trained one step, gathered, saved and reloaded as a plain model.
    torch.optim.SGD(fsdp.parameters(), lr=0.1).step()
    with torch.no_grad():
        sharded_logits = fsdp(input_ids=batch).logits
    state = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        fsdp.save_pretrained(out / "saved", state_dict=state)
        with torch.no_grad():
            reloaded_logits = load(out / "saved")(input_ids=batch).logits
        results["saved"] = {"max_abs_diff": (reloaded_logits - sharded_logits).abs().max().item()}
    # save_for_hub called on every rank, as save_pretrained is: rank 0 writes the folder
    save_for_hub(fsdp, path.parent / f"{path.name}-hub-fsdp2", state_dict=state, is_main_process=rank == 0)

    # The project's kernels under fully_shard (Triton's interpreter on the CPU): RMSNorm, RoPE and the MLP's node,
    # which reads the unsharded Linear weights directly.
    fast = load(path, attn_implementation="diff_triton")
    shard_layers(fast, init_device_mesh("cpu", (world,)))
    mlp_calls, mlp = [], modeling_diff_llama.swiglu_mlp
    modeling_diff_llama.swiglu_mlp = lambda *args: mlp_calls.append(1) or mlp(*args)
    loss = loss_of(fast, local)
    modeling_diff_llama.swiglu_mlp = mlp
    loss.backward()
    results["fsdp2_fast"] = {"loss": mean_over_ranks(loss), "grads": gradients(fast), "mlp_calls": len(mlp_calls)}

    hsdp = load(path)
    shard_layers(hsdp, init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
    micro_batches = local.chunk(2)
    for i, micro in enumerate(micro_batches):
        hsdp.set_requires_gradient_sync(i == len(micro_batches) - 1)
        (loss_of(hsdp, micro) / len(micro_batches)).backward()
    results["hsdp"] = {"loss": None, "grads": gradients(hsdp)}

    ddp = DistributedDataParallel(load(path))
    loss = loss_of(ddp, local)
    loss.backward()
    results["ddp"] = {"loss": mean_over_ranks(loss), "grads": gradients(ddp.module)}

    tp = load(path, tp_plan="auto")
    loss = loss_of(tp, batch)
    loss.backward()
    results["tp"] = {"loss": loss.item(), "grads": gradients(tp)}
    # every rank, is_main_process left at its default: the weights are gathered from both ranks, rank 0 writes
    save_for_hub(tp, path.parent / f"{path.name}-hub-tp")
    with torch.no_grad():
        generated = tp.generate(batch[:1, :4], max_new_tokens=4, do_sample=False)
    results["tp_generate"] = generated.tolist()

    # torch's ZeroRedundancyOptimizer steps its shard's optimizer inside its own step. Only the differential
    # parameters train, so a layer's may all lie in one rank's shard: t must still advance once, on every rank.
    zero_model = load(path)
    for name, parameter in zero_model.named_parameters():
        parameter.requires_grad_(any(key in name for key in ("lambda_proj", "dex_proj", "dex_lambda", "diff_lambda")))
    zero = DistributedDataParallel(zero_model, broadcast_buffers=False)  # each rank keeps its own t
    optimizer = ZeroRedundancyOptimizer([p for p in zero.parameters() if p.requires_grad],
                                        optimizer_class=torch.optim.AdamW, lr=1e-3)
    loss_of(zero, local).backward()
    optimizer.step()
    steps = [module.anneal_step.item() for module in zero_model.modules() if hasattr(module, "anneal_step")]
    results["zero_anneal_steps"] = [None] * world
    dist.all_gather_object(results["zero_anneal_steps"], steps)

    bf16 = load(path, dtype=torch.bfloat16)
    shard_layers(bf16, init_device_mesh("cpu", (world,)))
    loss = loss_of(bf16, local)
    loss.backward()
    results["fsdp2_bf16"] = {"loss": mean_over_ranks(loss.float()), "dtypes": sorted(
        {str(p.dtype) for p in bf16.parameters()})}
    return results


def tensor_parallel_refusal(path: Path, batch: torch.Tensor) -> str | None:
    """The error of a forward of the model at `path` under tensor parallelism (one kv head: 2 ranks cannot divide
    it), None if there is none."""
    model = load(path, tp_plan="auto")
    try:
        model(input_ids=batch)
    except ValueError as error:
        return str(error)
    return None


def main(root: Path) -> None:
    dist.init_process_group("gloo")
    batch = torch.load(root / "batch.pt")
    for variant in json.loads((root / "variants.json").read_text()):
        results = run_variant(root / variant, root / f"{variant}-rank{dist.get_rank()}", batch)
        (root / f"{variant}-rank{dist.get_rank()}.json").write_text(json.dumps(results))
    refusals = {path.name: tensor_parallel_refusal(path, batch) for path in sorted(root.glob("*-one-kv-head"))}
    (root / f"refusals-rank{dist.get_rank()}.json").write_text(json.dumps(refusals))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
