"""hybridengine.integrations.verl, the rollout side: registration with verl, verl's RolloutConfig and
sampling dicts mapped onto the engine, the switch at resume/release, and the server's batches.

The rollout runs here in-process on a tiny random engine offered to `shared` as the training engine
offers it; the server is driven with stand-in worker handles. verl's own trainer loop over Ray is
tests/test_verl_loop.py. Skipped when verl is not importable (the verl extra: make setup-verl);
CI's verl job installs it (`make test-verl` sets HE_REQUIRE_VERL=1, which makes a missing verl an error).
"""

import asyncio
import dataclasses
import os

import pytest
import torch

if not os.environ.get("HE_REQUIRE_VERL"):
    pytest.importorskip("verl", reason="verl is not importable (the verl extra: make setup-verl)")

import hybridengine as he  # noqa: E402
from hybridengine.integrations import verl as he_verl  # noqa: E402
from hybridengine.integrations.verl import rollout as he_rollout  # noqa: E402
from hybridengine.integrations.verl import shared  # noqa: E402
from hybridengine.examples.grpo import TASK_CONFIG  # noqa: E402


def rollout_config(**overrides):
    from verl.workers.config import RolloutConfig

    fields = dict(name="hybridengine", tensor_model_parallel_size=1, prompt_length=8, response_length=4,
                  max_num_seqs=64, calculate_log_probs=True)
    fields.update(overrides)
    return RolloutConfig(**fields)


@dataclasses.dataclass
class ModelConfig:  # what the rollout reads of verl's HFModelConfig
    generation_config: object = None
    tokenizer: object = None


@pytest.fixture
def engine_offered():
    """A tiny random engine offered to `shared` the way the training engine offers its own."""
    from transformers import AutoConfig

    kw = dict(TASK_CONFIG)
    source = AutoConfig.for_model(kw.pop("model_type"), **kw)
    shared.reset()
    shared.offer(lambda options: he.HybridEngine(source, he.EngineConfig(**{"dtype": torch.float32, "device": "cpu",
                                                                            **options})),
                 owner="test")
    yield
    shared.reset()


def test_registered_with_verl():
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.engine import EngineRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert get_rollout_class("hybridengine", "async") is he_verl.HybridEngineRollout
    assert get_rollout_replica_class("hybridengine") is he_verl.HybridEngineReplica
    assert EngineRegistry.get_engine_cls("language_model", "hybridengine") is he_verl.HybridVerlEngine
    assert PlatformRegistry.get("cpu") is he_verl.CPUPlatform
    he_verl.register()  # idempotent
    assert get_rollout_class("hybridengine", "async") is he_verl.HybridEngineRollout


def test_entry_point_names_the_package():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("hybridengine") == "hybridengine.integrations.verl"


def test_engine_options_from_rollout_config():
    cfg = rollout_config(tensor_model_parallel_size=2, gpu_memory_utilization=0.6, enforce_eager=True,
                         engine_kwargs={"hybridengine": {"exact_logprobs": True}})
    opts = he_rollout.engine_options(cfg)
    assert opts == dict(tp_generation=2, max_model_len=12, gpu_memory_utilization=0.6, max_num_seqs=64,
                        max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=True,
                        cuda_graphs=False, exact_logprobs=True)


@pytest.mark.parametrize("overrides, match", [
    (dict(free_cache_engine=False), "free_cache_engine must be true"),
    (dict(data_parallel_size=2), "data_parallel_size must be 1"),
    (dict(engine_kwargs={"hybridengine": {"tp_generation": 2}}), "already sets; set them on the rollout config"),
])
def test_engine_options_refuse(overrides, match):
    with pytest.raises(ValueError, match=match):
        he_rollout.engine_options(rollout_config(**overrides))


def test_sampling_params_as_vllm_server():
    cfg = rollout_config(prompt_length=8, response_length=4)
    sp = he_rollout.sampling_params(dict(temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.0,
                                         logprobs=True), 6, config=cfg, eos_token_ids=(11,))
    assert (sp.temperature, sp.top_p, sp.top_k, sp.stop_token_ids) == (0.7, 0.9, -1, (11,))
    assert sp.max_tokens == 4  # min(response_length, 8 + 4 - 6)
    sp = he_rollout.sampling_params(dict(max_tokens=50, ignore_eos=True), 10, config=cfg, eos_token_ids=(11,))
    assert (sp.max_tokens, sp.stop_token_ids) == (2, ())  # capped by max_model_len 12


@pytest.mark.parametrize("params, prompt_len, match", [
    (dict(repetition_penalty=1.1), 4, "repetition_penalty must be 1.0"),
    (dict(min_p=0.1), 4, "min_p not supported"),
    (dict(), 12, "leave no room to generate"),
])
def test_sampling_params_refuse(params, prompt_len, match):
    with pytest.raises(ValueError, match=match):
        he_rollout.sampling_params(params, prompt_len, config=rollout_config(), eos_token_ids=())


def test_rollout_switch_and_generate(engine_offered):
    rollout = he_verl.HybridEngineRollout(rollout_config(), ModelConfig(), device_mesh=None)
    assert shared.options()["max_model_len"] == 12 and not shared.is_built()
    asyncio.run(rollout.release())  # verl sleeps the replicas once at start: nothing to leave, nothing built
    assert not shared.is_built()
    with pytest.raises(RuntimeError, match="released"):
        rollout.generate_batch([([1, 2, 3], {})])
    with pytest.raises(ValueError, match="tags must be among"):
        asyncio.run(rollout.resume(tags=["optimizer"]))

    asyncio.run(rollout.resume(tags=["weights"]))  # verl's order: weights, update_weights, kv_cache
    assert not rollout.is_active
    asyncio.run(rollout.update_weights(iter(())))
    asyncio.run(rollout.resume(tags=["kv_cache"]))
    assert rollout.is_active
    torch.manual_seed(0)
    outs = rollout.generate_batch([([1, 2, 3], dict(temperature=1.0, logprobs=True)), ([4, 5], dict(max_tokens=2))])
    assert [len(o["token_ids"]) for o in outs] == [4, 2] and len(outs[0]["log_probs"]) == 4
    assert all(o["finish_reason"] in ("length", "stop") for o in outs)
    asyncio.run(rollout.release())
    assert not rollout.is_active
    engine = shared.get()
    # the rollout's log-probs are the sampler's: log_softmax of the training view at temperature 1
    ids = [1, 2, 3] + outs[0]["token_ids"]
    batch = he.PPOBatch(input_ids=[torch.tensor(ids)], response_mask=[torch.tensor([0.0, 0.0] + [1.0] * 4)])
    logp = engine.log_probs(batch, temperature=1.0)[0, 2:]
    torch.testing.assert_close(logp, torch.tensor(outs[0]["log_probs"]), rtol=1e-4, atol=1e-4)


class StandInWorker:
    """A Ray actor handle's `__ray_call__.remote(fn, *args)`, run in-process on an object holding a rollout."""

    def __init__(self, rollout):
        self.rollout = rollout
        self.calls = []
        worker = self

        class Call:
            @staticmethod
            def remote(fn, *args):
                worker.calls.append(args[0])
                future = asyncio.get_running_loop().create_future()
                future.set_result(fn(worker, *args))
                return future

        self.__ray_call__ = Call


def test_server_batches_concurrent_requests(engine_offered):
    rollout = he_verl.HybridEngineRollout(rollout_config(), ModelConfig(), device_mesh=None)
    worker = StandInWorker(rollout)
    server = he_verl.HybridEngineServer([worker], replica_rank=0)

    async def run():
        await server.wake_up()
        await server.set_global_steps(3)
        outs = await asyncio.gather(*[server.generate(prompt_ids=[1, 2, i], sampling_params=dict(logprobs=i % 2 == 0),
                                                      request_id=str(i)) for i in range(6)])
        await server.sleep()
        return outs

    outs = asyncio.run(run())
    assert worker.calls == ["enter", "generate_batch", "exit"]  # six requests, one engine batch
    assert all(len(o.token_ids) == 4 and o.stop_reason == "completed" for o in outs)
    assert [o.log_probs is not None for o in outs] == [i % 2 == 0 for i in range(6)]
    assert outs[0].extra_fields["global_steps"] == 3
    assert not rollout.is_active


def test_server_refuses_multimodal_and_missing_rollout(engine_offered):
    server = he_verl.HybridEngineServer([StandInWorker(None)], replica_rank=0)
    with pytest.raises(ValueError, match="text token ids only"):
        asyncio.run(server.generate(prompt_ids=[1], sampling_params={}, request_id="a", image_data=[object()]))
    with pytest.raises(RuntimeError, match="has no hybridengine rollout"):
        asyncio.run(server.wake_up())


def test_replica_is_hybrid_only():
    replica = he_verl.HybridEngineReplica(0, rollout_config(), model_config=None, gpus_per_node=1)
    with pytest.raises(NotImplementedError, match="HYBRID mode only"):
        asyncio.run(replica.init_standalone())


def test_replica_takes_the_engines_tp_group():
    """TP group j of the engine holds ranks j, j + m, ...: replica j takes those workers."""
    replica = he_verl.HybridEngineReplica(1, rollout_config(tensor_model_parallel_size=2), model_config=None,
                                          gpus_per_node=4)

    class Group:
        world_size = 4
        workers = ["w0", "w1", "w2", "w3"]

    async def no_servers():
        pass

    replica.launch_servers = no_servers
    asyncio.run(replica.init_hybrid(Group()))
    assert replica.workers == ["w1", "w3"]
