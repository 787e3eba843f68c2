"""The memory of a rank's generation buffer G: which parts of it are backed, and when.

G holds TP slice `t = rank // m` of every unit (m = N / tg), and the rank's training shard of each
unit lives inside it for good. Between rollouts only those own shards need memory; the other m - 1
shards of each unit are filled by the switch's all-gather and can be given back afterwards.

On CUDA, G is a reserved virtual address range (`VmmRange`, the driver's VMM API): the own shards
are mapped once, and each other shard gets a physical allocation of its own when the switch maps
it, so that it can be unmapped again on its own. Elsewhere, and where the VMM API is unavailable,
G is an ordinary tensor whose memory stays allocated; every mapping call is then a no-op.
"""

from __future__ import annotations

import functools

import torch

from hybridengine.sharding.layout import ShardedLayout
from hybridengine.sharding.vmm import VmmRange


@functools.cache
def vmm_status(device_index: int) -> tuple[bool, str]:
    """(available, reason) for the CUDA VMM buffer on this device; probes once with a tiny mapping."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        probe = VmmRange(1, device_index)
        probe.map(0, probe.granularity)
        probe.unmap(0)
        return True, f"granularity {probe.granularity} bytes"
    except RuntimeError as e:
        return False, f"the VMM probe failed: {e}"


class GenerationBuffer:
    """G of one rank: a VMM range on CUDA (own shards mapped for good), or a plain tensor.

    `data` is the whole of G as one 1-D tensor; with VMM only its mapped parts may be touched."""

    def __init__(self, layout: ShardedLayout, rank: int, dtype: torch.dtype, device: torch.device, use_vmm: bool):
        assert 0 <= rank < layout.world_size, (rank, layout.world_size)
        self.layout, self.rank, self.device = layout, rank, device
        self.element_size = layout.element_size
        self.vmm = None
        if use_vmm:
            nbytes = layout.gen_numel * self.element_size
            self.vmm = VmmRange(nbytes, device.index or 0)
            for off, n in layout.shard_in_gen(rank):
                self.vmm.map(off * self.element_size, n * self.element_size)
            self.data = self.vmm.tensor(dtype, 0, nbytes)
            for off, n in layout.shard_in_gen(rank):
                self.data[off:off + n].zero_()
        else:
            self.data = torch.zeros(layout.gen_numel, dtype=dtype, device=device)

    def unit_slice(self, u: int) -> torch.Tensor:
        """Unit u's TP slice in G: the all-gather's output, this rank's shard one part of it."""
        off = self.layout.gen_offsets[u]
        return self.data[off:off + self.layout.units[u].slice_numel]

    def _other_shard_bytes(self, u: int) -> list[tuple[int, int]]:
        """(byte offset in G, bytes) of the shards of unit u's slice that other ranks train."""
        unit, g = self.layout.units[u], self.layout.gen_offsets[u]
        own = self.rank % self.layout.num_shards
        es = self.element_size
        return [((g + j * unit.shard_numel) * es, unit.shard_numel * es)
                for j in range(self.layout.num_shards) if j != own]

    def map_unit(self, u: int) -> list[int]:
        """Back the other shards of unit u not mapped yet with memory (one allocation each); all or
        nothing. Returns the byte offsets this call mapped (none without VMM or if all were mapped)."""
        if self.vmm is None:
            return []
        done = []
        try:
            for off, n in self._other_shard_bytes(u):
                if not self.vmm.is_mapped(off):
                    self.vmm.map(off, n)
                    done.append(off)
        except RuntimeError:
            for off in done:
                self.vmm.unmap(off)
            raise
        return done

    def unmap_unit(self, u: int, offsets: list[int] | None = None) -> None:
        """Unmap the other shards of unit u (only those at byte `offsets`, when given)."""
        if self.vmm is None:
            return
        for off, _ in self._other_shard_bytes(u):
            if (offsets is None or off in offsets) and self.vmm.is_mapped(off):
                self.vmm.unmap(off)

    def map_others_in_background(self) -> None:
        """Start mapping every other shard not mapped yet on a host thread (`wait_mapped` joins)."""
        if self.vmm is None:
            return
        self.vmm.map_in_background([(off, n) for u in range(len(self.layout.units))
                                    for off, n in self._other_shard_bytes(u) if not self.vmm.is_mapped(off)])

    def wait_mapped(self) -> None:
        """Join a background mapping (no-op without one); raises what it hit (it then mapped nothing)."""
        if self.vmm is not None:
            self.vmm.wait_mapped()

    def release_others_deferred(self) -> None:
        """Unmap every other shard once the current stream's queued work is done, on a host thread
        (no-op when none is mapped)."""
        if self.vmm is None:
            return
        self.vmm.wait_mapped()
        offsets = [off for u in range(len(self.layout.units)) for off, _ in self._other_shard_bytes(u)
                   if self.vmm.is_mapped(off)]
        if offsets:
            self.vmm.unmap_after_current_stream(offsets)

    def wait_released(self) -> None:
        """Join a deferred release (no-op without one)."""
        if self.vmm is not None:
            self.vmm.wait_released()

    def mapped_bytes(self) -> int:
        """Bytes of G backed by memory; waits for a background mapping and a deferred release first."""
        if self.vmm is None:
            return self.data.numel() * self.element_size
        self.vmm.wait_mapped()
        self.vmm.wait_released()
        return self.vmm.mapped_bytes()
