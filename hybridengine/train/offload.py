"""Optimizer state in host memory (`EngineConfig.offload`).

`FlatAdamW` keeps, between steps, fp32 moments and the fp32 masters (or the int16 low halves of
split masters): 10-12 bytes per parameter of the local shard, five to six times the bf16 weights.
`StateOffload` owns one host allocation that holds all of it (pinned on CUDA) and moves the live
state between the device and that allocation:

- `to_host()` / `to_device()` start the copies, on a side stream on CUDA, so they overlap whatever the
  caller queues next. On CUDA a host thread of the extension queues them in chunks at most WINDOW
  ahead of the copy engine (`WindowedCopier`): a transfer queued whole holds all other traffic in its
  direction until it ends, kernel stores into mapped host memory included, while beside a windowed one
  those stores land at once (a rollout's sampled tokens go to the host that way: `runner.Readback`).
  Small copies by the copy engine still wait milliseconds beside either. Elsewhere (and without the
  extension) they are `CHUNK_BYTES` chunks queued at once. `join()`
  finishes them: the optimizer's lists
  then name the tensors at their new place, and the old ones are freed (device) or kept for the next
  round trip (host). A transfer that raises leaves the state where it was, whole.
- `step()` runs one AdamW step with the state in host memory: per unit, in chunks, the next chunk's
  state is copied in while this one updates and the previous one is copied back (three device
  slots, one host-to-device and one device-to-host stream), so the device holds a few chunks of
  state instead of all of it.

The host allocation is one `torch.empty` registered with `cudaHostRegister` (exactly the bytes
needed: torch's pinned allocator rounds each request up to a power of two), made once and kept
while the optimizer lives. It is checked against `host_limit_bytes` and the memory the system has
available before anything is allocated or moved. Off CUDA the "host" is a second CPU allocation and
every copy is synchronous; the logic is the same.

Copies are exact, and the step's arithmetic is elementwise, so state and weights are bit for bit
those of an optimizer that never left the device.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable

import torch

from hybridengine.options import OFFLOAD_MODES as MODES  # noqa: F401  (optimizer and tests read it here)

CHUNK_BYTES = 64 * 2**20
"""Bytes per copy of a transfer: small enough that a failure or a join finds little in flight, large
enough that a copy runs at the link's bandwidth."""
STEP_CHUNK_NUMEL = 16 * 2**20
"""Elements per streamed step chunk (a multiple of the kernel's block): 10-12 B of state each, so the
three device slots hold about 0.5 GiB."""
ALIGN = 512
"""Byte alignment of each tensor in the host allocation."""
WINDOW = 2
"""Chunks of a CUDA transfer queued ahead of the copy engine (`WindowedCopier`): enough to keep the link
busy, few enough that kernel stores into mapped host memory get through between them."""
WINDOW_CHUNK_BYTES = 16 * 2**20
"""Bytes per chunk of a windowed CUDA transfer: a fraction of a millisecond of a PCIe 5 link."""


class OffloadError(RuntimeError):
    """Host memory for the offloaded state is not there: the limit, the system, or the allocation refused it."""


def copy_chunk(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """One chunk of a transfer (tests replace it to interrupt transfers)."""
    dst.copy_(src, non_blocking=non_blocking)


def _chunks(t: torch.Tensor, chunk_bytes: int):
    n = max(1, chunk_bytes // t.element_size())
    return [(i, min(i + n, t.numel())) for i in range(0, t.numel(), n)]


def host_available_bytes() -> int | None:
    """Host memory available to a new allocation (Linux MemAvailable), or None when unknown."""
    from hybridengine.memory import available_memory

    return available_memory()


def allocate_host(nbytes: int) -> torch.Tensor:
    """The host allocation's bytes (pageable; `HostBuffer` registers them on CUDA)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _release_host(data: torch.Tensor, pinned: bool, device: torch.device) -> None:
    """Unregister the host allocation once no copy can still read or write it."""
    if pinned:
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(data.data_ptr())


class HostBuffer:
    """One host allocation carved into 1-D views, one per (kind, unit): pinned (registered) on CUDA."""

    def __init__(self, shapes: dict[str, tuple[torch.dtype, list[int]]], *, device: torch.device,
                 limit_bytes: int | None = None, rank: int = 0):
        offsets, total = {}, 0
        for kind, (dtype, numels) in shapes.items():
            size = torch.empty((), dtype=dtype).element_size()
            for i, n in enumerate(numels):
                offsets[kind, i] = (total, n, dtype)
                total += -(-n * size // ALIGN) * ALIGN
        gib = 2**30
        if limit_bytes is not None and total > limit_bytes:
            raise OffloadError(f"rank {rank}: the optimizer state needs {total / gib:.3f} GiB of host memory, "
                               f"EngineConfig.offload_host_limit_gib allows {limit_bytes / gib:.3f} GiB; raise the "
                               "limit or use offload='none'")
        available = host_available_bytes()
        if available is not None and total > available:
            raise OffloadError(f"rank {rank}: the optimizer state needs {total / gib:.3f} GiB of host memory, "
                               f"{available / gib:.3f} GiB is available; free host memory or use offload='none'")
        self.pinned = device.type == "cuda"
        try:
            data = allocate_host(total)
        except RuntimeError as e:
            raise OffloadError(f"rank {rank}: cannot allocate {total / gib:.3f} GiB of host memory for the "
                               f"optimizer state ({e})") from e
        if self.pinned and total:
            err = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), total, 0))
            if err != 0:
                raise OffloadError(f"rank {rank}: cannot pin {total / gib:.3f} GiB of host memory for the optimizer "
                                   f"state (cudaHostRegister: cudaError {err}); lower the locked-memory use or "
                                   "use offload='none'")
            # Not at interpreter exit: the driver may be gone by then, and the process's pages go with it.
            weakref.finalize(self, _release_host, data, True, device).atexit = False
        self.data, self.nbytes = data, total
        self.views = {key: data[o:o + n * torch.empty((), dtype=dt).element_size()].view(dt)
                      for key, (o, n, dt) in offsets.items()}


class WindowedCopier:
    """A transfer whose chunks a host thread of the extension queues at most WINDOW ahead of the copy
    engine (csrc/copier_cuda.cpp): queued whole, a transfer holds the rest of its direction's traffic to
    the end, kernel stores into mapped host memory included (a rollout's readback); windowed, those
    stores pass between chunks. Copies by the copy engine (a step's batch upload) wait milliseconds
    beside either. Event-like: `query()`, `synchronize()`."""

    def __init__(self, device: torch.device, pieces: list[tuple[int, int, int]], stream: torch.cuda.Stream,
                 chunk_bytes: int = WINDOW_CHUNK_BYTES, window: int = WINDOW):
        cls = torch.classes.hybridengine.WindowedCopier
        self._copier = cls(device.index or 0, window, chunk_bytes)
        dst, src, nbytes = (list(x) for x in zip(*pieces)) if pieces else ([], [], [])
        self._raise(self._copier.start(dst, src, nbytes, stream.cuda_stream))

    _warned = False

    @classmethod
    def available(cls, warn: bool = False) -> bool:
        """The extension has the copier (built with CUDA ops); `warn`: say once when it has not (the
        transfers are then queued whole)."""
        from hybridengine import ops  # noqa: F401  (loads hybridengine._C)

        try:
            torch.classes.hybridengine.WindowedCopier  # noqa: B018
        except (AttributeError, RuntimeError):
            if warn and not cls._warned:
                cls._warned = True
                warnings.warn("hybridengine._C has no CUDA ops: offload transfers are queued whole, and hold the "
                              "compute stream's own copies until they end (build with HYBRIDENGINE_CUDA=1)",
                              stacklevel=3)
            return False
        return True

    @staticmethod
    def _raise(message: str) -> None:
        if message.startswith("invalid: "):
            raise ValueError("WindowedCopier: " + message[len("invalid: "):])
        if message:
            raise RuntimeError(message)

    def query(self) -> bool:
        return self._copier.done()

    def synchronize(self) -> None:
        """Wait until every chunk is copied; raises what a failed copy hit (the copies stopped there)."""
        self._raise(self._copier.wait())

    def seconds(self) -> float:
        return self._copier.seconds()


class _Streams:
    """The side streams of one CUDA device (None off CUDA: every copy synchronous)."""

    _by_device: dict = {}

    @classmethod
    def of(cls, device: torch.device):
        if device.type != "cuda":
            return None, None
        if device not in cls._by_device:
            cls._by_device[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return cls._by_device[device]


class StateOffload:
    """Where a FlatAdamW's between-step state lives, and the transfers between device and host.

    `optimizer` is the FlatAdamW; its state lists (`optimizer.state_lists()`) are rewritten in place at
    each `join`. `host_resident`: the state starts in (and stays in) host memory ('optimizer' mode)."""

    def __init__(self, optimizer, *, host_limit_bytes: int | None = None, host_resident: bool = False,
                 chunk_bytes: int | None = None, step_chunk_numel: int | None = None, rank: int = 0):
        self.optimizer = optimizer
        self.device = optimizer.device
        self.host_limit_bytes = host_limit_bytes
        self.host_resident = host_resident
        self.chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.step_chunk_numel = STEP_CHUNK_NUMEL if step_chunk_numel is None else step_chunk_numel
        self.rank = rank
        self.location = "device"
        """Where the optimizer's lists point: 'device' or 'host' (a transfer in flight: its source)."""
        self.host: HostBuffer | None = None
        self._pending: tuple | None = None  # (target location, event or None, {kind: [tensors]})
        self.start_seconds: dict[str, float] = {}
        """Per target ('host', 'device'): host seconds of the call that last started a transfer there (the
        destination's allocation and the copies' launch; the caller waits this long)."""
        self._copy_events: dict[str, tuple] = {}  # per target: (begin, end) timing events of its last copies

    # -- host memory ---------------------------------------------------------------------------------

    def state_shapes(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        return {kind: (ts[0].dtype, [t.numel() for t in ts]) for kind, ts in self.optimizer.state_lists().items()}

    def prepare_host(self, shapes: dict | None = None) -> HostBuffer:
        """The host allocation, made on first use (raises `OffloadError` before anything moves)."""
        if self.host is None:
            self.host = HostBuffer(shapes or self.state_shapes(), device=self.device,
                                   limit_bytes=self.host_limit_bytes, rank=self.rank)
        return self.host

    def host_views(self, kind: str, count: int) -> list[torch.Tensor]:
        return [self.host.views[kind, i] for i in range(count)]

    # -- transfers -----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def device_state_bytes(self) -> int:
        """Bytes of state that a move to host memory frees on the device: all of it unless it is in host
        memory (or on its way there)."""
        target = self._pending[0] if self._pending is not None else self.location
        if target == "host":
            return 0
        return sum(t.numel() * t.element_size() for ts in self.optimizer.state_lists().values() for t in ts)

    def to_host(self, *, wait: bool = True) -> None:
        """Start moving the state to host memory (no-op when it is there or on its way); `wait`: join."""
        self._start("host")
        if wait:
            self.join()

    def to_device(self, *, wait: bool = False) -> None:
        """Start moving the state back to the device (no-op when it is there or on its way); `wait`: join."""
        self._start("device")
        if wait:
            self.join()

    def _start(self, target: str) -> None:
        if self._pending is not None:
            if self._pending[0] == target:
                return
            self.join()
        if self.location == target:
            return
        t0 = time.perf_counter()
        lists = self.optimizer.state_lists()
        if target == "host":
            self.prepare_host()  # raises OffloadError before anything moves
            dst = {kind: self.host_views(kind, len(ts)) for kind, ts in lists.items()}
        else:
            try:  # allocate everything first: a device out of memory leaves the state in host memory
                dst = {kind: [torch.empty_like(t, device=self.device) for t in ts] for kind, ts in lists.items()}
            except torch.OutOfMemoryError as e:
                raise OffloadError(f"rank {self.rank}: no device memory to bring the optimizer state back "
                                   f"({e}); it stays in host memory") from e
        h2d, d2h = _Streams.of(self.device)
        stream = d2h if target == "host" else h2d
        event = None
        try:
            if stream is None:
                self._copy_all(dst, lists, non_blocking=False)
            elif WindowedCopier.available(warn=True):
                stream.wait_stream(torch.cuda.current_stream(self.device))  # the last step's writes, the allocation
                pieces = [(d.data_ptr(), s.data_ptr(), s.numel() * s.element_size())
                          for kind, ts in lists.items() for d, s in zip(dst[kind], ts)]
                event = WindowedCopier(self.device, pieces, stream)
                self._copy_events[target] = (None, event)
                for ts in (dst if target == "device" else lists).values():
                    for t in ts:  # device memory read or written on the side stream
                        t.record_stream(stream)
            else:
                stream.wait_stream(torch.cuda.current_stream(self.device))  # the last step's writes, the allocation
                with torch.cuda.stream(stream):
                    begin = torch.cuda.Event(enable_timing=True)
                    begin.record(stream)
                    self._copy_all(dst, lists, non_blocking=True)
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(stream)
                self._copy_events[target] = (begin, event)
                for ts in (dst if target == "device" else lists).values():
                    for t in ts:  # device memory read or written on the side stream
                        t.record_stream(stream)
        except BaseException:
            if isinstance(event, WindowedCopier):
                try:  # its thread stops queuing first
                    event.synchronize()
                except RuntimeError:
                    pass  # the error being raised is the one to report
            if stream is not None:
                stream.synchronize()  # nothing of the failed transfer is left running
            raise
        self._pending = (target, event, dst)
        self.start_seconds[target] = time.perf_counter() - t0

    def copy_seconds(self, target: str) -> float | None:
        """Device seconds of the last transfer's copies to `target` ('host' or 'device'), from its first
        copy's start on the copy stream to its last one's end; None off CUDA, before any transfer there, or
        while it still runs."""
        events = self._copy_events.get(target)
        if events is None or not events[1].query():
            return None
        if isinstance(events[1], WindowedCopier):
            return events[1].seconds()
        return events[0].elapsed_time(events[1]) / 1e3

    def _copy_all(self, dst: dict, src: dict, *, non_blocking: bool) -> None:
        for kind, ts in src.items():
            for d, s in zip(dst[kind], ts):
                for a, b in _chunks(s, self.chunk_bytes):
                    copy_chunk(d[a:b], s[a:b], non_blocking)

    def join(self) -> None:
        """Finish the transfer in flight: the optimizer's lists name the state at its new place. Moving
        out waits on the host (the device memory is free when this returns); moving back only makes the
        current stream wait, or with a windowed transfer waits on the host (its last chunks are queued
        only as the earlier ones finish). A failed windowed transfer raises here and leaves the state where
        it was."""
        if self._pending is None:
            return
        target, event, dst = self._pending
        if isinstance(event, WindowedCopier):
            try:
                event.synchronize()
            except RuntimeError:
                self._pending = None
                raise
        elif event is not None:
            if target == "host":
                event.synchronize()
            else:
                torch.cuda.current_stream(self.device).wait_event(event)
        self._pending = None
        lists = self.optimizer.state_lists()
        for kind, ts in dst.items():
            lists[kind][:] = ts
        self.location = target

    def cancel_to_host(self) -> bool:
        """Keep the state on the device after all: a move to host memory whose device memory nobody took
        (offload 'rollout' with a KV cache that never grew into it). Waits for its copies, which read the
        state that the next step writes; the host copy is then stale and the device state is live, as if
        it had never moved. Returns whether there was such a move; a copy that failed raises, and the state
        is on the device either way."""
        if self._pending is None or self._pending[0] != "host":
            return False
        event = self._pending[1]
        self._pending = None
        if event is not None:
            event.synchronize()
        return True

    # -- the streamed step ---------------------------------------------------------------------------

    def step(self, update: Callable, grads: list[torch.Tensor], **hyper) -> None:
        """One AdamW step of every unit with the state in host memory (`update`: the fused kernel's
        launcher or the reference, as FlatAdamW.step picks). Chunk c's state is copied in on the
        host-to-device stream while chunk c - 1 updates and chunk c - 2 is copied back on the
        device-to-host stream; slot c % 3 is reused once chunk c - 3 is back."""
        self.join()
        if self.location != "host":
            raise RuntimeError("StateOffload.step needs the state in host memory")
        opt, lists = self.optimizer, self.optimizer.state_lists()
        kinds = list(lists)
        work = [(i, a, min(a + self.step_chunk_numel, p.numel()))
                for i, p in enumerate(opt.params) for a in range(0, p.numel(), self.step_chunk_numel)]
        if not work:
            return
        size = max(b - a for _, a, b in work)
        slots = [{k: torch.empty(size, dtype=lists[k][0].dtype, device=self.device) for k in kinds}
                 for _ in range(min(3, len(work)))]
        h2d, d2h = _Streams.of(self.device)
        cuda = h2d is not None
        compute = torch.cuda.current_stream(self.device) if cuda else None
        fetched, written = {}, {}

        def fetch(c: int) -> None:
            i, a, b = work[c]
            slot = slots[c % len(slots)]
            if not cuda:
                for k in kinds:
                    copy_chunk(slot[k][:b - a], lists[k][i][a:b], False)
                return
            if c < len(slots):
                h2d.wait_stream(compute)  # the slots' allocation
            else:
                h2d.wait_event(written.pop(c - len(slots)))  # the slot's previous chunk is back in host memory
            with torch.cuda.stream(h2d):
                for k in kinds:
                    copy_chunk(slot[k][:b - a], lists[k][i][a:b], True)
                fetched[c] = torch.cuda.Event()
                fetched[c].record(h2d)

        def write_back(c: int) -> None:
            i, a, b = work[c]
            slot = slots[c % len(slots)]
            if not cuda:
                for k in kinds:
                    copy_chunk(lists[k][i][a:b], slot[k][:b - a], False)
                return
            d2h.wait_stream(compute)
            with torch.cuda.stream(d2h):
                for k in kinds:
                    copy_chunk(lists[k][i][a:b], slot[k][:b - a], True)
                written[c] = torch.cuda.Event()
                written[c].record(d2h)

        try:
            for c in range(min(len(slots) - 1, len(work))):
                fetch(c)
            for c, (i, a, b) in enumerate(work):
                if c + len(slots) - 1 < len(work):
                    fetch(c + len(slots) - 1)  # the slot of chunk c - 1, free once its write-back is done
                if cuda:
                    compute.wait_event(fetched.pop(c))
                slot = slots[c % len(slots)]
                opt.update_range(update, i, a, b, {k: slot[k][:b - a] for k in kinds}, grads[i][a:b], hyper)
                write_back(c)
        finally:
            if cuda:  # every chunk is back in host memory before the slots go back to the allocator
                d2h.synchronize()
                h2d.synchronize()

    # -- accounting ----------------------------------------------------------------------------------

    def host_state_bytes(self) -> int:
        """Bytes of optimizer state whose live copy is in host memory now."""
        if self.location != "host":
            return 0
        return sum(t.numel() * t.element_size() for ts in self.optimizer.state_lists().values() for t in ts)
