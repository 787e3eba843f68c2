"""The rollout loop: the request API over an open rollout, and the TP driver/follower protocol.

`RolloutLoop` is what `HybridEngine`'s generation calls go through. `open` starts a rollout's
`RolloutSession` (rollout/requests.py; requests kept by the last rollout re-enter first) and `close` ends
it. In between: `add_request` / `step` / `abort` (vLLM's request API), `generate_async` (asyncio tasks
batched by one stepping task) and `generate` (a batch, run to completion). Each step is the session's
schedule -> run the model -> sample -> post-process.

Under TP generation (tp_generation > 1) each TP group has one driver, its first rank (`TPGroup.src`):
add_request, abort and generate_async are the driver's. Every driver step() first sends its group the
requests added and aborted since its last message (`RolloutSession.send`, on a gloo group), then every
rank runs the same schedule. A follower's step() waits for the driver's next message and runs it
(`_follow`): "step", "generate" (a batch: a follower's own `generate` call waits for it too) or "close"
(the end of the driver's rollout() block, with its keep_unfinished choice). A driver idle for longer
than collective_timeout_s makes its followers time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from hybridengine.config import EngineConfig
from hybridengine.faults import PhaseGuard
from hybridengine.rollout import generator
from hybridengine.rollout.outputs import RequestOutput
from hybridengine.rollout.requests import Request, RolloutSession
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.tp_group import TPGroup


class RolloutLoop:
    """The requests of an engine's rollouts: the open rollout's session, the requests kept between
    rollouts, and the TP group's driver/follower protocol."""

    def __init__(self, config: EngineConfig, guard: PhaseGuard, tp: TPGroup | None, *, vocab_size: int, rank: int,
                 stats: dict[str, float]):
        self.config, self.guard, self.tp = config, guard, tp
        self.vocab_size, self.rank = vocab_size, rank
        self.stats = stats  # the engine's: each call notes its counters there
        self.session: RolloutSession | None = None  # the open rollout's requests
        self.kept: list[Request] = []  # requests kept unfinished by the last rollout (`close(keep=True)`)
        self._stepper: asyncio.Task | None = None  # generate_async's stepping task
        self._async_ids = itertools.count()
        self._cache_hits = 0  # prefix-cache hits of the closed rollouts

    # -- a rollout's lifetime ---------------------------------------------------------------------------

    def open(self, runner, sampler, *, policy_version: int, grow=None) -> None:
        """Start the rollout's session on `runner` (the kept requests re-enter first)."""
        self.session = RolloutSession(runner, sampler, self.config, vocab_size=self.vocab_size, tp=self.tp,
                                      policy_version=policy_version, kept=self.kept, grow=grow)
        self.kept = []
        if self.session.num_waiters:  # generate_async tasks wait on kept requests
            self._drive_async()

    def close(self, keep: bool, ok: bool) -> None:
        """End the open rollout's requests (kept, or aborted): under TP on a normal exit, the driver tells
        its group (and sends what it has not sent yet); the followers run its messages until then. The
        whole rollout's counters go to `stats` (generate() notes its own call's)."""
        session, self.session = self.session, None
        if session is None:
            return
        self.stats.update({f"rollout_{k}": v for k, v in session.counters().items()},
                          rollout_cuda_graph_capture_s=session.runner.graph_capture_s,
                          rollout_kv_blocks=session.runner.kv.num_blocks)
        self._cache_hits += session.prefix_cache_hit_tokens
        if ok and self.tp is not None:
            with self.guard.work("rollout") as phase:
                if session.is_driver:
                    session.send("close", keep)
                else:
                    while not session.closed:
                        self._follow(session, phase)
                    keep = session.close_keep
        self.kept = session.close(keep, failed=not ok)

    # -- the request API (under TP: the driver's) -------------------------------------------------------

    def live(self, op: str) -> RolloutSession:
        if self.session is None:
            raise ValueError(f"{op}() must be called inside `with engine.rollout():`")
        return self.session

    def driver(self, op: str) -> RolloutSession:
        session = self.live(op)
        if not session.is_driver:
            raise ValueError(f"{op}(): under TP generation the TP group's first rank (global rank {self.tp.src}) "
                             "takes the requests; this rank follows them in step()")
        return session

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        session = self.driver("add_request")
        prompt = session.check_new(request_id, prompt_token_ids, sampling_params)
        session.submit(request_id, prompt, sampling_params, stream=True)

    def step(self) -> list[RequestOutput]:
        session = self.live("step")
        self._step(session)
        return [req.output(delta=req.params.output_kind == "delta") for req in session.drain()]

    def abort(self, request_id: str) -> None:
        self.driver("abort").abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.session.has_unfinished if self.session is not None else bool(self.kept)

    async def generate_async(self, prompt_token_ids: list[int],
                             sampling_params: SamplingParams | None = None) -> RequestOutput:
        session = self.driver("generate_async")
        params = SamplingParams() if sampling_params is None else sampling_params
        request_id = f"async-{next(self._async_ids)}"
        prompt = session.check_new(request_id, prompt_token_ids, params)
        waiter = asyncio.get_running_loop().create_future()
        session.submit(request_id, prompt, params, stream=False, waiter=waiter)
        self._drive_async()
        try:
            return await waiter
        except asyncio.CancelledError:
            if self.session is not None:
                with contextlib.suppress(ValueError):  # it left another rollout before the cancellation
                    self.session.abort(request_id)
            else:
                self.kept = [req for req in self.kept if req.key != request_id]
            raise

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = False) -> list[RequestOutput]:
        session = self.live("generate")
        prompts = generator.token_id_lists(prompts)  # a tensor of token ids: one prompt per row
        params = generator.batch_params(prompts, sampling_params)
        if self.tp is None:  # no collectives: this rank's batch alone
            return self._generate(session, prompts, params, progress=use_tqdm)
        # a collective phase of the TP group, which generates one batch: its first rank's
        with self.guard.work("generate") as phase:
            if session.is_driver:
                session.send("generate", (prompts, params))
                return self._generate(session, prompts, params, progress=use_tqdm, consistent=phase.consistent)
            while True:
                outputs = self._follow(session, phase)
                if outputs is not None:
                    return outputs
                if session.closed:
                    raise RuntimeError(f"generate(): the TP driver (global rank {self.tp.src}) left its rollout() "
                                       "block without calling generate")

    # -- steps and the TP protocol ---------------------------------------------------------------------

    def _step(self, session: RolloutSession) -> None:
        if self.tp is None:
            session.step()
        else:
            with self.guard.work("step") as phase:
                if session.is_driver:
                    session.send("step")
                    session.step()
                elif not session.closed:
                    self._follow(session, phase)
        self.stats["prefix_cache_hit_tokens"] = self._cache_hits + session.prefix_cache_hit_tokens

    def _follow(self, session: RolloutSession, phase):
        """TP follower: run the driver's next message (a step, or a generate call: its outputs)."""
        kind, payload = session.receive()
        if kind == "step":
            session.step()
        elif kind == "generate":
            return self._generate(session, *payload, consistent=phase.consistent)
        return None

    def _generate(self, session: RolloutSession, prompts, params, *, progress: bool = False,
                  consistent=lambda fn, *args, **kwargs: fn(*args, **kwargs)) -> list[RequestOutput]:
        """`generate`'s batch, checked (under TP on every rank alike: `consistent`) and run to completion."""
        consistent(generator.check_requests, prompts, params, vocab_size=self.vocab_size, config=self.config,
                   num_blocks=session.runner.kv.capacity)
        outputs, stats = generator.generate(session, prompts, params, progress=progress and self.rank == 0)
        self.stats.update(stats, prefix_cache_hit_tokens=self._cache_hits + session.prefix_cache_hit_tokens)
        return outputs

    def _drive_async(self) -> None:
        """Start the stepping task unless it runs (and a loop runs: a rollout entered outside one has
        no task waiting)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        """Step the open rollout while generate_async tasks wait on it; they run between steps."""
        while (session := self.session) is not None and session.num_waiters:
            try:
                self._step(session)
            except Exception as err:  # noqa: BLE001 - every waiting task gets it
                session.fail_waiters(err)
                return
            await asyncio.sleep(0)
