"""Whether triton can be used here, decided once at import (plain constants: torch.compile traces them).

Nothing here imports triton: the model (and its Hub export) loads where triton is absent, and the Triton
paths are simply not chosen there.
"""

import importlib.util
import os

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# TRITON_INTERPRET=1 (set before triton is first imported) runs the kernels on CPU tensors through Triton's
# interpreter: how CI tests them.
TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    return TRITON_AVAILABLE
