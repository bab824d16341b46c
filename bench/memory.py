"""Block servers' resident memory, against what they are meant to hold: their blocks' weights and their
attention-cache budget (cache_tokens * 2 (keys and values) * blocks * kv_heads * head_dim * dtype size).

Linux only: figures come from /proc/PID/status (VmRSS now, VmHWM its peak; RssFile, the part backed by
files, is mostly safetensors weights mapped into memory; RssAnon the rest: caches, the Python and torch
runtime). Each server's libp2p daemon (hivemind's p2pd, a child process) is sampled on its own, since it
holds none of the model. A server's peak while it loads its weights (a float32 checkpoint converted to
bfloat16 is briefly held twice) is not its peak while it serves: peaks are reset once the servers are up.

On a GPU a server's weights and cache live in GPU memory: each sample then also holds what nvidia-smi says the
process uses there (its CUDA context, torch's allocator cache and the cache pool, which a GPU allocates whole).
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class Memory:
    rss: int  # bytes resident now
    peak: int  # the most bytes ever resident (VmHWM)
    rss_file: int  # of rss: pages backed by files (mapped weights, shared libraries)
    rss_anon: int  # of rss: the process's own allocations


@dataclass(frozen=True)
class ServerBudget:
    start: int
    end: int
    cache_tokens: int
    weights_bytes: int
    cache_bytes: int

    @property
    def total(self) -> int:
        return self.weights_bytes + self.cache_bytes


def server_budget(folder: Path, start: int, end: int, cache_tokens: int, dtype: torch.dtype) -> ServerBudget:
    """What blocks start:end weigh in `dtype`, and their cache budget, counted on layers built on the meta
    device (shapes only, nothing allocated) by the family code the servers themselves use."""
    from swarm.families import family_of
    from swarm.weights import load_config

    config = load_config(folder)
    family = family_of(config)
    with torch.device("meta"):
        layers = [family.new_layer(config, index) for index in range(start, end)]
    item = torch.tensor([], dtype=dtype).element_size()
    weights = sum(tensor.numel() for layer in layers for tensor in [*layer.parameters(), *layer.buffers()])
    cache_per_token = sum(2 * heads * head_dim for heads, head_dim in (family.cache_shape(config, layer) for layer in layers))
    return ServerBudget(start, end, cache_tokens, weights * item, cache_tokens * cache_per_token * item)


STATUS_FIELDS = {"VmRSS": "rss", "VmHWM": "peak", "RssFile": "rss_file", "RssAnon": "rss_anon"}


def process_memory(pid: int) -> Memory:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            fields[STATUS_FIELDS[name]] = int(value.split()[0]) * 1024  # reported in kB
    return Memory(**fields)


def libp2p_daemon(pid: int) -> Optional[int]:
    """The p2pd child that hivemind starts for the process's DHT node, if any."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        if child.name().startswith("p2pd"):
            return child.pid
    return None


def gpu_memory(pid: int) -> Optional[int]:
    """Bytes of GPU memory the process holds now, as nvidia-smi reports them; None where it cannot say (no
    nvidia-smi, or a container whose process ids it does not see)."""
    try:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        listing = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in listing.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) * 1024 * 1024  # reported in MiB
    return None


def sample_server(pid: int, gpu: bool = False) -> dict:
    """The server process's memory, and its p2pd's (None without one); with `gpu`, its GPU memory too."""
    daemon = libp2p_daemon(pid)
    sample = {"server": asdict(process_memory(pid)), "p2pd": asdict(process_memory(daemon)) if daemon else None}
    if gpu:
        sample["gpu"] = gpu_memory(pid)
    return sample


def reset_peaks(pid: int) -> bool:
    """Start the server's and its p2pd's VmHWM again from their present RSS; False where the kernel refuses."""
    daemon = libp2p_daemon(pid)
    try:
        for process in [pid] + ([daemon] if daemon else []):
            Path(f"/proc/{process}/clear_refs").write_text("5")  # 5: reset the peak resident set size
    except OSError:
        return False
    return True
