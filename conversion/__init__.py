"""Converters that retrofit pretrained Llama checkpoints into DiffLlama (installed as `modeling_diff.conversion`).

```python
from modeling_diff.conversion import convert_model, convert_checkpoint

dex = convert_model(llama, calibration=ids)                       # in memory; same logits as `llama`
v2 = convert_model(llama, method="v2", anneal_steps=200)           # every head -> a signal/noise pair
convert_checkpoint("llama-dir", "dex-dir", heads="all")            # safetensors dir (sharded: streamed) or .gguf
```
"""

from .convert import (
    DEFAULT_ANNEAL_STEPS,
    calibration_ids_from,
    convert_checkpoint,
    convert_model,
    save_model,
)
from .heads import attention_entropy, resolve_heads, top_entropy_heads
from .mapping import METHODS, NOISE_INITS, SUPPORTED_MODEL_TYPES, TensorMapping, diff_config_from_source

__all__ = [
    "DEFAULT_ANNEAL_STEPS",
    "METHODS",
    "NOISE_INITS",
    "SUPPORTED_MODEL_TYPES",
    "TensorMapping",
    "attention_entropy",
    "calibration_ids_from",
    "convert_checkpoint",
    "convert_model",
    "diff_config_from_source",
    "resolve_heads",
    "save_model",
    "top_entropy_heads",
]
