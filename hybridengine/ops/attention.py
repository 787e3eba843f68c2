"""Re-exports for callers not yet moved."""

from hybridengine.ops._launch import NO_WINDOW
from hybridengine.ops.kv_store import (rope_store_kv, rope_store_kv_ref, rope_store_kv_triton, store_kv, store_kv_ref,
                                       store_kv_triton)
from hybridengine.ops.paged_attention import (DECODE_MAX_SPLITS, DECODE_MIN_PARTITION, DECODE_PREFETCH_PROGRAMS,
                                              DECODE_REDUCE_BLOCK_D, DECODE_REDUCE_CHUNK, DECODE_SPLIT_BELOW,
                                              DECODE_TARGET_WAVES, decode_num_splits, decode_partition_plan,
                                              decode_partitions, num_sms, paged_decode_attention,
                                              paged_decode_attention_ref, paged_decode_attention_triton)
from hybridengine.ops.prefill_attention import prefill_attention, prefill_attention_ref, prefill_attention_triton
