"""Failing together: an error on one rank inside a collective phase reaches every rank in bounded time.

A collective phase (`ppo_step`, `log_probs`, the switch, TP generation, `save`, ...) has every rank
of a group run the same collectives in the same order. When one rank raises inside it and stays
alive (a trainer loop that logs and retries), its peers wait in a collective that never completes,
and with torch's default process-group timeout they wait 30 minutes. `PhaseGuard` bounds that:

1. Before any work, every rank runs the phase's input checks and the ranks agree on the outcome
   (one small all-gather on a CPU group). A rejected input raises on every rank at once: on the
   rank that rejected it its own error, on the others `CollectiveError` naming that rank and its
   message. Nothing has changed anywhere, so the engine stays usable.
2. When a rank raises inside the phase's work, it records the failure (rank, phase, error) in the
   process group's store, marks the guard broken and re-raises its error. Its peers' pending
   collective times out after `collective_timeout_s` (the engine's groups are made with that
   timeout); they find the record and raise `CollectiveError` naming the failing rank and phase.
3. A broken guard refuses every later phase at once, without entering a collective, on every rank:
   a half-run phase leaves the ranks' shards and process groups out of step, so the engine must be
   rebuilt (`HybridEngine.load` from the last checkpoint).

Under NCCL the timed-out collective is the NCCL watchdog's to handle: by default it ends the
process after the timeout rather than raising (TORCH_NCCL_ASYNC_ERROR_HANDLING).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
from typing import Callable, Iterator

import torch.distributed as dist

__all__ = ["CollectiveError", "PhaseGuard"]

_engines = itertools.count()  # engines are built collectively: the n-th engine has the same n on every rank


class CollectiveError(RuntimeError):
    """Another rank failed in a collective phase, or this engine was broken by such a failure before.

    `phase`: the phase that failed; `failed`: {rank: "ErrorType: message"} of the ranks that failed;
    `usable`: True when the failure was a rejected input before any work (the engine is unchanged),
    False when the engine must be rebuilt."""

    def __init__(self, message: str, *, phase: str, failed: dict[int, str], usable: bool):
        super().__init__(message)
        self.phase = phase
        self.failed = failed
        self.usable = usable


class _Phase:
    """Handle of a running phase: `consistent(fn, ...)` runs a step that every rank of the phase runs
    on the same inputs (a check after a broadcast): its error is every rank's, not a failure."""

    def __init__(self):
        self.consistent_error = False

    def consistent(self, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.consistent_error = True
            raise


class PhaseGuard:
    """The collective phases of one engine on `group` (None: alone, no collectives; checks still run)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self.broken: CollectiveError | None = None
        self._seq = 0
        if group is None:
            self.rank, self.world_size, self._cpu_group, self._store = 0, 1, None, None
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        # The agreement runs on the host: a gloo group beside an NCCL one (no device sync per phase).
        self._cpu_group = (group if dist.get_backend(group) == "gloo"
                           else dist.new_group(dist.get_process_group_ranks(group), timeout=timeout, backend="gloo"))
        self._global = dist.get_process_group_ranks(group)
        self._store = dist.PrefixStore(f"hybridengine/engine{next(_engines)}/",
                                       dist.distributed_c10d._get_default_store())

    @contextlib.contextmanager
    def phase(self, name: str, check: Callable[[], None] | None = None) -> Iterator[_Phase]:
        """Run the block as collective phase `name` of every rank of the group: `agree`, then `work`."""
        self.agree(name, check)
        with self.work(name) as handle:
            yield handle

    def agree(self, name: str, check: Callable[[], None] | None = None) -> None:
        """Before any work: run `check` (this rank's inputs) and agree with every rank of the group on the
        outcome and on the phase being called. Raises on every rank when any rank rejected its inputs."""
        self._refuse_if_broken(name)
        if self.group is None:
            if check is not None:
                check()
            return
        self._seq += 1
        self._agree(name, check)

    @contextlib.contextmanager
    def work(self, name: str) -> Iterator[_Phase]:
        """The phase's collective work. A failure here breaks the guard: recorded for the peers when it is
        this rank's own, raised as `CollectiveError` when a peer's record explains it. Without `agree`
        (a subgroup's phase, e.g. TP generation, whose inputs are made equal inside it) the checks run
        inside through `consistent`."""
        self._refuse_if_broken(name)
        handle = _Phase()
        if self.group is None:
            yield handle
            return
        try:
            yield handle
        except BaseException as err:
            if handle.consistent_error:
                raise  # every rank raises it alike: nothing is out of step
            # A failing peer records itself before it re-raises (and before its process can exit), so
            # by the time this rank's collective times out or loses its connection the record is there.
            failed = self._peer_records()
            if failed:
                ranks = ", ".join(str(r) for r in failed)
                self.broken = CollectiveError(
                    f"rank {ranks} failed in a collective phase ({_describe(failed)}); this rank's {name} stopped "
                    f"({type(err).__name__}); the engine must be rebuilt (HybridEngine.load from a checkpoint)",
                    phase=name, failed=failed, usable=False)
                raise self.broken from err
            mine = f"{name}: {type(err).__name__}: {err}"
            self._record(mine)
            self.broken = CollectiveError(
                f"rank {self.rank} failed in {name} after its collectives began ({type(err).__name__}: {err}); the "
                "engine must be rebuilt (HybridEngine.load from a checkpoint)",
                phase=name, failed={self._global[self.rank]: mine}, usable=False)
            err.add_note(f"hybridengine: rank {self.rank} failed inside the collective phase {name}; its peers raise "
                         f"CollectiveError within collective_timeout_s={self.timeout_s:g} s, and this engine refuses "
                         "further calls: rebuild it")
            raise

    def _refuse_if_broken(self, name: str) -> None:
        if self.broken is not None:
            raise CollectiveError(f"{self.broken} (refusing {name})", phase=self.broken.phase,
                                  failed=self.broken.failed, usable=False) from None

    def _agree(self, name: str, check: Callable[[], None] | None) -> None:
        error = None
        if check is not None:
            try:
                check()
            except Exception as e:  # noqa: BLE001 - every rank learns of it below, then it is raised here
                error = e
        mine = (name, self._seq, None if error is None else f"{type(error).__name__}: {error}")
        everyone: list = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, mine, group=self._cpu_group)
        except Exception as err:  # a peer broke earlier, died, or never came
            failed = self._peer_records()
            self.broken = CollectiveError(
                (f"rank {', '.join(map(str, failed))} failed earlier ({_describe(failed)})" if failed else
                 f"the ranks did not all reach {name} within collective_timeout_s={self.timeout_s:g} s "
                 "(a rank exited, hung, or called another phase) and no rank recorded an error")
                + "; the engine must be rebuilt (HybridEngine.load from a checkpoint)",
                phase=name, failed=failed, usable=False)
            raise self.broken from err
        phases = {(p, s) for p, s, _ in everyone}
        if len(phases) > 1:
            calls = ", ".join(f"rank {r}: {p} #{s}" for r, (p, s, _) in enumerate(everyone))
            raise CollectiveError(f"the ranks called different phases ({calls}); every rank must make the same "
                                  "engine calls in the same order. Nothing ran; the engine is unchanged",
                                  phase=name, failed={}, usable=True)
        rejected = {self._global[r]: m for r, (_, _, m) in enumerate(everyone) if m is not None}
        if error is not None:
            error.add_note(f"hybridengine: rank {self.rank} rejected its {name} inputs before any work; every rank "
                           "raises, and the engine is unchanged")
            raise error
        if rejected:
            raise CollectiveError(f"{name}: rank {', '.join(map(str, rejected))} rejected its inputs before any work "
                                  f"({_describe(rejected)}); nothing ran, the engine is unchanged and usable",
                                  phase=name, failed=rejected, usable=True)

    def _record(self, message: str) -> None:
        try:
            if not self._store.check([str(self._global[self.rank])]):
                self._store.set(str(self._global[self.rank]), message)
        except Exception:  # noqa: BLE001 - the store is gone too: the peers still time out, unnamed
            pass

    def _peer_records(self) -> dict[int, str]:
        """The failures other ranks recorded: {global rank: message}."""
        found = {}
        try:
            for r in self._global:
                if r != self._global[self.rank] and self._store.check([str(r)]):
                    found[r] = self._store.get(str(r)).decode()
        except Exception:  # noqa: BLE001 - the store is unreachable: report what was found
            pass
        return found


def _describe(failed: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {m}" for r, m in failed.items())
