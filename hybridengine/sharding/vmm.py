"""Python face of the extension's CUDA VMM range (csrc/vmm_cuda.cpp): errors become exceptions.

A reserved virtual address range on one GPU. `map(offset, nbytes)` backs a piece of it with a
physical allocation of its own and `unmap(offset)` gives it back; `map_in_background` maps several
pieces on a host thread (`wait_mapped` joins) and `unmap_after_current_stream` releases several on
a host thread once the current stream's queued work is done (`wait_released` joins), so the
driver's page calls overlap GPU work. `tensor(dtype)` is a torch view of the range: only its mapped
parts may be touched. Invalid arguments raise ValueError, driver failures RuntimeError.
"""

from __future__ import annotations

import torch


def _raise(message: str) -> None:
    if message.startswith("invalid: "):
        raise ValueError("VmmRange: " + message[len("invalid: "):])
    if message:
        raise RuntimeError(message)


class VmmRange:
    """`nbytes` of virtual addresses (rounded up to the granularity) reserved on CUDA device `device`."""

    def __init__(self, nbytes: int, device: int):
        from hybridengine import ops  # noqa: F401  (loads hybridengine._C)

        try:
            cls = torch.classes.hybridengine.VmmRange
        except (AttributeError, RuntimeError) as e:
            raise RuntimeError("hybridengine._C was built without CUDA ops: no VmmRange") from e
        self._range = cls(int(nbytes), int(device))
        _raise(self._range.error())

    @property
    def granularity(self) -> int:
        return self._range.granularity()

    @property
    def size(self) -> int:
        return self._range.size()

    def map(self, offset: int, nbytes: int) -> None:
        _raise(self._range.map(int(offset), int(nbytes)))

    def unmap(self, offset: int) -> None:
        _raise(self._range.unmap(int(offset)))

    def unmap_after_current_stream(self, offsets: list[int]) -> None:
        """Release the allocations at `offsets` on a host thread once the current CUDA stream's queued
        work is done; returns at once. `wait_released()` joins (and raises what the thread hit)."""
        _raise(self._range.unmap_after_current_stream([int(o) for o in offsets]))

    def wait_released(self) -> None:
        _raise(self._range.wait_released())

    def map_in_background(self, pieces: list[tuple[int, int]]) -> None:
        """Map (offset, nbytes) pieces, an allocation each, on a host thread; returns at once. All or
        nothing; `wait_mapped()` joins and raises what the thread hit. Checks every piece first."""
        _raise(self._range.map_in_background([int(o) for o, _ in pieces], [int(n) for _, n in pieces]))

    def wait_mapped(self) -> None:
        _raise(self._range.wait_mapped())

    def timings(self, reset: bool = False) -> dict[str, tuple[float, int]]:
        """Host seconds and calls per driver call (create, map, set_access, unmap, release), process-wide."""
        t = self._range.timings(bool(reset))
        names = ("create", "map", "set_access", "unmap", "release")
        return {n: (t[i], int(t[5 + i])) for i, n in enumerate(names)}

    def is_mapped(self, offset: int) -> bool:
        return self._range.is_mapped(int(offset))

    def mapped_bytes(self) -> int:
        return self._range.mapped_bytes()

    def tensor(self, dtype: torch.dtype, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        nbytes = self.size - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"VmmRange.tensor: [{offset}, {offset + nbytes}) is outside the reserved "
                             f"{self.size} bytes")
        return self._range.bytes_tensor(int(offset), int(nbytes)).view(dtype)
