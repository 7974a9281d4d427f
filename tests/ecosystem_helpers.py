"""Shared by the ecosystem tests (Trainer, PEFT, distributed, Hub, pipeline): an offline byte-level tokenizer,
tiny configs matching the tokenizer, README snippets. Real text: `modeling_diff.data`."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from modeling_diff import preset_config

# Tiny models on a shared 2-core machine: more than one intra-op thread oversubscribes the cores (measured here:
# 10 Trainer steps take 0.9 s with 1 thread and 13 s with 2 while other processes run).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + EOS


def byte_tokenizer(special: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: one token per UTF-8 byte (GPT-2's byte-to-character map), plus EOS as id 256 (unless
    `special` is False: then no special token at all)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if not special:
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, bos_token=EOS)
    assert len(fast) == VOCAB_SIZE
    return fast


def save_byte_llama(folder: Path) -> Path:
    """A random tiny Llama (transformers' own class, GQA) with `byte_tokenizer`, saved in `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    eos = VOCAB_SIZE - 1
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    ))
    llama.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def tiny_config(mode: str, **overrides):
    """The `tiny-<mode>` preset with the vocabulary of `byte_tokenizer`."""
    eos = VOCAB_SIZE - 1
    return preset_config(f"tiny-{mode}", vocab_size=VOCAB_SIZE, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos, **overrides)


def readme_snippet(name: str) -> str:
    """The python code block that follows `<!-- snippet:NAME -->` in README.md's ecosystem section."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("<!-- section:ecosystem -->")[1].split("<!-- /section:ecosystem -->")[0]
    match = re.search(rf"<!-- snippet:{re.escape(name)} -->\s*```(?:python|bash)\n(.*?)```", section, re.DOTALL)
    assert match, f"README ecosystem section has no snippet {name!r}"
    return match.group(1)


def offline_env(tmp_path: Path, **extra) -> dict:
    """Environment for subprocesses: no network, caches under tmp_path, the repo importable only via the venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", **extra)
    return env


PYTHON = sys.executable


def run_launcher(args: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)` for a launcher of worker
    processes (torchrun): in a session of its own, killed whole when the time is out. subprocess.run kills only the
    launcher, and its workers, left waiting on each other in gloo, outlived the test run."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def write_gguf_header(path: Path, block_count: int, layers: range, shapes: bool = False) -> Path:
    """A GGUF file of architecture llama whose metadata claims `block_count` layers and whose tensors are those of
    `layers` (one small tensor each, `blk.<i>.attn_norm.weight`): no model, only what the layer count is read from.
    With `shapes`, also a config's sizes (4 heads over 2 kv heads) and an 8-token tokenizer: what is checked against
    the metadata before a model is loaded."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_block_count(block_count)
    if shapes:
        for key, value in dict(context_length=64, embedding_length=32, feed_forward_length=64, head_count=4,
                               head_count_kv=2, layer_norm_rms_eps=1e-6).items():
            getattr(writer, f"add_{key}")(value)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([chr(ord("a") + i) for i in range(8)])
        writer.add_token_scores([0.0] * 8)
        writer.add_token_types([1] * 8)
        writer.add_token_merges([])
    for layer in layers:
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
