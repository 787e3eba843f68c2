"""Probe: what Triton made of the paged decode kernel on this GPU, per launch config.

    python -m hybridengine_bench.probes.probe_decode_kernel      (CUDA only)

Launches `paged_decode_attention_triton` once per config at the 1.5B decode shape (B = 128, 12 q heads,
2 kv heads, 256 tokens, 16-token pages) and prints, for each compiled variant: cp.async count (Triton's
software pipelining; 0 = every load waits in its own iteration), global loads, registers, spills, shared
memory, warps and stages.
"""

from __future__ import annotations

import torch

CONFIGS = (None, dict(PREFETCH=True), dict(BLOCK_N=64, num_stages=1, PREFETCH=True),
           dict(BLOCK_N=128, num_warps=8, num_stages=1, PREFETCH=True))


def main() -> None:
    from hybridengine.ops.paged_attention import paged_decode_attention_triton
    from hybridengine.kernels import paged_attention as kernels

    dev = torch.device("cuda")
    batch, q_heads, kv_heads, head_dim, context, page = 128, 12, 2, 128, 256, 16
    blocks = batch * context // page
    q = torch.randn(batch, q_heads, head_dim, dtype=torch.bfloat16, device=dev)
    k_cache = torch.randn(blocks, page, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=dev).view(batch, -1).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    for config in CONFIGS:
        paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale=head_dim**-0.5, num_splits=1,
                                      config=config)
    for cache in kernels.paged_decode_kernel.device_caches.values():
        for compiled in cache[0].values():
            ptx = compiled.asm["ptx"]
            print(f"cp.async {ptx.count('cp.async')}, ld.global {ptx.count('ld.global')}, regs {compiled.n_regs}, "
                  f"spills {compiled.n_spills}, shared {compiled.metadata.shared} B, warps "
                  f"{compiled.metadata.num_warps}, stages {compiled.metadata.num_stages}")


if __name__ == "__main__":
    main()
