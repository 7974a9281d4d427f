"""What a fast path may take over from a module it reads the weights of directly."""

from torch import nn


def is_plain_linear(module: nn.Module) -> bool:
    """A torch Linear as built: its own Parameter and no hooks. Not PEFT's LoRA layers, a tensor-parallel,
    offloading (accelerate's `_hf_hook` forward) or quantized layer: those keep their own forward."""
    return (
        type(module) is nn.Linear
        and type(module.weight) is nn.Parameter
        and not (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))
    )
