"""Converters that retrofit pretrained Llama checkpoints into DiffLlama (installed as `modeling_diff.conversion`)."""
