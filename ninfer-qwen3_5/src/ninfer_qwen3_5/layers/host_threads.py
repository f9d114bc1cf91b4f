"""How many threads compute host experts: one a physical core of the CPUs this process may use, within its cgroup's
CPU quota (docs/memory.md "Host threads").

A core's second SMT thread shares the first one's load queues, so past one thread a core the host-expert kernel
waits on memory the same and only adds barrier time; a container limited to fewer CPUs than its host shows would
time-slice a larger team.
"""

from __future__ import annotations

import os

import torch


def host_threads(device: torch.device, threads: int | None) -> int | None:
    """The intra-op thread count of host-expert compute on a ``device`` run: ``threads`` when given, else on a GPU
    run one a physical core among the CPUs this process may use (:func:`physical_cores`; half of them where the
    topology cannot be read), at most its cgroup's CPU quota (:func:`cpu_quota`); None (torch's own count,
    untouched) on the CPU."""
    if threads is not None:
        return threads
    if device.type == "cpu":
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 2))
    cores = physical_cores(cpus) or max(1, len(cpus) // 2)
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, quota))


def cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """The CPUs a cgroup v2 quota gives this process, rounded up (``cpu.max`` "QUOTA PERIOD"; ``path`` for tests),
    None without one: a container limited to fewer CPUs than its host shows would time-slice a larger team."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def physical_cores(cpus: list[int], root: str = "/sys/devices/system/cpu") -> int | None:
    """How many physical cores the logical CPUs ``cpus`` are on: the distinct SMT sibling sets Linux lists for them
    (``cpuN/topology/thread_siblings_list``; ``root`` for tests). None if any CPU's list cannot be read."""
    sets = set()
    for cpu in cpus:
        try:
            with open(f"{root}/cpu{cpu}/topology/thread_siblings_list") as f:
                sets.add(f.read().strip())
        except OSError:
            return None
    return len(sets) or None
