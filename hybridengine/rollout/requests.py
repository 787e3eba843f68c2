"""The requests of one rollout: they arrive, progress and leave between model steps (continuous batching).

`RolloutSession` is what an open `HybridEngine.rollout()` holds: the scheduler and its block manager
(so the prefix cache lives for the whole rollout, and never across a weight change), the live
requests by id, the async-decode step in flight, and the requests that progressed since they were
last reported. `step` is nano-vllm's LLMEngine.step: schedule -> run the model -> sample ->
post-process, with the async decode pipeline of rollout/async_decode.py.

A request kept at the end of a rollout (`close(keep=True)`) keeps its sequences' tokens, log-probs,
policy versions and sampler state and drops their blocks; the next session re-adds it before any
new request, and its KV is recomputed under the new weights as a preempted sequence's is.

Under TP generation one rank of each TP group drives (`TPGroup.src`): requests are submitted and
aborted there, and before every step it sends the group what changed since its last message
(`send`); the other ranks apply it (`receive`) and run the same schedule, so every rank of the group
holds the same requests and runs the same batches.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridengine import checks
from hybridengine.config import EngineConfig
from hybridengine.rollout import async_decode, generator
from hybridengine.rollout.block_manager import BlockManager
from hybridengine.rollout.outputs import CompletionOutput, RequestOutput
from hybridengine.rollout.runner import ModelRunner
from hybridengine.rollout.sampler import Sampler
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.scheduler import Scheduler
from hybridengine.rollout.sequence import PLACEHOLDER, Sequence, Status
from hybridengine.rollout.tp_group import TPGroup


@dataclass(eq=False)
class Request:
    """One request: its prompt sequence, then (after its prefill) its n sample sequences."""

    key: str | int
    """The caller's request id (a str), or an int for the requests of a `generate` call."""
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    """Reported by `drain` (add_request); generate's and generate_async's requests are not."""
    waiter: asyncio.Future | None = None
    """generate_async's future: gets the final output."""
    seqs: list[Sequence] = field(default_factory=list)
    version: int = 0
    """The policy version of the rollout it runs in: of every token resolved since `stamp` last ran."""
    versions: dict[int, list[int]] = field(default_factory=dict)
    """Per sample: the policy version of each token up to the last `stamp`."""
    num_finished: int = 0
    aborted: bool = False
    reported: dict[int, int] = field(default_factory=dict)
    """Per sample: tokens already reported by a "delta" output."""

    @property
    def finished(self) -> bool:
        return self.aborted or self.num_finished == self.params.n

    def stamp(self) -> None:
        """Tag the tokens resolved since the last call with the policy version that sampled them, before
        the version changes (when the request is kept). Tokens past a sample's stamped ones carry
        `version`, so the per-step outputs stamp nothing."""
        for seq in self.seqs:
            v = self.versions.setdefault(seq.sample, [])
            v.extend([self.version] * (len(seq.logprobs) - len(v)))

    def _versions(self, j: int, first: int, k: int) -> list[int]:
        """The policy versions of sample j's tokens first..k-1."""
        old = self.versions.get(j, ())
        stamped = len(old)
        if first >= stamped:
            return [self.version] * (k - first)
        return list(old[first:min(k, stamped)]) + [self.version] * (k - max(first, stamped))

    def output(self, delta: bool = False) -> RequestOutput:
        """Every sample's resolved tokens so far (a token still in flight is not reported, nor its
        sample's finish reason); with `delta`, only those not reported by an earlier delta output.
        Built on every step() for every request that progressed, so it costs O(samples + tokens
        reported): the outputs of one request share its `prompt_token_ids` list."""
        seqs, n = self.seqs, self.params.n
        if len(seqs) != n or (n > 1 and any(seq.sample != j for j, seq in enumerate(seqs))):  # before the fork
            by_sample = {seq.sample: seq for seq in seqs}
            seqs = [by_sample.get(j) for j in range(n)]
        outs = []
        reported = self.reported
        for j, seq in enumerate(seqs):
            if seq is None:  # before the fork, or never prefilled
                outs.append(CompletionOutput(j, [], [], "abort" if self.aborted else None, []))
                continue
            logprobs, start = seq.logprobs, seq.num_prompt_tokens
            k = len(logprobs)
            reason = seq.finish_reason
            if reason != "abort" and seq.token_ids[-1] == PLACEHOLDER:
                reason = None
            first = reported.get(j, 0) if delta else 0
            if delta:
                reported[j] = k
            routed = None
            if seq.routed_experts is not None and reason is not None and reason != "abort":
                routed = seq.routed_experts = seq.routed_experts.cpu()
            outs.append(CompletionOutput(j, seq.token_ids[start + first:start + k], logprobs[first:k], reason,
                                         self._versions(j, first, k), routed))
        return RequestOutput(self.prompt_token_ids, outs, None if isinstance(self.key, int) else self.key,
                             self.finished)


class RolloutSession:
    """The scheduler, the live requests and the async-decode step of one rollout."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, config: EngineConfig, *, vocab_size: int,
                 tp: TPGroup | None, policy_version: int, kept: list[Request] = (),
                 grow: Callable[[], int] | None = None):
        self.runner, self.sampler, self.config, self.tp = runner, sampler, config, tp
        self.vocab_size, self.policy_version = vocab_size, policy_version
        blocks = BlockManager(runner.kv.num_blocks, config.block_size,
                              enable_prefix_caching=config.enable_prefix_caching)
        self.sched = Scheduler(blocks, max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens, grow=grow,
                               on_finish=None if runner.routing is None else self._read_routing)
        self.requests: dict[str | int, Request] = {}
        """Live (unfinished) requests in the scheduler."""
        self.pending: dict[str, Request] = {}
        """TP driver: submitted, to be sent with the next message."""
        self.aborted: list[str] = []
        """TP driver: live requests aborted since the last message."""
        self.progressed: dict[str, Request] = {}
        """Streamed requests that progressed since the last `drain`."""
        self.finished_ids: set[str] = set()
        """Ids finished or aborted in this rollout: aborting one again is a no-op."""
        self.inflight: async_decode.Sampled | None = None
        self.is_driver = tp is None or dist.get_rank() == tp.src
        self.closed = False
        """TP follower: the driver closed the rollout (its keep flag: `close_keep`)."""
        self.close_keep = False
        self.num_waiters = 0
        self.num_scheduled = 0
        """Sequences in the last model step."""
        self.num_steps = self.async_steps = 0
        self.decode_s = 0.0
        self._keys = itertools.count()
        for req in kept:
            self._resume(req)

    def _read_routing(self, seq: Sequence) -> None:
        seq.routed_experts = self.runner.routing.read(seq)

    # -- requests in and out -------------------------------------------------------------------------

    def check_new(self, request_id, prompt, params) -> list[int]:
        """A new request's arguments, as `add_request` takes them: raises ValueError naming the first bad
        one, before any state changes. Returns the prompt as a list."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {checks.describe(request_id)}")
        if request_id in self.requests or request_id in self.pending:
            raise ValueError(f"request_id {request_id!r} is already a live request of this rollout")
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt.tolist()
        generator.check_request(prompt, params, name="prompt_token_ids", params_name="sampling_params",
                                vocab_size=self.vocab_size, config=self.config, num_blocks=self.runner.kv.capacity)
        return list(prompt)

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, *, stream: bool,
               waiter: asyncio.Future | None = None) -> None:
        """A checked request from the caller: admitted now, or under TP with the driver's next message."""
        req = Request(request_id, prompt, params, stream, waiter)
        self.num_waiters += waiter is not None
        self.finished_ids.discard(request_id)
        if self.tp is None:
            self._admit(req)
        else:
            self.pending[request_id] = req

    def admit(self, prompt: list[int], params: SamplingParams) -> Request:
        """A checked request of a `generate` call, admitted now on every rank alike (its key is an int)."""
        req = Request(next(self._keys), list(prompt), params, stream=False)  # its outputs' list, not the caller's
        self._admit(req)
        return req

    def _admit(self, req: Request) -> None:
        req.version = self.policy_version
        prompt = req.prompt_token_ids
        seq = Sequence(request=req.key, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=req.params,
                       fork=req.params.n)
        req.seqs.append(seq)
        self.requests[req.key] = req
        self.sched.add(seq)

    def _resume(self, req: Request) -> None:
        """A request kept from the previous rollout: its unfinished sequences wait to be prefilled again."""
        req.version = self.policy_version
        if req.finished:  # finished at the end of the last rollout, not reported yet
            self.finished_ids.add(req.key)
        else:
            self.requests[req.key] = req
            for seq in req.seqs:
                if seq.status is not Status.FINISHED:
                    self.sched.add(seq)
        if req.stream and (req.params.output_kind != "final_only" or req.finished):
            self.progressed[req.key] = req
        if req.waiter is not None and req.waiter.done():  # its task was cancelled meanwhile
            req.waiter = None
        self.num_waiters += req.waiter is not None

    def abort(self, request_id) -> None:
        """Drop a request now and free its blocks; its waiter gets its output (finish_reason 'abort' for
        the unfinished samples). Unknown id: ValueError; an id finished in this rollout: no-op."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {checks.describe(request_id)}")
        if request_id in self.pending:  # never sent: nothing to tell the group
            req = self.pending.pop(request_id)
        elif request_id in self.requests:
            req = self.requests[request_id]
            if self.tp is not None and self.is_driver:
                self.aborted.append(request_id)
        elif request_id in self.finished_ids:
            return
        else:
            raise ValueError(f"abort: unknown request_id {request_id!r} (not a live request of this rollout)")
        self._abort(req)

    def _abort(self, req: Request) -> None:
        self.requests.pop(req.key, None)
        if self.inflight is not None:  # its rows of the step in flight are void
            for i, seq in enumerate(self.inflight.seqs):
                if seq.request == req.key:
                    self.inflight.void[i] = True
        for seq in req.seqs:
            if seq.status is not Status.FINISHED:
                self.sched.abort(seq)
        req.aborted = True
        self.progressed.pop(req.key, None)
        self._done(req)

    def _done(self, req: Request) -> None:
        """A request leaves: finished or aborted."""
        self.requests.pop(req.key, None)
        if isinstance(req.key, str):
            self.finished_ids.add(req.key)
        if req.stream and req.params.output_kind == "final_only" and not req.aborted:
            self.progressed[req.key] = req
        if req.waiter is not None:
            if not req.waiter.done():  # not cancelled
                req.waiter.set_result(req.output())
            req.waiter = None
            self.num_waiters -= 1

    def fail_waiters(self, error: BaseException) -> None:
        """generate_async's tasks get the error of the step that failed."""
        for req in list(self.requests.values()) + list(self.pending.values()):
            if req.waiter is not None:
                if not req.waiter.done():
                    req.waiter.set_exception(error)
                req.waiter = None
        self.num_waiters = 0

    def drain(self) -> list[Request]:
        """The streamed requests that progressed since the last call, in the order they first did."""
        out, self.progressed = list(self.progressed.values()), {}
        return out

    @property
    def has_unfinished(self) -> bool:
        """A request is live or submitted, or a streamed one has progress not reported yet (a `generate`
        call or generate_async's task may have stepped it to its end); on a TP follower, the driver has
        not closed the rollout."""
        if not self.is_driver:
            return not self.closed
        return bool(self.requests or self.pending or self.progressed)

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> None:
        """One iteration: resolve the step in flight when the next one is not a plain decode, then
        schedule -> run the model -> sample -> post-process (async decode: the new step is launched
        before the previous one's tokens are read)."""
        sched, runner = self.sched, self.runner
        if self.inflight is not None and not sched.decodes_next():
            self._resolve(self.inflight)  # a prefill or a preemption comes next: sync first
            self.inflight = None
        self.num_scheduled = 0
        if sched.done:
            return
        ts, captured = time.perf_counter(), runner.graph_capture_s
        batch = sched.schedule()
        inflight = self.inflight
        prev = (None if inflight is None
                else (inflight.next_ids, async_decode.next_rows(batch.seqs, inflight.seqs, runner.device)))
        logits = runner.step(batch, prev)
        seqs = batch.seqs
        if batch.is_prefill:
            logits, seqs = async_decode.fork_prefilled(sched, batch, logits, runner.device)
            for seq in seqs:  # a fork's new samples join their request
                req = self.requests[seq.request]
                if len(req.seqs) < req.params.n and seq.sample == len(req.seqs):
                    req.seqs.append(seq)
        tokens, logprobs = self.sampler(logits, seqs, self.config.tuning.sampler)
        step = async_decode.launch(seqs, tokens, logprobs, self.tp, runner.readback)
        if inflight is not None:
            self._resolve(inflight)
            self.async_steps += 1
        async_decode.reserve(sched, step)
        if batch.is_prefill or not self.config.tuning.async_scheduling:
            self._resolve(step)
            self.inflight = None
        else:
            self.inflight = step
        if not batch.is_prefill:  # the whole iteration, host bookkeeping included (a lazy graph capture not)
            self.decode_s += time.perf_counter() - ts - (runner.graph_capture_s - captured)
        self.num_steps += 1
        self.num_scheduled = len(seqs)

    def _resolve(self, step: async_decode.Sampled) -> None:
        """Read a step's tokens into its sequences; note who progressed, let finished requests go."""
        finished: list[Sequence] = []
        async_decode.resolve(self.sched, step, finished)
        for seq, void in zip(step.seqs, step.void):
            if void:
                continue
            req = self.requests[seq.request]
            if req.stream and req.params.output_kind != "final_only":
                self.progressed[req.key] = req
        for seq in finished:
            req = self.requests[seq.request]
            req.num_finished += 1
            if req.finished:
                self._done(req)

    def counters(self) -> dict[str, float]:
        """Totals since the session began: steps, decode_s, preemptions, async_steps."""
        return dict(steps=self.num_steps, decode_s=self.decode_s, preemptions=self.sched.num_preemptions,
                    async_steps=self.async_steps)

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens served from cached KV blocks since the session began."""
        return self.sched.blocks.num_cached_tokens_hit

    # -- the end of the rollout ----------------------------------------------------------------------

    def close(self, keep: bool, *, failed: bool = False) -> list[Request]:
        """End the session: resolve the step in flight, then keep the unfinished requests (their blocks
        freed, their sequences waiting: returned, for the next session) or abort them. Streamed
        requests that progressed and were not reported yet are kept too when `keep`. `failed` (the
        rollout ends by an exception): abort everything without touching the device."""
        if self.inflight is not None and not failed:
            self._resolve(self.inflight)
        self.inflight = None
        for req in list(self.pending.values()):  # never admitted (a TP driver's, unsent)
            self._abort(req)
        self.pending.clear()
        live = list(self.requests.values())
        if not keep or failed:
            for req in live:
                self._abort(req)
            return []
        for req in live:
            for seq in req.seqs:
                if seq.status is not Status.FINISHED:
                    self.sched.blocks.free(seq)
                    seq.status = Status.WAITING
        self.requests.clear()
        kept = live + [req for req in self.progressed.values() if req.finished]
        for req in kept:
            req.stamp()  # this rollout's tokens, before the version changes
        return kept

    # -- TP: the driver's messages -----------------------------------------------------------------

    def send(self, kind: str, payload=None) -> None:
        """TP driver: broadcast (kind, payload) to the group with the requests submitted and aborted since
        the last message, then admit the submitted ones (the followers do the same in `receive`)."""
        adds = [(r.key, r.prompt_token_ids, r.params, r.stream) for r in self.pending.values()]
        dist.broadcast_object_list([(kind, payload, adds, self.aborted)], src=self.tp.src, group=self.tp.messages)
        self.aborted = []
        for req in self.pending.values():
            self._admit(req)
        self.pending.clear()

    def receive(self) -> tuple[str, object]:
        """TP follower: the driver's next message; its aborts and submissions applied. Returns (kind,
        payload); 'close' marks the session closed."""
        message = [None]
        dist.broadcast_object_list(message, src=self.tp.src, group=self.tp.messages)
        kind, payload, adds, aborted = message[0]
        for request_id in aborted:
            self._abort(self.requests[request_id])
        for request_id, prompt, params, stream in adds:
            self._admit(Request(request_id, prompt, params, stream))
        if kind == "close":
            self.closed, self.close_keep = True, bool(payload)
        return kind, payload
