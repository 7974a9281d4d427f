import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

# Tests never reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# CI runs two pytest workers on two cores: one intra-op thread each avoids oversubscription, which slows
# small models down by an order of magnitude.
torch.set_num_threads(1)

if not torch.cuda.is_available():  # Triton kernels then run through its interpreter; must precede `import triton`
    os.environ.setdefault("TRITON_INTERPRET", "1")

import modeling_diff  # noqa: E402, F401  (registers the Auto classes)
from modeling_diff import DiffLlamaConfig, DiffLlamaForCausalLM  # noqa: E402

MODES = ("v1", "v2", "dex")


def tiny_config(mode: str, **overrides) -> DiffLlamaConfig:
    """A 2-layer model with GQA (4 heads, 2 kv heads) for every mode."""
    fields = dict(
        diff_mode=mode,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return DiffLlamaConfig(**fields)


def tiny_model(mode: str, seed: int = 0, attn_implementation: str = "eager", **overrides) -> DiffLlamaForCausalLM:
    """A tiny model whose differential parts are all active: DEX gets a non-zero f_D (a fresh one is zero)."""
    torch.manual_seed(seed)
    model = DiffLlamaForCausalLM(tiny_config(mode, **overrides)).eval()
    model.set_attn_implementation(attn_implementation)
    if mode == "dex":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.dex_proj.weight.normal_(0.0, 0.3)
    return model


@contextlib.contextmanager
def unwritable(directory: Path):
    """`directory` refuses new entries for the block: read-only, or immutable (chattr +i) where permissions do not
    bind (root). Where neither can be done (root without chattr), this process's os.mkdir and os.open refuse
    entries in it as the filesystem would (EACCES): every writer the tests attack makes its probe, staging or lock
    through them. Writable again afterwards."""
    directory.chmod(0o555)
    immutable = False
    try:
        if os.access(directory, os.W_OK):  # root ignores permissions: make the directory immutable instead
            immutable = shutil.which("chattr") is not None and subprocess.run(
                ["chattr", "+i", str(directory)], capture_output=True).returncode == 0
        with contextlib.nullcontext() if immutable or not os.access(directory, os.W_OK) else _refused_in(directory):
            yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o755)


def _refused_in(directory: Path):
    """os.mkdir and os.open refusing new entries directly in `directory` (EACCES), as a read-only one does."""
    from unittest import mock

    inside = directory.resolve()
    real_mkdir, real_open = os.mkdir, os.open

    def refused(path):
        if Path(os.path.abspath(path)).parent.resolve() == inside:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def mkdir(path, *args, **kwargs):
        refused(path)
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and not os.path.exists(path):
            refused(path)
        return real_open(path, flags, *args, **kwargs)

    return mock.patch.multiple(os, mkdir=mkdir, open=open_)
