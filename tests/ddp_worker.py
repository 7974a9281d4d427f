"""One rank of the data-parallel test (launched by tests/test_distributed.py through torchrun, gloo on CPU).

Trains a tiny DiffLlama with transformers.Trainer (DDP) on Shakespeare and writes, per rank, the final weights
and the ids of the examples this rank trained on, so the test can check that the ranks saw different data and
ended with identical weights.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from ecosystem_helpers import byte_tokenizer, tiny_config
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments, default_data_collator

import modeling_diff  # noqa: F401  (registers the Auto classes)
from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.data import shakespeare, text_blocks


def main(out: Path, mode: str) -> None:
    blocks = text_blocks(byte_tokenizer(), shakespeare("hamlet"), length=32, count=64)
    dataset = [{"input_ids": x, "labels": x, "example": i} for i, x in enumerate(blocks)]
    seen = []

    def collate(features):  # records which examples this rank trains on
        seen.extend(int(f.pop("example")) for f in features)
        return default_data_collator(features)

    torch.manual_seed(1234)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DiffLlamaForCausalLM(tiny_config(mode))
    args = TrainingArguments(
        output_dir=str(out / "trainer"), use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
        disable_tqdm=True, logging_strategy="no", max_steps=6, per_device_train_batch_size=4,
        learning_rate=3e-3, seed=0, remove_unused_columns=False, dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    result = trainer.train()
    rank, world = dist.get_rank(), dist.get_world_size()
    weights = {name: p.detach().contiguous() for name, p in trainer.model.named_parameters()}
    save_file(weights, out / f"rank{rank}.safetensors")
    record = {"world_size": world, "examples": seen, "training_loss": result.training_loss,
              "wrapper": type(trainer.model_wrapped).__name__, "fsdp": trainer.is_fsdp_enabled}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
