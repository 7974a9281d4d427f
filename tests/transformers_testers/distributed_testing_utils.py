"""The process launcher that transformers' FSDP and tensor-parallel tester mixins import (`from
.distributed_testing_utils import ...`). transformers keeps its own in its git repository only, so this one is
written here, to the interface those mixins call:

- `_start_rank_processes(fn, args, nprocs)` runs `fn(rank, *args)` in `nprocs` spawned processes and raises if
  any of them fails (the FSDP mixin's `_fsdp_global_wrapper` sets up the process group itself);
- `run_distributed(world_size)(fn)(*args)` does the same inside a process group of `world_size` ranks
  (the tensor-parallel mixin's `_test_tp_*_impl(rank, ...)`);
- the device helpers choose gloo on CPU and one accelerator per rank otherwise.
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers.testing_utils import torch_device


_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}
RANK_TIMEOUT_S = 300  # the slowest mixin test takes under 20 s on a loaded 2-core machine


def _get_distributed_device_type() -> str:
    return torch_device


def _get_distributed_backend() -> str:
    return _BACKENDS[_get_distributed_device_type()]


def _get_rank_device(rank: int) -> torch.device:
    device_type = _get_distributed_device_type()
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank)


def _set_rank_device(rank: int) -> None:
    device_type = _get_distributed_device_type()
    if device_type != "cpu":
        getattr(torch, device_type).set_device(rank)


def _rank_entry(rank: int, fn, args) -> None:
    # The ranks share the machine's cores: one intra-op thread each, as the test process itself uses
    # (tests/conftest.py); more oversubscribes a 2-core CI machine.
    torch.set_num_threads(1)
    fn(rank, *args)


def _start_rank_processes(fn, args=(), nprocs=1) -> None:
    """`fn(rank, *args)` in `nprocs` processes; a failing rank's traceback is raised here.

    On CPU the ranks are forked: a spawned rank imports torch, transformers and the model again, which costs
    10-30 s a test on a 2-core machine against under a second forked (the test process holds no accelerator
    context and runs one intra-op thread, so a fork is safe). An accelerator needs fresh (spawned) processes."""
    start_method = "fork" if _get_distributed_device_type() == "cpu" else "spawn"
    context = mp.start_processes(_rank_entry, args=(fn, args), nprocs=nprocs, join=False, start_method=start_method)
    # A rank that hangs (a collective another rank never reaches) fails the test instead of the whole CI run.
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)}: the {nprocs} ranks did not finish in {RANK_TIMEOUT_S} s")


def _process_group_entry(rank: int, fn, world_size: int, host: str, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR=host, MASTER_PORT=str(port))
    _set_rank_device(rank)
    store = dist.TCPStore(host, port, world_size=None, is_master=False)
    dist.init_process_group(backend=_get_distributed_backend(), store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(world_size: int):
    """`run_distributed(n)(fn)(*args)`: `fn(rank, *args)` on each of `n` ranks of one process group."""

    def decorator(fn):
        def launch(*args):
            # The rendezvous store lives in this process and holds its port from the start, so parallel test
            # workers never pick the same one.
            store = dist.TCPStore("localhost", 0, world_size=None, is_master=True, wait_for_workers=False)
            try:
                _start_rank_processes(
                    _process_group_entry, args=(fn, world_size, store.host, store.port, args), nprocs=world_size
                )
            finally:
                del store

        return launch

    return decorator
