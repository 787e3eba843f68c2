"""Property tests of the slice-major layout over world sizes, TP degrees and awkward shapes."""

import pytest
import torch

from hybridengine import ops
from hybridengine.sharding.layout import ParamSpec, ShardedLayout, param_specs, tp_role, unit_of
from hybridengine.ops import segment_copy_ref

from _models import MODELS, model_specs, reference_tp_slice

pytestmark = pytest.mark.needs_extension


CASES = [(n, tg) for n in (1, 2, 3, 4, 6, 8) for tg in range(1, n + 1) if n % tg == 0]


def unique_natural(unit):
    """Natural buffer whose parameter elements hold unique ids 1..; padding holds -1."""
    buf = torch.full((unit.natural_numel,), -1.0, dtype=torch.float64)
    next_id = 1
    for spec in unit.params:
        off = unit.natural_offsets[spec.name]
        buf[off:off + spec.numel] = torch.arange(next_id, next_id + spec.numel, dtype=torch.float64)
        next_id += spec.numel
    return buf


def pack(unit, natural, op=segment_copy_ref):
    out = torch.zeros(unit.numel, dtype=natural.dtype)
    op(natural, out, unit.pack_table())
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world_size,tp_size", CASES)
def test_every_element_once_per_slice(model, world_size, tp_size):
    layout = ShardedLayout(model_specs(**MODELS[model]), world_size=world_size, tp_size=tp_size)
    for unit in layout.units:
        natural = unique_natural(unit)
        packed = pack(unit, natural)
        assert torch.equal(packed, pack(unit, natural, ops.segment_copy))  # C++ op == reference
        slices = packed.view(tp_size, unit.slice_numel)
        for spec in unit.params:
            off = unit.natural_offsets[spec.name]
            ids = natural[off:off + spec.numel]
            per_slice = [torch.isin(slices[t], ids).sum().item() for t in range(tp_size)]
            if spec.role == "replicated":
                assert per_slice == [spec.numel] * tp_size, spec.name
                for t in range(tp_size):  # each slice holds the whole parameter exactly once
                    found = slices[t][torch.isin(slices[t], ids)]
                    assert torch.equal(found.sort().values, ids), spec.name
            else:
                assert sum(per_slice) == spec.numel, spec.name
                found = packed[torch.isin(packed, ids)]
                assert torch.equal(found.sort().values, ids), spec.name  # each element exactly once


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world_size,tp_size", CASES)
def test_roundtrip_is_identity(model, world_size, tp_size):
    layout = ShardedLayout(model_specs(**MODELS[model]), world_size=world_size, tp_size=tp_size)
    for unit in layout.units:
        natural = unique_natural(unit)
        packed = pack(unit, natural)
        back = torch.full_like(natural, -1.0)
        ops.segment_copy(packed, back, unit.unpack_table())
        assert torch.equal(back, natural)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world_size,tp_size", CASES)
def test_shards_partition_and_lie_in_their_slice(model, world_size, tp_size):
    layout = ShardedLayout(model_specs(**MODELS[model]), world_size=world_size, tp_size=tp_size)
    m = world_size // tp_size
    for unit in layout.units:
        assert unit.shard_numel * m == unit.slice_numel
        covered = torch.zeros(unit.numel, dtype=torch.int32)
        for r in range(world_size):
            start, end = unit.shard_range(r)
            t = r // m
            assert t * unit.slice_numel <= start < end <= (t + 1) * unit.slice_numel
            covered[start:end] += 1
        assert bool((covered == 1).all())
    for r in range(world_size):  # the shard lives inside the rank's generation buffer
        for (g_off, n), unit, gen in zip(layout.shard_in_gen(r), layout.units, layout.gen_offsets):
            assert n == unit.shard_numel and gen <= g_off and g_off + n <= gen + unit.slice_numel


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 4), (8, 4), (6, 3), (3, 3)])
def test_gen_views_are_tp_slices(world_size, tp_size):
    specs = model_specs(**MODELS["odd-hidden"])
    layout = ShardedLayout(specs, world_size=world_size, tp_size=tp_size)
    params = {s.name: torch.randn(s.shape, dtype=torch.float64) for s in specs}
    for t in range(tp_size):
        gen = torch.zeros(layout.gen_numel, dtype=torch.float64)
        for unit, g in zip(layout.units, layout.gen_offsets):
            natural = torch.zeros(unit.natural_numel, dtype=torch.float64)
            for s in unit.params:
                layout.natural_view(natural, s.name).copy_(params[s.name])
            gen[g:g + unit.slice_numel] = pack(unit, natural)[t * unit.slice_numel:(t + 1) * unit.slice_numel]
        for s in specs:
            view = layout.gen_view(gen, s.name)
            expected = reference_tp_slice(params[s.name], s.role, t, tp_size)
            assert torch.equal(view, expected), (s.name, t)
            assert view.data_ptr() >= gen.data_ptr()  # a view, not a copy


def test_tp1_is_natural_layout():
    """With tg = 1 the gathered unit is the natural layout: no permutation, zero-copy."""
    layout = ShardedLayout(model_specs(**MODELS["gqa-untied"]), world_size=4, tp_size=1)
    for unit in layout.units:
        table = unit.pack_table()
        assert torch.equal(table[:, 0], table[:, 1])
        assert int(table[:, 2].sum()) <= unit.natural_numel <= unit.slice_numel


@pytest.mark.parametrize("dtype,align", [(torch.bfloat16, 16), (torch.float32, 2 << 20), (torch.bfloat16, 2 << 20)])
def test_alignment(dtype, align):
    es = torch.empty((), dtype=dtype).element_size()
    layout = ShardedLayout(model_specs(**MODELS["odd-hidden"]), world_size=4, tp_size=2, element_size=es,
                           shard_align_bytes=align)
    for unit in layout.units:
        assert (unit.shard_numel * es) % align == 0
        assert all((p.offset * es) % 16 == 0 for p in unit.pieces)
        assert all((o * es) % 16 == 0 for o in unit.natural_offsets.values())


def test_roles_and_units():
    assert tp_role("model.layers.3.self_attn.q_proj.weight") == "column"
    assert tp_role("model.layers.3.self_attn.k_proj.bias") == "column"
    assert tp_role("model.layers.0.mlp.down_proj.weight") == "row"
    assert tp_role("model.layers.0.self_attn.o_proj.weight") == "row"
    assert tp_role("model.embed_tokens.weight") == tp_role("lm_head.weight") == "vocab"
    assert tp_role("model.layers.0.self_attn.q_norm.weight") == "replicated"
    assert tp_role("model.norm.weight") == "replicated"
    assert unit_of("model.layers.11.mlp.up_proj.weight") == "layers.11"
    assert unit_of("model.embed_tokens.weight") == "embed"
    assert unit_of("lm_head.weight") == unit_of("model.norm.weight") == "head"


def test_errors():
    specs = model_specs(**MODELS["odd-hidden"])
    with pytest.raises(ValueError, match="tp_size=3 must divide world_size=4"):
        ShardedLayout(specs, world_size=4, tp_size=3)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ShardedLayout(specs, world_size=0)
    with pytest.raises(ValueError, match="not a multiple of element_size"):
        ShardedLayout(specs, element_size=4, align_bytes=6)
    with pytest.raises(ValueError, match="duplicate parameter names"):
        ShardedLayout(specs + specs[:1])
    # 24 heads of head_dim 3 cannot split 5 ways; a row-parallel dim that tg does not divide.
    with pytest.raises(ValueError, match=r"q_proj.weight.*column-parallel.*tp_size=5"):
        ShardedLayout(specs, world_size=5, tp_size=5)
    with pytest.raises(ValueError, match=r"row-parallel.*tp_size=2"):
        ShardedLayout([ParamSpec("x.down_proj.weight", (4, 5), "row", "layers.0")], world_size=2, tp_size=2)
    # whole heads only: k_proj has 2 heads of 4, so tg = 4 would split a head even though 8 % 4 == 0
    gqa = param_specs([("model.layers.0.self_attn.k_proj.weight", (8, 16))], head_dim=4)
    with pytest.raises(ValueError, match="whole granules"):
        ShardedLayout(gqa, world_size=4, tp_size=4)
    with pytest.raises(ValueError, match="role 'diagonal'"):
        ParamSpec("w", (2, 2), "diagonal", "head")
    with pytest.raises(ValueError, match=r"shape must be a non-empty tuple of ints, got \[2, 2\]"):
        ParamSpec("w", [2, 2], "replicated", "head")
    with pytest.raises(ValueError, match="shape must be a non-empty tuple of ints"):
        ParamSpec("w", (2.0,), "replicated", "head")
    with pytest.raises(ValueError, match="granule must be an int >= 1, got 0"):
        ParamSpec("w", (2, 2), "column", "head", 0)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        ParamSpec("", (2,), "replicated", "head")
    with pytest.raises(ValueError, match=r"tp_size must be >= 1 \(an int\), got 1.0"):
        ShardedLayout(specs, tp_size=1.0)
    with pytest.raises(ValueError, match="specs must be ParamSpec"):
        ShardedLayout([("model.norm.weight", (4,))])
    with pytest.raises(KeyError, match="not in this layout"):
        ShardedLayout(specs).gen_view(torch.zeros(1), "nope")
