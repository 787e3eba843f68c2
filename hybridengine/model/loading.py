"""`load_model`: a `CausalLM` from a transformers model, a config (seeded init) or a local safetensors folder.

Every path builds a fresh model (and so a fresh flat buffer), fills it, checks that each parameter
was written exactly once, and only then returns it: a failed load leaves nothing half-loaded behind.

Checkpoint rules (each violation is a ValueError naming the tensor, and the file when there is one):
- every model parameter must be present once, with its exact shape and a floating dtype (it is
  converted to the model dtype), or in pieces that the model family places (`ModelFamily.hf_piece`:
  per-expert weights of a stacked parameter), each exactly once;
- any other tensor is an error, except non-parameter buffers HF used to save (`rotary_emb.inv_freq`)
  and, for tied embeddings, an `lm_head.weight` equal to `model.embed_tokens.weight` after
  conversion (older checkpoints and `state_dict()` of tied HF models carry both). A *different*
  `lm_head.weight` in a tied checkpoint is an error: dropping it silently would change the model.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from collections.abc import Iterator, Mapping

import torch

from hybridengine.model.config import ModelConfig
from hybridengine.model.decoder import CausalLM

INDEX_FILE = "model.safetensors.index.json"
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_TIED_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _is_hf_model(source) -> bool:
    """Whether source is a transformers `PreTrainedModel`, without importing transformers' modeling code
    (seconds per process) when nothing has: a model cannot exist before its module is imported."""
    module = sys.modules.get("transformers.modeling_utils")
    return module is not None and isinstance(source, module.PreTrainedModel)


def hf_config_dict(source) -> dict | None:
    """The transformers config of a source as a dict (what `export_hf` writes), or None for a ModelConfig
    (or a folder transformers cannot read: `load_model` raises the real error)."""
    from transformers import AutoConfig, PretrainedConfig

    if _is_hf_model(source):
        return source.config.to_dict()
    if isinstance(source, PretrainedConfig):
        return source.to_dict()
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        try:
            return AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
        except (OSError, ValueError):
            return None
    return None


def load_model(source, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               seed: int = 0) -> CausalLM:
    """A `CausalLM` with `dtype` weights on `device`, every weight a view of `model.flat_buffer`.

    source: a transformers `PreTrainedModel` (weights copied), a `PretrainedConfig` or `ModelConfig`
    (random init from `seed`, HF style: normal(0, initializer_range) for linear/embedding weights,
    ones for norms, zeros for biases), or a local folder with config.json and *.safetensors (one
    file, or shards listed in model.safetensors.index.json). Never touches the network.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"load_model: dtype must be a floating torch.dtype, got {dtype!r}")
    from transformers import PretrainedConfig

    if _is_hf_model(source):
        model = CausalLM(ModelConfig.from_hf(source.config), dtype=dtype, device=device)
        _fill(model, ((name, t, "the given model's state_dict") for name, t in source.state_dict().items()))
        return model
    if isinstance(source, (PretrainedConfig, ModelConfig)):
        config = source if isinstance(source, ModelConfig) else ModelConfig.from_hf(source)
        model = CausalLM(config, dtype=dtype, device=device)
        _init_weights(model, seed)
        return model
    if isinstance(source, (str, os.PathLike)):
        return _load_folder(Path(source), dtype, device)
    raise TypeError(f"load_model: source must be a PreTrainedModel, PretrainedConfig, ModelConfig or a folder "
                    f"path, got {type(source).__name__}")


@torch.no_grad()
def _init_weights(model: CausalLM, seed: int) -> None:
    # Draw on a CPU generator in fp32, parameter by parameter in buffer order, then convert: the
    # same seed gives the same weights for every dtype and device.
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, view in model.flat_buffer.views().items():
        if name.endswith(".bias"):
            view.zero_()
        elif name.endswith("norm.weight"):
            view.fill_(1.0)
        else:
            view.copy_(torch.empty(view.shape).normal_(0.0, std, generator=gen))


def check_hf_tensor(name: str, item, where: str, shapes: Mapping[str, tuple[int, ...]], *, tied: bool,
                    model_type: str, strict: bool = True) -> str | None:
    """The parameter that the HF-named tensor `item` (a tensor or a safetensors slice, read from its
    header only) is for: `name` itself, or for `lm_head.weight` of a tied model (`tied`) the embedding
    it is tied to. None for a tensor to skip: a saved rotary buffer, or (`strict=False`) a name that is
    not a parameter. A ValueError naming the tensor and `where` for an unknown name (strict), a shape
    other than `shapes[name]`, or a dtype that is not floating."""
    if _IGNORED.search(name):
        return None
    target = _EMBED if name == _TIED_HEAD and tied else name
    if target not in shapes:
        if not strict:
            return None
        raise ValueError(f"unexpected tensor {name!r} in {where}: not a parameter of this {model_type} model")
    shape, dtype, is_float = _header(item)
    expected = tuple(shapes[target])
    if shape != expected:
        raise ValueError(f"tensor {name!r} in {where} has shape {shape}, expected {expected}")
    if not is_float:
        raise ValueError(f"tensor {name!r} in {where} has dtype {dtype}, expected a floating dtype")
    return target


def check_hf_piece(name: str, item, where: str, piece: tuple[str, tuple], views: Mapping[str, torch.Tensor],
                   model_type: str) -> tuple[str, torch.Tensor]:
    """(parameter, the view of its part) that the checkpoint tensor `name` fills (`piece`, from the family's
    `hf_piece`); a ValueError naming the tensor and `where` for a shape other than the part's or a dtype that
    is not floating."""
    target, index = piece
    if target not in views:
        raise ValueError(f"unexpected tensor {name!r} in {where}: {target!r} is not a parameter of this "
                         f"{model_type} model")
    view = views[target][index]
    shape, dtype, is_float = _header(item)
    if shape != tuple(view.shape):
        raise ValueError(f"tensor {name!r} in {where} has shape {shape}, expected {tuple(view.shape)}")
    if not is_float:
        raise ValueError(f"tensor {name!r} in {where} has dtype {dtype}, expected a floating dtype")
    return target, view


def check_tied_head(head: torch.Tensor, embed: torch.Tensor, where: str) -> None:
    """A tied model's `lm_head.weight` must equal its embedding (`embed`, in the model dtype) after conversion."""
    if not torch.equal(head.to(embed.dtype).to(embed.device), embed):
        raise ValueError(f"tensor {_TIED_HEAD!r} in {where} differs from {_EMBED!r}, but the config "
                         f"ties the embeddings (tie_word_embeddings=True)")


@torch.no_grad()
def _fill(model: CausalLM, tensors: Iterator[tuple[str, object, str]]) -> None:
    """Copy (name, tensor-or-safetensors-slice, where) items into the model's buffer views, checking them.

    A slice (from `safe_open.get_slice`) is checked from its header before its data is read.
    """
    views = model.flat_buffer.views()
    shapes = {n: tuple(v.shape) for n, v in views.items()}
    seen: dict[str, str] = {}
    pieces: dict[str, int] = {}  # parameter -> elements written by pieces
    tied_head: tuple[torch.Tensor, str] | None = None
    for name, item, where in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice: in {seen[name]} and in {where}")
        piece = model.family.hf_piece(name, model.config)
        if piece is not None:
            target, view = check_hf_piece(name, item, where, piece, views, model.config.model_type)
            seen[name] = where
            view.copy_(item if isinstance(item, torch.Tensor) else item[:])
            pieces[target] = pieces.get(target, 0) + view.numel()
            continue
        target = check_hf_tensor(name, item, where, shapes, tied=model.config.tie_word_embeddings,
                                 model_type=model.config.model_type)
        if target is None:
            continue
        seen[name] = where
        tensor = item if isinstance(item, torch.Tensor) else item[:]
        if target != name:
            tied_head = (tensor, where)
        else:
            views[name].copy_(tensor)
    both = [n for n in pieces if n in seen]
    if both:
        raise ValueError(f"tensor {both[0]!r} is given whole and in per-expert pieces")
    missing = [n for n in views if n not in seen and pieces.get(n, 0) != views[n].numel()]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"missing tensors: {shown}")
    if tied_head is not None:
        check_tied_head(tied_head[0], views[_EMBED], tied_head[1])


def _header(item) -> tuple[tuple[int, ...], str, bool]:
    """(shape, dtype name, is floating) of a tensor or of a safetensors slice (header only, no data read)."""
    if isinstance(item, torch.Tensor):
        return tuple(item.shape), str(item.dtype), item.dtype.is_floating_point
    st_dtype = item.get_dtype()  # safetensors names: F32, BF16, F8_E4M3, I64, U8, BOOL, ...
    return tuple(item.get_shape()), st_dtype, st_dtype.startswith(("F", "BF"))


def _checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index names, else model.safetensors,
    else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name!r}, which is not in {folder}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        raise ValueError(f"no *.safetensors files in {folder}" + (f" (found {other}: only safetensors "
                         "checkpoints are supported)" if other else ""))
    return files


def _load_folder(folder: Path, dtype: torch.dtype, device) -> CausalLM:
    from safetensors import safe_open
    from transformers import AutoConfig

    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {str(folder)!r} does not exist or is not a directory")
    if not (folder / "config.json").is_file():
        raise ValueError(f"checkpoint folder {str(folder)!r} has no config.json")
    # local_files_only: a folder path must never turn into a hub lookup.
    hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    model = CausalLM(ModelConfig.from_hf(hf_config), dtype=dtype, device=device)
    files = _checkpoint_files(folder)

    def tensors():
        for path in files:  # one file open at a time; each tensor read straight into its view
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_slice(name), f"file {path.name!r}"

    _fill(model, tensors())
    return model
