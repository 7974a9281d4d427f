"""Tensor-parallel styles for the differential parameters, registered with transformers' style registry.

Under the plan of `DiffLlamaConfig` (q/k/v column-wise, o_proj row-wise) each rank computes attention on its own
heads. The differential parameters are not split by head: V1's lambda vectors and `subln`, DEX's f_D (`dex_proj`)
and lambda are held whole by every rank, and each rank's gradient of them is the share of its own heads. The
style `diff_replicated_grad_allreduce` sums the shares; `dex_head_slice` does the same for DEX's lambda module and
tells it which heads of its mask the rank holds.

transformers >= 5.23 ships a similar `replicated_with_grad_allreduce`; ours also works on 5.17 (whose version
runs a module backward hook, which a module called without tensor inputs, like `DifferentialLambda`, never
triggers) and is exact under gradient accumulation: the shares are summed before they are accumulated into
`.grad`, so each micro-batch is reduced once.
"""

import torch
import torch.distributed as dist
from torch import nn
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

REPLICATED_GRAD_ALLREDUCE = "diff_replicated_grad_allreduce"
DEX_HEAD_SLICE = "dex_head_slice"


class ReplicatedGradAllReduce(TensorParallelLayer):
    """Parameters held whole on every rank, gradients summed over the tensor-parallel group."""

    def install_forward(self, module: nn.Module, mesh, **options) -> nn.Module:
        """A forward pre-hook, not a replaced `forward`: transformers >= 5.25 kernelizes hub-kernel layers after the
        plan is applied, which sets a kernelized layer's forward again (the project's norms are kept out of it,
        `kernels.keep_own_forward`, but a style must not depend on the layer). `options`: what newer transformers
        pass (5.25: config, mesh_manager); this style needs none of them."""
        group = mesh.get_group()
        # The gradient hooks are attached at the first forward of each parameter object: loading weights replaces
        # the parameters after the plan is applied, which would drop hooks attached here.
        hooked: dict[str, nn.Parameter] = {}

        def summed_over_ranks(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        def attach_gradient_hooks(module, args):
            if torch.is_grad_enabled():
                for name, parameter in module.named_parameters(recurse=False):
                    if parameter.requires_grad and hooked.get(name) is not parameter:
                        parameter.register_hook(summed_over_ranks)
                        hooked[name] = parameter

        module.register_forward_pre_hook(attach_gradient_hooks)
        return module


class DexHeadSlice(ReplicatedGradAllReduce):
    """DEX's `DexLambda`: gradients summed as above, and the rank's slice of the head mask selected (q_proj's
    rows, hence the heads, are split into contiguous equal chunks, one per rank)."""

    def install_forward(self, module: nn.Module, mesh, **options) -> nn.Module:
        heads, ranks, rank = module.num_heads, mesh.size(), mesh.get_local_rank()
        if heads % ranks != 0:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by the tensor-parallel size ({ranks})")
        per_rank = heads // ranks
        module.head_slice = slice(rank * per_rank, (rank + 1) * per_rank)
        return super().install_forward(module, mesh, **options)


ALL_PARALLEL_STYLES.register(REPLICATED_GRAD_ALLREDUCE, ReplicatedGradAllReduce())
ALL_PARALLEL_STYLES.register(DEX_HEAD_SLICE, DexHeadSlice())

__all__ = ["DEX_HEAD_SLICE", "REPLICATED_GRAD_ALLREDUCE", "DexHeadSlice", "ReplicatedGradAllReduce"]
