"""Whether triton can be used here. Nothing imports triton at package import: the model (and its Hub export)
loads where triton is absent, and the Triton paths are simply not chosen there."""

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """TRITON_INTERPRET=1 runs the kernels on CPU tensors through Triton's interpreter (the CI tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
