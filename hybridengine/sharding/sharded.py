"""Former home of the switch and the generation memory: re-exports of `switch` and `generation_memory`."""

from hybridengine.sharding.generation_memory import GenerationBuffer, vmm_status  # noqa: F401
from hybridengine.sharding.switch import SWITCH_BATCH_BYTES, ShardedBuffer, switch_batches  # noqa: F401
