"""How far each case of the hook test lies from float32 eager in bfloat16, eager and fast path alike.

    python benchmarks/hook_test_precision.py    # on the GPU: the cases at the ~1.1B shapes of tests/test_kernels.py

`tests/test_kernels.py::test_a_hook_changing_a_differential_module_changes_the_fast_path_as_eager` compares the fast
path with eager, both in bfloat16 on the GPU. This prints, for each of its cases (the module hooked, on the module or
on PEFT's copy) and two prompt lengths, how far bfloat16 eager, the bfloat16 fast path and the float32 fast path lie
from float32 eager: the loss, the worst parameter gradient, generate's logits (greedy, 3 new tokens), whether the
greedy tokens are float32 eager's, and the logits of one forward pass over float32 eager's tokens (no greedy
choice). A case whose bfloat16 eager is far from float32 eager measures bfloat16, not the fast path.
"""

import sys
from pathlib import Path

import torch
from peft import get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_model  # noqa: E402
from lambda_grad_precision import shape  # noqa: E402

from modeling_diff.lora import lora_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (mode, the module hooked, config.dex_heads, prompt lengths): the hook test's cases, at its length and a longer one
CASES = [("v1", "subln", None, (6, 64)), ("v1", "diff_lambda", None, (6, 64)), ("dex", "dex_lambda", None, (6, 64)),
         ("dex", "dex_proj", [[0, 1], [2]], (40, 256))]
PATHS = [("eager", torch.bfloat16), ("sdpa", torch.bfloat16), ("sdpa", torch.float32)]


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run(base, fields, mode, hooked, peft_copy, ids, implementation, dtype, tokens=None):
    """The hook test's step for one path: loss, gradients, generate's logits and tokens, logits over `tokens`."""
    model = tiny_model(mode, attn_implementation=implementation, **fields)
    model.load_state_dict(base.state_dict())
    model = model.to(DEVICE, dtype)
    if peft_copy:
        torch.manual_seed(1)  # the same LoRA weights on every path
        model = get_peft_model(model, lora_config(lora_dropout=0.0))
    suffix = f"{hooked}.modules_to_save.default" if peft_copy else hooked
    for name, module in model.named_modules():
        if name.endswith(suffix):
            module.register_forward_hook(lambda module, args, out: out * 1.5 + 0.05)
    loss = model.train()(ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    out = model.eval().generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    tokens = out.sequences if tokens is None else tokens
    with torch.no_grad():
        forced = model(tokens).logits[:, ids.shape[1] - 1:]
    return dict(loss=loss.detach(), grads=grads, logits=torch.stack(out.logits, 1), tokens=out.sequences,
                forced=forced)


def main() -> None:
    print("| case | length | path | loss | worst gradient (parameter) | generate's logits | greedy tokens as float32 "
          "eager's | logits over float32 eager's tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, hooked, dex_heads, lengths in CASES:
        fields = shape(mode) | ({} if dex_heads is None else dict(dex_heads=dex_heads))
        base = tiny_model(mode, **fields)
        for peft_copy in (False, True):
            for length in lengths:
                torch.manual_seed(0)
                ids = torch.randint(3, fields["vocab_size"], (2, length), device=DEVICE)
                case = (base, fields, mode, hooked, peft_copy, ids)
                reference = run(*case, "eager", torch.float32)
                for implementation, dtype in PATHS:
                    got = run(*case, implementation, dtype, tokens=reference["tokens"])
                    worst = max((rel_err(got["grads"][name], grad), name) for name, grad in reference["grads"].items()
                                if grad.any())
                    print(f"| {mode} {hooked} {'PEFT copy' if peft_copy else 'module'} | {length} | {implementation} "
                          f"{str(dtype).removeprefix('torch.')} | {rel_err(got['loss'], reference['loss']):.1e} | "
                          f"{worst[0]:.3g} ({worst[1].removeprefix('base_model.model.')}) | "
                          f"{rel_err(got['logits'], reference['logits']):.3g} | "
                          f"{torch.equal(got['tokens'], reference['tokens'])} | "
                          f"{rel_err(got['forced'], reference['forced']):.3g} |", flush=True)


if __name__ == "__main__":
    main()
