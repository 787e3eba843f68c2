"""verl's rollout on the actor's own HybridEngine (verl's HYBRID mode): no second copy of the weights.

Two halves, as verl splits every rollout backend:

- `HybridEngineRollout` (verl's `BaseRollout`) lives in each `ActorRolloutRefWorker` process beside the
  training engine and shares its HybridEngine (`shared.get()`). `resume(tags=["kv_cache"])` enters
  `engine.rollout()` (the switch to the generation view and the KV cache), `release()` leaves it,
  `update_weights` loads nothing: the optimizer writes the weights into the buffer the rollout reads.
- `HybridEngineReplica` (verl's `RolloutReplica`) starts one `HybridEngineServer` Ray actor per replica;
  verl's agent loop sends it token-in-token-out `generate(prompt_ids, sampling_params, request_id)` calls.
  The server gathers the requests that arrive together into one batch and runs it in the workers'
  processes (Ray's `__ray_call__`), where the engine is: the first worker of the TP group drives the
  batch, the others follow it.

A replica is one TP group of generation. The engine's TP group j holds ranks j, j + m, j + 2m, ...
(m = world size / TP degree, the layout's micro-DP size), so replica j takes those workers, not a
contiguous slice as verl's vLLM replicas do.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Generator

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from hybridengine.integrations.verl import shared
from hybridengine.rollout.sampling_params import SamplingParams

__all__ = ["HybridEngineReplica", "HybridEngineRollout", "HybridEngineServer", "engine_options", "sampling_params"]

_RESUME_TAGS = frozenset({"weights", "kv_cache"})
# verl's agent loop sends each sample as its own actor call; the server waits this long after the first
# request of a batch so that the calls sent together become one engine batch (one prefill, one decode
# loop) instead of one generate() per sample.
_BATCH_WINDOW_S = 0.01


def engine_options(config) -> dict:
    """The EngineConfig fields a verl RolloutConfig sets: the TP degree of generation, the KV cache's
    bounds, CUDA graphs, plus every field under `engine_kwargs.hybridengine` (e.g. exact_logprobs)."""
    if not config.free_cache_engine:
        raise ValueError("rollout.free_cache_engine must be true for rollout 'hybridengine': the engine switches "
                         "between its training and generation views at resume/release")
    for name in ("data_parallel_size", "pipeline_model_parallel_size", "expert_parallel_size"):
        if getattr(config, name, 1) != 1:
            raise ValueError(f"rollout.{name} must be 1 for rollout 'hybridengine' (generation is tensor-parallel "
                             f"only), got {getattr(config, name)}")
    max_model_len = config.max_model_len or config.prompt_length + config.response_length
    options = dict(tp_generation=config.tensor_model_parallel_size, max_model_len=int(max_model_len),
                   gpu_memory_utilization=config.gpu_memory_utilization, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   enable_prefix_caching=config.enable_prefix_caching, cuda_graphs=not config.enforce_eager)
    extra = dict((config.engine_kwargs or {}).get("hybridengine") or {})
    clash = sorted(set(extra) & set(options))
    if clash:
        raise ValueError(f"rollout.engine_kwargs.hybridengine sets {', '.join(clash)}, which the rollout config "
                         f"already sets; set them on the rollout config")
    return {**options, **extra}


def sampling_params(params: dict[str, Any], prompt_len: int, *, config,
                    eos_token_ids: tuple[int, ...]) -> SamplingParams:
    """verl's per-request sampling dict -> SamplingParams, with vLLM's server defaults: max_tokens from the
    request or min(response_length, prompt_length + response_length - prompt_len), capped by max_model_len;
    generation stops at the model's EOS tokens unless ignore_eos."""
    params = dict(params)
    unknown = sorted(set(params) - {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens",
                                    "max_new_tokens", "ignore_eos", "seed"})
    if unknown:
        raise ValueError(f"sampling_params: {', '.join(unknown)} not supported by rollout 'hybridengine'")
    if params.get("repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"sampling_params.repetition_penalty must be 1.0 for rollout 'hybridengine' (the rollout "
                         f"log-probs are the trainer's), got {params['repetition_penalty']}")
    room = (config.max_model_len or config.prompt_length + config.response_length) - prompt_len
    if room < 1:
        raise ValueError(f"prompt_ids: {prompt_len} tokens leave no room to generate within max_model_len")
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    if max_tokens is None:
        max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    ignore_eos = params.get("ignore_eos", config.ignore_eos)
    top_k = params.get("top_k", -1)
    return SamplingParams(temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                          top_k=-1 if top_k is None or top_k <= 0 else int(top_k),
                          max_tokens=max(1, min(int(max_tokens), room)),
                          stop_token_ids=() if ignore_eos else eos_token_ids, seed=params.get("seed"))


def _eos_token_ids(model_config) -> tuple[int, ...]:
    ids = []
    for source in (getattr(model_config, "generation_config", None), getattr(model_config, "tokenizer", None)):
        eos = getattr(source, "eos_token_id", None)
        ids.extend(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return tuple(dict.fromkeys(int(i) for i in ids))


class HybridEngineRollout(BaseRollout):
    """verl's rollout in the worker process: the switch and the batches of its replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        shared.configure(**engine_options(self.config))
        self._eos_token_ids = _eos_token_ids(self.model_config)
        self._active: contextlib.ExitStack | None = None

    @property
    def is_active(self) -> bool:
        """Whether the engine is in its generation view (between resume and release)."""
        return self._active is not None

    async def resume(self, tags: list[str]):
        """"kv_cache" enters the generation view (the switch, then the KV cache); "weights" does nothing, since
        the weights are already in place. verl resumes "weights" before it asks the training engine for its
        parameters (`get_per_tensor_param`, a training-view call) and "kv_cache" after: the switch comes last."""
        unknown = sorted(set(tags) - _RESUME_TAGS)
        if unknown:
            raise ValueError(f"resume: tags must be among {sorted(_RESUME_TAGS)}, got {list(tags)}")
        if "kv_cache" in tags:
            self.enter()

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", **kwargs):
        """Nothing to load: the rollout reads the training buffer, where the optimizer wrote the weights.
        The training engine's `get_per_tensor_param` yields nothing, so `weights` is not iterated."""

    async def release(self):
        """Leave the generation view (frees the KV cache and the other shards' pages); a no-op when not in it."""
        self.exit()

    def enter(self) -> None:
        if self._active is None:
            stack = contextlib.ExitStack()
            stack.enter_context(shared.get().rollout())
            self._active = stack

    def exit(self) -> None:
        if self._active is not None:
            stack, self._active = self._active, None
            stack.close()

    def generate_batch(self, requests: list[tuple[list[int], dict[str, Any]]]) -> list[dict[str, Any]]:
        """Generate one batch of (prompt_ids, sampling_params) requests: per request the token ids, the
        sampler's log-probs and the finish reason. Under TP every worker of the group calls it; the first
        one's batch is generated."""
        if self._active is None:
            raise RuntimeError("generate: the hybridengine rollout is released; verl resumes it (update_weights) "
                               "before it sends requests")
        engine = shared.get()
        params = [sampling_params(p, len(ids), config=self.config, eos_token_ids=self._eos_token_ids)
                  for ids, p in requests]
        outputs = engine.generate([list(ids) for ids, _ in requests], params)
        return [dict(token_ids=list(o.outputs[0].token_ids), log_probs=list(o.outputs[0].logprobs),
                     finish_reason=o.outputs[0].finish_reason, policy_version=engine.policy_version)
                for o in outputs]


def _call_rollout(worker, method: str, *args):
    """Runs in a worker process (through `__ray_call__`): `<the rollout>.<method>(*args)`. The rollout is the
    worker's, or, where verl fuses roles into one process (its `WorkerDict`), one of its workers'."""
    for role in (worker, *getattr(worker, "worker_dict", {}).values()):
        rollout = getattr(role, "rollout", None)
        if isinstance(rollout, HybridEngineRollout):
            return getattr(rollout, method)(*args)
    raise RuntimeError(f"worker {type(worker).__name__} has no hybridengine rollout "
                       f"(actor_rollout_ref.rollout.name must be 'hybridengine')")


class HybridEngineServer:
    """The token-in-token-out server of one replica (a Ray actor): verl's `generate` and the replica's
    control calls, forwarded to the replica's workers."""

    def __init__(self, workers: list, replica_rank: int):
        self.workers = list(workers)
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self._batch_task: asyncio.Task | None = None

    async def _on_workers(self, method: str, *args):
        results = await asyncio.gather(*[w.__ray_call__.remote(_call_rollout, method, *args) for w in self.workers])
        return results[0]

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       **kwargs) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("generate: rollout 'hybridengine' takes text token ids only (no image/video/audio data)")
        params = dict(sampling_params)
        want_logprobs = bool(params.pop("logprobs", False))
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), params, future))
        if self._batch_task is None or self._batch_task.done():
            self._batch_task = asyncio.create_task(self._run_batches())
        out = await future
        extra_fields = {"global_steps": self.global_steps, "policy_version": out["policy_version"]}
        return TokenOutput(token_ids=out["token_ids"], log_probs=out["log_probs"] if want_logprobs else None,
                           stop_reason="aborted" if out["finish_reason"] == "abort" else "completed",
                           extra_fields=extra_fields)

    async def _run_batches(self):
        while self._pending:
            await asyncio.sleep(_BATCH_WINDOW_S)
            batch, self._pending = self._pending, []
            try:
                outs = await self._on_workers("generate_batch", [(ids, p) for ids, p, _ in batch])
            except Exception as e:  # every waiting request gets the error
                for *_, future in batch:
                    future.set_exception(e)
                continue
            for (*_, future), out in zip(batch, outs):
                future.set_result(out)

    async def wait_for_requests_to_drain(self):
        while self._batch_task is not None and not self._batch_task.done():
            await asyncio.shield(self._batch_task)

    async def wake_up(self, tags: list[str] | None = None):
        await self._on_workers("enter")

    async def sleep(self):
        await self.wait_for_requests_to_drain()
        await self._on_workers("exit")

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    async def get_server_address(self):
        return f"hybridengine-replica-{self.replica_rank}", 0

    # A batch runs to its end and the prefix cache never outlives a rollout() block (a weight change), so
    # there is nothing to abort, clear or move for these calls of verl's replica interface.
    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        await self.wait_for_requests_to_drain()
        return {}

    async def resume_generation(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


class HybridEngineReplica(RolloutReplica):
    """verl's rollout replica for 'hybridengine': one TP group of the actor's workers and its server."""

    async def init_hybrid(self, worker_group):
        num_replicas = worker_group.world_size // self.world_size
        if num_replicas * self.world_size != worker_group.world_size:
            raise ValueError(f"rollout.tensor_model_parallel_size {self.world_size} must divide the actor's world "
                             f"size {worker_group.world_size}")
        self.rollout_mode = RolloutMode.HYBRID
        self.workers = worker_group.workers[self.replica_rank::num_replicas]
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group, resource_pool):
        raise NotImplementedError("rollout 'hybridengine' runs in verl's HYBRID mode only (the actor's engine)")

    async def init_colocated(self, resource_pool):
        raise NotImplementedError("rollout 'hybridengine' runs in verl's HYBRID mode only (the actor's engine)")

    async def init_standalone(self):
        raise NotImplementedError("rollout 'hybridengine' runs in verl's HYBRID mode only (the actor's engine)")

    async def launch_servers(self):
        server_cls = ray.remote(HybridEngineServer)
        # No CPU reserved: the server only forwards calls, the workers compute.
        server = server_cls.options(name=f"hybridengine_server_{self.replica_rank}{self.name_suffix}", num_cpus=0,
                                    max_concurrency=self.max_concurrency).remote(self.workers, self.replica_rank)
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"

    def rollout_worker_use_gpu(self) -> bool:
        return False
