"""FlatParamBuffer: one flat tensor per rank that every model weight is a view of."""

from __future__ import annotations

import torch

from hybridengine.checks import describe, tensor
from hybridengine.sharding.layout import ParamSpec, ShardedLayout


class FlatParamBuffer:
    """A rank's generation buffer G: TP slice `tp_rank` of every unit, in slice-major order.

    On a single device (world_size = tp_size = 1) G is the whole model and every view is the full
    parameter in natural layout. Sharded, `data` is the memory of a `ShardedBuffer` (its
    `flat_buffer`), and the rank's training shard of each unit lives permanently inside G
    (`shard_views`). Padding elements are zero and stay zero.
    """

    def __init__(self, specs: list[ParamSpec] | ShardedLayout, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", rank: int = 0, shard_align_bytes: int = 16,
                 data: torch.Tensor | None = None):
        """`specs`: the parameters (laid out for one rank) or a layout. `data`: an existing generation
        buffer to view (a ShardedBuffer's G) instead of a new one."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"FlatParamBuffer: dtype must be a floating torch.dtype, got {describe(dtype)}")
        if isinstance(specs, ShardedLayout):
            self.layout = specs
        else:
            self.layout = ShardedLayout(list(specs), element_size=torch.empty((), dtype=dtype).element_size(),
                                        shard_align_bytes=shard_align_bytes)
        if self.layout.element_size != torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"FlatParamBuffer: dtype {dtype} does not match the layout's element_size "
                             f"{self.layout.element_size}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.layout.world_size:
            raise ValueError(f"FlatParamBuffer: rank={rank!r} outside world_size={self.layout.world_size}")
        self.rank = rank
        if data is None:
            data = torch.zeros(self.layout.gen_numel, dtype=dtype, device=device)
        else:
            tensor("FlatParamBuffer", "data", data, shape=(self.layout.gen_numel,), dtypes=(dtype,))
            if not data.is_contiguous():
                raise ValueError(f"FlatParamBuffer: data must be contiguous, got strides {data.stride()}")
        self.data = data

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.layout.specs]

    def view(self, name: str) -> torch.Tensor:
        """The tensor (a view of `data`) that holds this rank's slice of parameter `name`."""
        return self.layout.gen_view(self.data, name)

    def views(self) -> dict[str, torch.Tensor]:
        return {name: self.view(name) for name in self.names}

    def shard_views(self) -> list[torch.Tensor]:
        """This rank's training shard of each unit, as views of `data`."""
        return [self.data[o:o + n] for o, n in self.layout.shard_in_gen(self.rank)]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __repr__(self) -> str:
        lay = self.layout
        return (f"FlatParamBuffer({len(lay.specs)} params in {len(lay.units)} units, {self.data.numel():,} "
                f"elements {self.dtype} on {self.device}, world_size={lay.world_size}, tp_size={lay.tp_size})")
