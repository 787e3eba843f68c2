"""copy_2d (2-D runs, cudaMemcpy2DAsync on CUDA) against segment_copy's reference: exact equality."""

import pytest
import torch

from hybridengine import ops
from hybridengine.ops import (copy_2d, copy_2d_ref, prepare_runs, runs_from_table, segment_copy_ref,
                              table_from_runs)
from conftest import throws_in_extension
from test_segment_copy import _values, random_table

pytestmark = pytest.mark.skipif(ops.EXTENSION_ERROR is not None, reason="hybridengine._C is not built")


def strided_table(rows: int, width: int, src_pitch: int, dst_pitch: int, src0: int = 0, dst0: int = 0):
    return torch.tensor([[src0 + i * src_pitch, dst0 + i * dst_pitch, width] for i in range(rows)])


def _layout_tables():
    """Unpack and pack tables of real resharding layouts: tiny odd-sized models, tg 2 and 3."""
    from hybridengine.sharding.layout import ShardedLayout
    from test_sharded import MODELS, model_specs

    for name, tp in (("odd-hidden", 3), ("gqa-untied", 2), ("tied-no-bias", 2)):
        specs = model_specs(**MODELS[name])
        layout = ShardedLayout(specs, world_size=tp, tp_size=tp, element_size=4)
        for unit in layout.units:
            yield f"{name}-tg{tp}-{unit.name}-unpack", unit.unpack_table(), unit.numel, unit.natural_numel
            yield f"{name}-tg{tp}-{unit.name}-pack", unit.pack_table(), unit.natural_numel, unit.numel


LAYOUT_TABLES = list(_layout_tables())


def test_runs_group_strided_rows():
    table = torch.cat([strided_table(5, 3, 4, 7), strided_table(2, 6, 6, 6, src0=100, dst0=200),
                       torch.tensor([[50, 60, 2]])])
    runs = runs_from_table(table)
    assert runs.tolist() == [[0, 0, 3, 5, 4, 7], [100, 200, 6, 2, 6, 6], [50, 60, 2, 1, 2, 2]]
    assert torch.equal(table_from_runs(runs), table)


def test_rows_that_would_overlap_as_a_run_stay_apart():
    """A step smaller than the width (or backwards) cannot be a pitch: those rows stay separate runs."""
    table = torch.tensor([[0, 10, 4], [2, 20, 4], [20, 0, 4], [10, 5, 4]])
    runs = runs_from_table(table)
    assert runs[:, 3].max() == 1 and len(runs) == 4
    assert torch.equal(table_from_runs(runs), table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("numel,num_rows", [(1, 1), (7, 3), (4099, 64)])
def test_random_tables_match_segment_copy(dtype, numel, num_rows):
    table = random_table(numel, num_rows, torch.Generator().manual_seed(numel + num_rows))
    src = _values(numel, dtype, "cpu")
    expected, out, ref = (torch.full_like(src, 7) for _ in range(3))
    segment_copy_ref(src, expected, table)
    runs = prepare_runs(table, src_numel=numel, dst_numel=numel)
    copy_2d(src, out, runs)
    copy_2d_ref(src, ref, runs)
    assert torch.equal(out, expected) and torch.equal(ref, expected)


@pytest.mark.parametrize("case", LAYOUT_TABLES, ids=[c[0] for c in LAYOUT_TABLES])
def test_layout_tables_match_segment_copy(case):
    """Every real pack/unpack table: the runs cover the same rows and copy the same bytes; a row-parallel
    weight's slice collapses into one run."""
    _, table, src_n, dst_n = case
    runs = prepare_runs(table, src_numel=src_n, dst_numel=dst_n)
    assert sorted(table_from_runs(runs).tolist()) == sorted(ops.split_rows(table, 1 << 40).tolist())
    assert len(runs) <= len(table)
    src = torch.randn(src_n, dtype=torch.float64)
    expected, out = torch.full((dst_n,), -1.0, dtype=torch.float64), torch.full((dst_n,), -1.0, dtype=torch.float64)
    segment_copy_ref(src, expected, table)
    copy_2d(src, out, runs)
    assert torch.equal(out, expected)


def test_row_parallel_layout_is_few_runs():
    from hybridengine.sharding.layout import ShardedLayout
    from test_sharded import MODELS, model_specs

    layout = ShardedLayout(model_specs(**MODELS["gqa-untied"]), world_size=2, tp_size=2, element_size=4)
    unit = next(u for u in layout.units if u.name.startswith("layers."))
    table = unit.unpack_table()
    runs = runs_from_table(table)
    assert len(table) > 4 * len(runs), (len(table), len(runs))  # one run per (slice, param) group, not per row


BAD_RUNS = [
    ([[0, 0, 3, 4, 3, 3]], "reads past src"),  # 12 elements from a 10-element src
    ([[0, 0, 3, 4, 2, 2]], "smaller than its width"),
    ([[0, 6, 2, 3, 2, 2]], "writes past dst"),
    ([[0, -1, 2, 1, 2, 2]], "negative"),
    ([[0, 0, 2, 1, 2, 2], [0, 0, 3, 4, 3, 3]], "run 1 reads past src"),  # a bad later run: nothing copied
]


@pytest.mark.parametrize("runs,match", BAD_RUNS)
def test_bad_runs_raise_and_leave_dst(runs, match):
    src, dst = torch.arange(10.0), torch.full((10,), -1.0)
    for copy in (copy_2d, copy_2d_ref):
        with pytest.raises(ValueError, match=match):
            copy(src, dst, torch.tensor(runs))
        assert torch.equal(dst, torch.full((10,), -1.0))  # checked before any write


@throws_in_extension
@pytest.mark.parametrize("runs,match", BAD_RUNS)
def test_bad_runs_rejected_by_op(runs, match):
    """The C++ op checks on its own, before copying anything."""
    src, dst = torch.arange(10.0), torch.full((10,), -1.0)
    with pytest.raises(ValueError, match=match):
        torch.ops.hybridengine.copy_2d(src, dst, torch.tensor(runs))
    assert torch.equal(dst, torch.full((10,), -1.0))


@pytest.mark.parametrize("src,dst,runs,match", [
    (torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.tensor([[0, 0, 1, 1, 1, 1]]), "dtype mismatch"),
    (torch.zeros(4), torch.zeros(4), torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.int32), "int64 CPU tensor"),
    (torch.zeros(4), torch.zeros(4), torch.tensor([[0, 0, 1]]), r"\[R, 6\]"),
    (torch.zeros(2, 2), torch.zeros(4), torch.tensor([[0, 0, 1, 1, 1, 1]]), "src must be a contiguous 1-D"),
    (torch.zeros(4), torch.zeros(8)[::2], torch.tensor([[0, 0, 1, 1, 1, 1]]), "dst must be a contiguous 1-D"),
])
def test_bad_arguments(src, dst, runs, match):
    with pytest.raises(ValueError, match=match):
        copy_2d(src, dst, runs)


@throws_in_extension
def test_overlapping_src_and_dst_rejected_by_op():
    buf = torch.arange(10.0)
    with pytest.raises(ValueError, match="overlap in memory"):
        torch.ops.hybridengine.copy_2d(buf[:6], buf[4:], torch.tensor([[0, 0, 2, 1, 2, 2]]))


def test_opcheck():
    runs = prepare_runs(random_table(257, 5, torch.Generator().manual_seed(1)), src_numel=257, dst_numel=257)
    torch.library.opcheck(torch.ops.hybridengine.copy_2d.default, (torch.randn(257), torch.zeros(257), runs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_cuda_matches_reference(dtype):
    assert ops.extension_has("copy_2d", "cuda"), "the CUDA build of the extension lacks copy_2d"
    for name, table, src_n, dst_n in LAYOUT_TABLES + [("random", random_table(3_000_001, 1000, torch.Generator()
                                                                              .manual_seed(2)), 3_000_001, 3_000_001)]:
        src = _values(src_n, dtype, "cpu")
        expected = torch.full((dst_n,), 3, dtype=dtype)
        segment_copy_ref(src, expected, table)
        out = torch.full((dst_n,), 3, dtype=dtype, device="cuda")
        copy_2d(src.cuda(), out, prepare_runs(table, src_numel=src_n, dst_numel=dst_n))
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected), name


@pytest.mark.gpu
def test_cuda_copy_is_stream_ordered():
    """The copies run on the current stream: a side stream's copy after a fill on it sees the fill."""
    src = torch.zeros(1 << 22, device="cuda")
    dst = torch.full((1 << 22,), -1.0, device="cuda")
    runs = torch.tensor([[0, 0, 1 << 10, 1 << 12, 1 << 10, 1 << 10]])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        src.fill_(5.0)
        copy_2d(src, dst, runs)
    torch.cuda.current_stream().wait_stream(side)
    assert bool((dst == 5.0).all())
