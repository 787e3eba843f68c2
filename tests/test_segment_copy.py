import pytest
import torch

from hybridengine import ops
from conftest import throws_in_extension
from hybridengine.ops import prepare_table, segment_copy, segment_copy_ref, split_rows, validate_table

pytestmark = pytest.mark.needs_extension


def random_table(numel: int, num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """Cut [0, numel) into num_rows runs and send them to a random permutation of places."""
    cuts = torch.sort(torch.randperm(numel - 1, generator=gen)[: num_rows - 1] + 1).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([numel])])
    lengths = bounds[1:] - bounds[:-1]
    perm = torch.randperm(num_rows, generator=gen)
    dst_starts = torch.cumsum(lengths[perm], 0) - lengths[perm]
    dst = torch.empty(num_rows, dtype=torch.int64)
    dst[perm] = dst_starts
    return torch.stack([bounds[:-1], dst, lengths], 1)


def _values(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(numel, device=device).to(dtype)
    return torch.randint(-100, 100, (numel,), device=device).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
@pytest.mark.parametrize("numel,num_rows", [(1, 1), (7, 3), (1000, 17), (4099, 64)])
def test_matches_reference_exactly(dtype, numel, num_rows):
    gen = torch.Generator().manual_seed(numel * 31 + num_rows)
    table = random_table(numel, num_rows, gen)
    src = _values(numel, dtype, "cpu")
    expected, out = torch.full_like(src, 7), torch.full_like(src, 7)
    segment_copy_ref(src, expected, table)
    segment_copy(src, out, table)
    assert torch.equal(out, expected)
    assert torch.equal(out.sort().values, src.sort().values)  # a permutation: nothing lost or doubled


def test_partial_table_leaves_other_elements():
    src, dst = torch.arange(10.0), torch.full((12,), -1.0)
    segment_copy(src, dst, torch.tensor([[2, 9, 3], [0, 0, 0], [7, 1, 2]]))
    assert dst.tolist() == [-1, 7, 8, -1, -1, -1, -1, -1, -1, 2, 3, 4]


def test_empty_table_is_a_no_op():
    src, dst = torch.arange(4.0), torch.zeros(4)
    segment_copy(src, dst, torch.empty(0, 3, dtype=torch.int64))
    assert torch.equal(dst, torch.zeros(4))


def test_launcher_matches_the_checked_op():
    """launch_segment_copy (asserts only, for callers that built their arguments) copies what segment_copy does."""
    from hybridengine.ops.segment_copy import launch_segment_copy

    table = random_table(1000, 17, torch.Generator().manual_seed(5))
    src = torch.randn(1000)
    a, b = torch.zeros(1000), torch.zeros(1000)
    segment_copy(src, a, table)
    launch_segment_copy(src, b, prepare_table(table, 4, src_numel=1000, dst_numel=1000, max_bytes=64), 1)
    assert torch.equal(a, b)


def test_split_rows_keeps_semantics():
    gen = torch.Generator().manual_seed(3)
    table = random_table(5000, 9, gen)
    split = split_rows(table, 37)
    assert int(split[:, 2].max()) <= 37 and int(split[:, 2].sum()) == 5000
    src = torch.randn(5000)
    a, b = torch.zeros(5000), torch.zeros(5000)
    segment_copy_ref(src, a, table)
    segment_copy(src, b, split)
    assert torch.equal(a, b)


def test_prepare_table_splits_by_bytes():
    table = torch.tensor([[0, 0, 300_000]])
    prepared = prepare_table(table, 2, src_numel=300_000, dst_numel=300_000, max_bytes=4096)
    assert int(prepared[:, 2].max()) == 2048 and int(prepared[:, 2].sum()) == 300_000
    with pytest.raises(ValueError, match="multiple of 16"):
        prepare_table(table, 2, src_numel=300_000, dst_numel=300_000, max_bytes=100)


def test_opcheck():
    table = random_table(257, 5, torch.Generator().manual_seed(1))
    src, dst = torch.randn(257), torch.zeros(257)
    torch.library.opcheck(torch.ops.hybridengine.segment_copy.default, (src, dst, table))


BAD_TABLES = [
    (torch.tensor([[0, 8, 3]]), "out of range"),
    (torch.tensor([[8, 0, 3]]), "out of range"),
    (torch.tensor([[-1, 0, 1]]), "negative"),
    (torch.tensor([[0, 0, -1]]), "negative"),
    (torch.tensor([[0, 0, 4], [4, 3, 2]]), "overlapping"),
]


@throws_in_extension
@pytest.mark.parametrize("table,match", BAD_TABLES)
def test_bad_tables_raise_and_leave_dst(table, match):
    src, dst = torch.arange(10.0), torch.full((10,), -1.0)
    with pytest.raises(ValueError, match=match):
        segment_copy(src, dst, table)
    assert torch.equal(dst, torch.full((10,), -1.0))  # validation happens before any write
    with pytest.raises(ValueError, match=match):
        segment_copy_ref(src, dst, table)
    with pytest.raises(ValueError, match=match):
        validate_table(table, 10, 10)
    with pytest.raises(ValueError, match=match):  # the C++ op checks on its own
        torch.ops.hybridengine.segment_copy(src, dst, table)


@pytest.mark.parametrize("src,dst,table,match", [
    (torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.tensor([[0, 0, 1]]), "dtype mismatch"),
    (torch.zeros(4), torch.zeros(4), torch.tensor([[0, 0, 1]], dtype=torch.int32), "int64"),
    (torch.zeros(4), torch.zeros(4), torch.tensor([0, 0, 1]), r"\[S, 3\]"),
    (torch.zeros(2, 2), torch.zeros(4), torch.tensor([[0, 0, 1]]), "src must be a contiguous 1-D"),
    (torch.zeros(4), torch.zeros(8)[::2], torch.tensor([[0, 0, 1]]), "dst must be a contiguous 1-D"),
    (torch.zeros(4), torch.zeros(4), torch.tensor([[0, 0, 1]], device="meta"), "one device"),
    ([0.0] * 4, torch.zeros(4), torch.tensor([[0, 0, 1]]), "src must be a contiguous 1-D tensor, got list"),
    (torch.zeros(4), torch.zeros(4), [[0, 0, 1]], "table must be an int64 tensor"),
])
def test_bad_arguments(src, dst, table, match):
    with pytest.raises(ValueError, match=match):
        segment_copy(src, dst, table)


@throws_in_extension
def test_max_blocks_argument():
    """max_blocks bounds the CUDA grid; on CPU it changes nothing; negative values are refused by the
    wrapper and the C++ op alike, leaving dst alone."""
    src, dst = torch.arange(10.0), torch.zeros(10)
    table = torch.tensor([[0, 5, 3], [6, 0, 2]])
    segment_copy(src, dst, table, max_blocks=1)
    assert dst.tolist() == [6, 7, 0, 0, 0, 0, 1, 2, 0, 0]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_blocks must be an int >= 0"):
            segment_copy(src, torch.zeros(10), table, max_blocks=bad)
    untouched = torch.zeros(10)
    with pytest.raises(ValueError, match="max_blocks must be >= 0"):
        torch.ops.hybridengine.segment_copy(src, untouched, table, -2)
    assert not untouched.any()


@throws_in_extension
def test_overlapping_src_and_dst_rejected_by_op():
    buf = torch.arange(10.0)
    with pytest.raises(ValueError, match="overlap in memory"):
        torch.ops.hybridengine.segment_copy(buf[:6], buf[4:], torch.tensor([[0, 0, 2]]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("numel,num_rows", [(1, 1), (4099, 64), (3_000_001, 1000)])
def test_cuda_matches_reference(dtype, numel, num_rows):
    assert ops.extension_has("segment_copy", "cuda"), "the CUDA build of the extension lacks segment_copy"
    gen = torch.Generator().manual_seed(numel + num_rows)
    table = random_table(numel, num_rows, gen)
    src = _values(numel, dtype, "cpu")
    expected = torch.full_like(src, 3)
    segment_copy_ref(src, expected, table)
    dev_table = prepare_table(table, src.element_size(), src_numel=numel, dst_numel=numel, device="cuda",
                              max_bytes=4096)
    out = torch.full_like(src, 3, device="cuda")
    segment_copy(src.cuda(), out, dev_table)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected)
    for max_blocks in (1, 3):  # a bounded grid strides over the rows: the same bytes
        out = torch.full_like(src, 3, device="cuda")
        segment_copy(src.cuda(), out, dev_table, max_blocks=max_blocks)
        assert torch.equal(out.cpu(), expected), max_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 1), (3, 5), (8, 0), (1, 2)])
def test_cuda_alignments(src_off, dst_off):
    """Every alignment path: 16-byte vectors with a head, 4-byte, 2-byte and byte words."""
    src = torch.randint(-100, 100, (5000,), dtype=torch.int8)
    table = torch.tensor([[src_off, dst_off, 4000], [4500, 4600, 33]])
    expected, out = torch.zeros(5000, dtype=torch.int8), torch.zeros(5000, dtype=torch.int8, device="cuda")
    segment_copy_ref(src, expected, table)
    segment_copy(src.cuda(), out, table.cuda())
    assert torch.equal(out.cpu(), expected)


@pytest.mark.gpu
def test_cuda_skips_out_of_range_rows():
    """Unvalidated device tables cannot write out of bounds: bad rows are skipped."""
    src, dst = torch.arange(10.0, device="cuda"), torch.full((10,), -1.0, device="cuda")
    segment_copy(src, dst, torch.tensor([[0, 8, 3], [0, 0, 2]], device="cuda"))
    assert dst.tolist() == [0, 1] + [-1] * 8
