"""Model families: what one architecture declares, in one place.

A `ModelFamily` is the seam between an architecture and the rest of the engine (in the spirit of torchtitan's
per-model `parallelize.py` and `state_dict_adapter.py`):

- its modules: the feed-forward block of each decoder layer (`build_mlp`: a dense SwiGLU `MLP`, or a
  mixture-of-experts block), inside the shared decoder (attention, norms, embedding, LM head);
- its parallel plan (`ParallelPlan`): the role of every parameter (column / row / vocab / expert /
  replicated) and which are cut on whole attention heads, by name; a parameter the plan does not name is an
  error, never silently replicated;
- its transformers names (`hf_piece`): which parameter (and which part of it) a checkpoint tensor fills,
  for checkpoints that store a parameter in pieces (per-expert weights);
- its config translation (`config_from_hf`): the `ModelConfig` fields that depend on the family;
- its forward entry points: the modules' `forward` (dense, [B, T, H]), `forward_flat` (training and the
  rollout's torch path over flat tokens) and `forward_rollout` (the rollout's fused kernels).

The sharding room (layout, weights) and the trainer ask the family (through the plan and its names)
instead of naming transformers parameters. Families register themselves (`register_family`); the
built-in ones live in `hybridengine.model.families`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

ROLES = ("column", "row", "vocab", "expert", "replicated")
"""The parallel roles of a parameter (sharding/layout.py says how each is cut)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def layer_prefix(i: int) -> str:
    """The name prefix of layer i's parameters in the shared decoder (`model.layers.<i>.`)."""
    return f"model.layers.{i}."


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """The parallel role of every parameter of a family, by name.

    The names are those of the shared decoder's module tree: `embed` and `head` by their full names, the
    layers' by their name inside a layer (`self_attn.q_proj.weight` for `model.layers.<i>.self_attn.q_proj.weight`).
    Units (the granule of every collective): 'embed', 'layers.<i>', 'head'."""

    family: str
    """The family's name, for error messages."""
    embed: Mapping[str, str]
    """Full name -> role of the embedding unit's parameters."""
    layer: Mapping[str, str]
    """Name inside a layer -> role."""
    head: Mapping[str, str]
    """Full name -> role of the head unit's parameters (final norm, LM head or value head)."""
    head_granule: frozenset[str] = frozenset()
    """Layer parameters cut on whole attention heads (granule head_dim): q/k/v weights and biases."""

    def __post_init__(self):
        for where in ("embed", "layer", "head"):
            bad = {n: r for n, r in getattr(self, where).items() if r not in ROLES}
            if bad:
                raise ValueError(f"ParallelPlan {self.family!r}: {where} roles {bad} are not among {ROLES}")
        unknown = set(self.head_granule) - set(self.layer)
        if unknown:
            raise ValueError(f"ParallelPlan {self.family!r}: head_granule names {sorted(unknown)} are not layer "
                             "parameters of the plan")

    def resolve(self, name: str) -> tuple[str, str, bool]:
        """(role, unit, cut on whole heads) of parameter `name`; a ValueError for a name the plan does not cover."""
        if m := _LAYER.match(name):
            local = m.group(2)
            if local in self.layer:
                return self.layer[local], f"layers.{int(m.group(1))}", local in self.head_granule
        elif name in self.embed:
            return self.embed[name], "embed", False
        elif name in self.head:
            return self.head[name], "head", False
        raise ValueError(f"parameter {name!r} is not covered by the parallel plan of model family {self.family!r}: "
                         f"declare its role ({', '.join(ROLES)}) in the family's ParallelPlan")


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One architecture's declaration (see the module docstring)."""

    model_type: str
    """The transformers `model_type` this family implements (`ModelConfig.model_type`)."""
    plan: ParallelPlan
    build_mlp: Callable
    """(ModelConfig, layer index) -> the layer's feed-forward module (parameters on the meta device), with
    `forward(x [B, T, H])`, `forward_flat(h [N, H], ops, exact, attn, layer_idx)` and
    `forward_rollout(h, exact, attn, layer_idx)` (the output may be an unrounded fp32 sum in exact mode)."""
    config_from_hf: Callable[[object], dict] = field(default=lambda hf_config: {})
    """transformers config -> the family's `ModelConfig` fields (biases, q/k norm, windows, experts...);
    raises a ValueError for a feature the family does not implement."""
    hf_piece: Callable[[str, object], tuple[str, tuple] | None] = field(default=lambda name, config: None)
    """(transformers tensor name, ModelConfig) -> (parameter name, index into it) for a checkpoint tensor that
    fills part of a parameter (per-expert weights of a stacked parameter); None: the name is the parameter's."""
    hf_split: Callable[[str, object], list[tuple[str, object]] | None] = field(default=lambda name, tensor: None)
    """(parameter name, its full tensor) -> the checkpoint tensors it is saved as (per-expert weights: the
    inverse of `hf_piece`, what transformers' save_pretrained writes); None: saved whole under its name."""
    embed_name: str = "model.embed_tokens.weight"
    norm_name: str = "model.norm.weight"
    lm_head_name: str = "lm_head.weight"
    value_head_name: str = "score.weight"

    def head_name(self, *, tied: bool, value_head: bool) -> str:
        """The parameter the head reads: the value head (critic), the embedding (tied) or the LM head."""
        return self.value_head_name if value_head else self.embed_name if tied else self.lm_head_name


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` the implementation of its `model_type` (a ValueError if another one has it)."""
    if not isinstance(family, ModelFamily):
        raise ValueError(f"register_family: family must be a ModelFamily, got {type(family).__name__}")
    other = _FAMILIES.get(family.model_type)
    if other is not None and other is not family:
        raise ValueError(f"register_family: model_type {family.model_type!r} already has a family")
    _FAMILIES[family.model_type] = family
    return family


def unregister_family(model_type: str) -> None:
    """Forget the family of `model_type` (tests that declare their own)."""
    _FAMILIES.pop(model_type, None)


def supported_model_types() -> tuple[str, ...]:
    _load_builtin()
    return tuple(_FAMILIES)


def family_of(model_type: str) -> ModelFamily:
    """The family of a transformers `model_type`; a ValueError naming the supported ones otherwise."""
    _load_builtin()
    try:
        return _FAMILIES[model_type]
    except (KeyError, TypeError):
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {tuple(_FAMILIES)}") from None


def _load_builtin() -> None:
    # The built-in families import the decoder's modules, which import this registry: they register on
    # first lookup rather than at this module's import.
    import hybridengine.model.families  # noqa: F401
