"""cProfile of the host's work in one training forward of the decoder stack (2048 x 4 tokens, no loss), with the GPU
asleep so that launches only queue: which Python calls the host's forward time goes to.

    cd benchmarks && python host_profile.py dex-liger      (a model name of bench.py; one model a process)

Prints the 45 functions of the most time of their own and the 45 of the most time with their callees."""
import cProfile
import io
import pstats
import sys

import torch

from bench import MODELS, build, kernels_patched
from profile_train import SLEEP_CYCLES

name = sys.argv[1] if len(sys.argv) == 2 else sys.exit("usage: python host_profile.py MODEL (a bench.py model)")
if name not in MODELS:
    sys.exit(f"host_profile.py: unknown model {name!r}; one of {', '.join(MODELS)}")
with kernels_patched(name):
    model = build(name, max_positions=2048).train()
    ids = torch.randint(0, model.config.vocab_size, (4, 2048), device="cuda")
    for _ in range(2):
        model.model(ids).last_hidden_state.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof = cProfile.Profile()
    prof.enable()
    hidden = model.model(ids).last_hidden_state
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
        print(f"==== {name} forward by {key}\n" + "\n".join(s.getvalue().splitlines()[:60]))
