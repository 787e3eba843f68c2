"""Triton kernels of hybridengine, installed as `hybridengine.kernels` (paged KV cache and
attention, fused PPO loss). Each kernel has a plain-torch reference in the package; engine code
imports the ops, not the kernels."""
