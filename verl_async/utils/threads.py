"""CPU threads per process: each process that computes uses its share of the cores, no more.

On a CPU run the trainer ranks and the engine replicas compute at the same time on the same cores.
Each sets its torch (OpenMP) thread count to `cpu_share_threads(cores, processes)`; more threads than
cores makes every OpenMP barrier spin against the other processes (measured on 2 busy cores: a tiny
model's training step 9-12 s with 2 threads, 0.8 s with 1). `OMP_WAIT_POLICY=PASSIVE` makes idle
OpenMP threads sleep instead of spin, which keeps a process that does hold more threads than it gets
cores (the driver building the demo model beside other work) from collapsing the same way (0.8 s
instead of 9-12 s there). The user's own setting of either variable wins.
"""

from __future__ import annotations

import os
from typing import Optional

WAIT_POLICY_KEY = "OMP_WAIT_POLICY"


def wait_policy_env() -> dict[str, str]:
    """The OpenMP wait policy every process of a run starts with (read once, at the process's start)."""
    return {WAIT_POLICY_KEY: os.environ.get(WAIT_POLICY_KEY, "PASSIVE")}


def local_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def cpu_share_threads(cores: int, processes: int) -> int:
    """Threads for each of `processes` computing processes on `cores` cores: an equal share, at least 1."""
    if cores < 1 or processes < 1:
        raise ValueError(f"cores and processes must be positive, got {cores} and {processes}")
    return max(1, cores // processes)


def set_torch_threads(threads: Optional[int]) -> None:
    """This process's torch intra-op threads (None: leave torch's default)."""
    if threads is None:
        return
    import torch

    if torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
