"""Re-exports for callers not yet moved."""

from hybridengine.ops.rms_norm import rms_norm, rms_norm_ref, rms_norm_train, rms_norm_triton
from hybridengine.ops.rope import rope_ref, rope_train, rope_triton_
from hybridengine.ops.silu_mul import silu_mul, silu_mul_ref, silu_mul_train, silu_mul_triton
from hybridengine.ops.stacked_rows import stacked_rows
