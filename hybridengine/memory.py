"""Host memory: how much a new allocation can have.

Both the rollout (the KV cache off CUDA) and training (the optimizer-state offload) size host allocations
by it, so it lives outside either room; it imports nothing of the package.
"""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes of host memory available to a new allocation (Linux MemAvailable; free pages elsewhere),
    or None when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
