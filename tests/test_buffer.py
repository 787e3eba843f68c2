import pytest
import torch

from hybridengine import FlatParamBuffer, ShardedLayout
from hybridengine.sharding.layout import param_specs

SHAPES = [("model.embed_tokens.weight", (10, 6)), ("model.layers.0.self_attn.q_proj.weight", (6, 6)),
          ("model.layers.0.input_layernorm.weight", (6,)), ("model.norm.weight", (6,)), ("lm_head.weight", (10, 6))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_share_the_flat_storage(dtype):
    buf = FlatParamBuffer(param_specs(SHAPES), dtype=dtype)
    views = buf.views()
    for name, shape in SHAPES:
        v = views[name]
        assert tuple(v.shape) == shape and v.dtype == dtype
        assert v.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()
        v.fill_(3)
    assert int((buf.data == 3).sum()) == sum(torch.Size(s).numel() for _, s in SHAPES)  # disjoint views
    assert "5 params" in repr(buf)


def test_shard_views_lie_in_data():
    specs = param_specs(SHAPES)
    layout = ShardedLayout(specs, world_size=4, tp_size=2, element_size=4)
    buf = FlatParamBuffer(layout, dtype=torch.float32, rank=3)
    for shard in buf.shard_views():
        assert shard.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()
    assert buf.view("model.embed_tokens.weight").shape == (5, 6)


def test_errors():
    layout = ShardedLayout(param_specs(SHAPES), world_size=2, element_size=4)
    with pytest.raises(ValueError, match="does not match the layout's element_size"):
        FlatParamBuffer(layout, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rank=2 outside world_size=2"):
        FlatParamBuffer(layout, dtype=torch.float32, rank=2)
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype, got str"):
        FlatParamBuffer(layout, dtype="float32")
    with pytest.raises(ValueError, match=r"rank=1.0 outside world_size=2"):
        FlatParamBuffer(layout, dtype=torch.float32, rank=1.0)
    good = torch.zeros(layout.gen_numel)
    assert FlatParamBuffer(layout, dtype=torch.float32, data=good).data is good
    with pytest.raises(ValueError, match=r"FlatParamBuffer: data must have shape \(%d,\)" % layout.gen_numel):
        FlatParamBuffer(layout, dtype=torch.float32, data=torch.zeros(layout.gen_numel + 1))
    with pytest.raises(ValueError, match="FlatParamBuffer: data must be torch.float32, got torch.float64"):
        FlatParamBuffer(layout, dtype=torch.float32, data=torch.zeros(layout.gen_numel, dtype=torch.float64))
    with pytest.raises(ValueError, match="FlatParamBuffer: data must be a torch.Tensor"):
        FlatParamBuffer(layout, dtype=torch.float32, data=[0.0] * layout.gen_numel)
    with pytest.raises(ValueError, match="FlatParamBuffer: data must be contiguous"):
        FlatParamBuffer(layout, dtype=torch.float32, data=torch.zeros(2 * layout.gen_numel)[::2])
