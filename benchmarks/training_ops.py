"""The operations a training step issues per decoder layer, counted on the CPU (no GPU needed).

    python benchmarks/training_ops.py                 (V1, V2, DEX: 4 layers, head_dim 16, 2 x 40 tokens)

Each launching operation costs the host a few microseconds on the GPU whether its kernel is large or small, so
their count bounds how far ahead of the GPU the host can stay. This builds a tiny model of each mode on the
project's fast path (`diff_triton`, the Triton kernels under Triton's interpreter) and counts, for one forward
with a loss and its backward, the aten operations that are not views or allocations (under a
`TorchDispatchMode`) plus the Triton launches (whose interpreted bodies are not counted), per layer; and the
add operations of the whole step (the residual adds and gradient sums that `add_rms_norm` and
`shared_input_linears` take into other passes). The counts include the embedding, the final norm and the loss.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from conftest import MODES, tiny_model  # noqa: E402

NOT_LAUNCHES = {
    "view", "_unsafe_view", "transpose", "t", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
    "as_strided", "alias", "detach", "empty", "empty_like", "empty_strided", "_reshape_alias", "split", "unbind",
    "lift_fresh", "reshape", "flatten",
}


class LaunchCounter(TorchDispatchMode):
    """Records the name of every aten operation that launches work, and of every Triton launch (`triton`)."""

    active = None  # the counter that records Triton launches

    def __init__(self):
        super().__init__()
        self.ops, self.inside_kernel = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NOT_LAUNCHES and not self.inside_kernel:  # the interpreter runs a kernel's body as torch ops
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        LaunchCounter.active = self
        return super().__enter__()


def _counted_launch(launch):
    def run(self, *args, **kwargs):
        counter = LaunchCounter.active
        if counter is None or counter.inside_kernel:
            return launch(self, *args, **kwargs)
        counter.ops.append("triton")
        counter.inside_kernel = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.inside_kernel = False
    return run


def main():
    interpreter.GridExecutor.__call__ = _counted_launch(interpreter.GridExecutor.__call__)
    rows = []
    for mode in tqdm(MODES, desc="modes"):
        torch.manual_seed(0)
        model = tiny_model(mode, attn_implementation="diff_triton", head_dim=16, num_hidden_layers=4).train()
        ids = torch.randint(3, model.config.vocab_size, (2, 40))
        forward, backward = LaunchCounter(), LaunchCounter()
        with forward:
            loss = model(ids, labels=ids).loss
        with backward:
            loss.backward()
        layers = model.config.num_hidden_layers
        adds = sum(op in ("add", "add_") for op in forward.ops + backward.ops)
        rows.append((mode, len(forward.ops) / layers, len(backward.ops) / layers, adds))
    print("| mode | forward ops / layer | backward ops / layer | add ops in the step |")
    print("|---|---|---|---|")
    for mode, forward_ops, backward_ops, adds in rows:
        print(f"| {mode} | {forward_ops:.1f} | {backward_ops:.1f} | {adds} |")
    print(f"{len(rows)} modes counted (4 layers each).")


if __name__ == "__main__":
    main()
