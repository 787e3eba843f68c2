"""The TP group of generation: its ranks, its driver and the host-side channel of the driver's messages.

Under TP generation (tp_generation > 1) each TP group runs one schedule: its first rank drives (takes the
requests, `RolloutLoop` in rollout/loop.py), and every rank continues with the driver's sampled tokens
(`async_decode.launch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    """The TP group of generation: every rank continues with rank `src`'s tokens, and rank `src` drives
    the group's requests (`RolloutSession.send`)."""

    group: object
    src: int
    """Global rank of the group's first rank."""
    messages: object
    """A gloo group over the same ranks for the driver's per-step messages: on the host, so that they
    never wait for the device (an object broadcast over NCCL syncs with the step in flight)."""

    @classmethod
    def of(cls, group, parent, timeout) -> "TPGroup":
        """The TP group `group`, one of the TP groups that split `parent` (ShardedBuffer's layout: TP
        group j holds parent ranks j, j + m, j + 2m, ...). Every rank of `parent` calls it: the gloo
        twins are made collectively, each group in the same order on every rank."""
        mine = dist.get_process_group_ranks(group)
        messages = group
        if dist.get_backend(group) != "gloo":
            ranks, tp = dist.get_process_group_ranks(parent), len(mine)
            m = len(ranks) // tp
            for j in range(m):
                members = [ranks[t * m + j] for t in range(tp)]
                twin = dist.new_group(members, timeout=timeout, backend="gloo")
                if members == mine:
                    messages = twin
            assert messages is not group, f"TP group {mine} is not one of the layout's groups over {ranks}"
        return cls(group, mine[0], messages)
