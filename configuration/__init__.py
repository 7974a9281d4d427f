"""Configuration of modeling_diff (installed as `modeling_diff.configuration`)."""

from .configuration_diff_llama import DIFF_MODES, MAX_ANNEAL_STEPS, DiffLlamaConfig
from .presets import PRESETS, preset_config

__all__ = ["DIFF_MODES", "MAX_ANNEAL_STEPS", "DiffLlamaConfig", "PRESETS", "preset_config"]
