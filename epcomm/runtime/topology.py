"""Ranks per node, one rule for both backends: ranks on one host form its NVLink domain, cut into
nodes of EPCOMM_NUM_LOCAL_RANKS ranks where that is set (several "nodes" on one machine)."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import List, Optional


def host_key() -> str:
    """Identifies this host: hostname plus kernel boot id, so two machines that share a hostname
    (containers, default images) are not mistaken for one NVLink domain."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def local_rank_count(host_keys: List[str]) -> int:
    """Ranks per host, given each rank's host. Hosts must hold equally many ranks, numbered
    contiguously (ranks 0..L-1 on the first host, ...), as DeepEP's NVLink/RDMA split assumes."""
    runs: List[List] = []  # [host, count] per run of equal consecutive keys
    for key in host_keys:
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    layout = ", ".join(f"{host.split('/')[0]} x{count}" for host, count in runs)
    if len({host for host, _ in runs}) != len(runs):
        raise ValueError(f"the ranks of each host must be contiguous in the group, got runs of "
                         f"hosts: {layout}")
    if len({count for _, count in runs}) != 1:
        raise ValueError(f"every host must hold the same number of ranks, got {layout}")
    return runs[0][1]


def resolve_local_ranks(host_keys: List[str], overrides: List[Optional[int]]) -> int:
    """Ranks per node: from the hosts, or EPCOMM_NUM_LOCAL_RANKS (`overrides`, by rank), which must
    be equal on every rank and cut each host into whole nodes (a node never spans hosts: its ranks
    talk over NVLink)."""
    per_host = local_rank_count(host_keys)
    if len(set(overrides)) != 1:
        raise ValueError(f"EPCOMM_NUM_LOCAL_RANKS must be equal on every rank, got {overrides} (by rank)")
    forced = overrides[0]
    if forced is None:
        return per_host
    if per_host % forced:
        raise ValueError(f"EPCOMM_NUM_LOCAL_RANKS={forced} must divide the {per_host} ranks of each host "
                         f"(and so the {len(host_keys)} ranks of the group)")
    return forced
