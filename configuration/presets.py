"""Named DiffLlamaConfig presets.

`tiny-*` presets are for tests and demos on a CPU; `1.1b-*` are the benchmark shape of the GPU issue
(hidden 2048, 16 layers, MLP 8192): V1 uses 16 differential heads of 64 (a Llama with 32 heads of 64),
V2 and DEX use 32 heads of 64, all with GQA (V1: 4 kv heads of 2*64, the bytes of a Llama's 8 of 64).
"""

from .configuration_diff_llama import DiffLlamaConfig

_SHAPE_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)
_SHAPE_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, max_position_embeddings=8192)

PRESETS: dict[str, dict] = {
    "tiny-v1": dict(_SHAPE_TINY, diff_mode="v1", num_attention_heads=4, num_key_value_heads=2),
    "tiny-v2": dict(_SHAPE_TINY, diff_mode="v2", num_attention_heads=4, num_key_value_heads=2),
    "tiny-dex": dict(_SHAPE_TINY, diff_mode="dex", num_attention_heads=4, num_key_value_heads=2),
    "1.1b-v1": dict(_SHAPE_1B, diff_mode="v1", num_attention_heads=16, num_key_value_heads=4),
    "1.1b-v2": dict(_SHAPE_1B, diff_mode="v2", num_attention_heads=32, num_key_value_heads=8),
    "1.1b-dex": dict(_SHAPE_1B, diff_mode="dex", num_attention_heads=32, num_key_value_heads=8),
}


def preset_config(name: str, **overrides) -> DiffLlamaConfig:
    """Build the named preset; keyword arguments override its fields."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return DiffLlamaConfig(**{**PRESETS[name], **overrides})
