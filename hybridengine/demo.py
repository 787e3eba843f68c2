"""The current main job, until the engine lands: what exists today, shown end to end on CPU or GPU.

1. builds the embedded tiny model twice, from the same random weights: transformers' own
   implementation and hybridengine's compact decoder whose weights are views of one flat buffer,
   and compares their logits;
2. lays the model out for N training ranks and TP degree tg, packs every unit natural ->
   slice-major with the fused segment-copy op, unpacks it back and checks the round trip is
   bit-exact, and shows where rank r's training shard sits inside its generation slice;
3. prints `hybridengine info`.
"""

from __future__ import annotations

import time

import torch


def run_demo(config_name: str = "tiny-qwen2", world_size: int = 4, tp_size: int = 2) -> None:
    from transformers import AutoModelForCausalLM

    import hybridengine as he
    from hybridengine.info import info
    from hybridengine.layout import ShardedLayout
    from hybridengine.ops import segment_copy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"[1/3] {config_name}: hybridengine model vs transformers (fp32, {device}, random weights, seed 0)")
    torch.manual_seed(0)
    cfg = he.model_config(config_name)
    hf = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    model = he.load_model(hf, dtype=torch.float32, device=device)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), device=device)
    with torch.no_grad():
        err = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    print(f"      {sum(p.numel() for p in hf.parameters()):,} parameters in {model.flat_buffer}")
    print(f"      max |logits - transformers logits| = {err:.2e} (test bound 1e-4)")
    if err > 1e-4:
        raise SystemExit("demo: logits differ from transformers by more than 1e-4")

    print(f"[2/3] layout for world_size={world_size}, tp_size={tp_size}: pack/unpack with the fused copy")
    buf = model.flat_buffer
    layout = ShardedLayout(buf.layout.specs, world_size=world_size, tp_size=tp_size,
                           element_size=buf.data.element_size())
    m = layout.num_shards
    for unit in layout.units:
        # The single-device buffer holds each unit in natural layout (same offsets as `unit`).
        start = buf.layout.gen_offsets[buf.layout.unit_index[unit.name]]
        natural = buf.data[start:start + unit.natural_numel]
        packed = torch.zeros(unit.numel, dtype=buf.dtype, device=device)
        back = torch.zeros(unit.natural_numel, dtype=buf.dtype, device=device)
        t0 = time.perf_counter()
        segment_copy(natural, packed, unit.pack_table().to(device))
        segment_copy(packed, back, unit.unpack_table().to(device))
        dt = time.perf_counter() - t0
        same = torch.equal(back, natural)
        print(f"      {unit.name:<9} {unit.numel:>8,} elements slice-major, {len(unit.pack_table()):>4} segments, "
              f"round trip {'bit-exact' if same else 'DIFFERS'} ({dt * 1e3:.2f} ms)")
        if not same:
            raise SystemExit(f"demo: round trip of unit {unit.name} is not the identity")
    for r in range(world_size):
        t, j = divmod(r, m)
        print(f"      rank {r}: generates with TP slice {t}; trains shard {j} of it "
              f"({layout.shard_numel:,} elements, all units)")
    print("[3/3] hybridengine info")
    print("      " + info().replace("\n", "\n      "))
