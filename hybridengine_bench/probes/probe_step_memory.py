"""Probe: where a training step's device memory goes, per offload mode.

    python -m hybridengine_bench.probes.probe_step_memory [--model qwen2-7b] [--modes none optimizer]
                                      [--tokens 8192 16384] [--reps 3] [--sync-after-forward]
    (CUDA; on CPU the tiny model, a harness check: the memory figures read 0 there)

One engine per mode (`EngineConfig.offload`), one warm-up `ppo_step` (the optimizer state exists), then
`--reps` consecutive steps per token count (sequences of 1,024 tokens, one micro-batch, no activation
checkpointing: the `offload_optimizer` ladder's step). Each step prints one JSON line: torch's allocated
and peak memory (GiB) at the start, at the ends of the forward, of the micro-batch (backward included),
of the optimizer step, and at the end, plus the largest allocation seen at a unit's gradient reduce.
These are host-side readings: the caching allocator counts a tensor when the host queues its producer,
so nothing here waits for the device, unless `--sync-after-forward` (which tells whether the host
running ahead of the device changes the peak).

The question it answers: the ladder's peaks in "optimizer" mode sit about 25 GiB above the activations
and gradients it should hold, while a single step per count measured with a sync after the forward did
not (docs/memory.md).
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

GIB = 2**30
MARKS = (("gathered_model", "GatheredModel", "forward_layers_with_graphs", "forward"),
         ("trainer", "Trainer", "_micro_step", "micro_batch"),
         ("trainer", "Trainer", "_clip_and_step", "optimizer_step"))
"""(module, class, method, label): the step's phases whose ends are marked."""


def _reading(cuda: bool) -> tuple[float, float]:
    if not cuda:
        return 0.0, 0.0
    return torch.cuda.memory_allocated() / GIB, torch.cuda.max_memory_allocated() / GIB


class _Marks:
    """Wraps the phases of MARKS (and the trainer's `_reduce`) to read the allocator at their ends;
    `restore()` puts the originals back."""

    def __init__(self, cuda: bool, sync_after_forward: bool):
        from hybridengine.train import trainer

        self.cuda, self.sync = cuda, sync_after_forward
        self.trace: list[tuple[str, float, float]] = []
        self.reduce_peak = 0.0
        self._saved = []
        for module, cls_name, method, label in MARKS:
            self._wrap(getattr(importlib.import_module(f"hybridengine.train.{module}"), cls_name), method, label)
        cls = trainer.Trainer
        real_reduce = cls._reduce

        def reduce(inner, *args, **kwargs):
            self.reduce_peak = max(self.reduce_peak, _reading(self.cuda)[0])
            return real_reduce(inner, *args, **kwargs)

        self._saved.append((cls, "_reduce", real_reduce))
        cls._reduce = reduce

    def _wrap(self, cls, method: str, label: str) -> None:
        real = getattr(cls, method)

        def marked(inner, *args, **kwargs):
            out = real(inner, *args, **kwargs)
            if self.sync and label == "forward" and self.cuda:
                torch.cuda.synchronize()
            self.mark(label)
            return out

        self._saved.append((cls, method, real))
        setattr(cls, method, marked)

    def mark(self, label: str) -> None:
        allocated, peak = _reading(self.cuda)
        self.trace.append((label, round(allocated, 2), round(peak, 2)))

    def restore(self) -> None:
        for cls, method, real in reversed(self._saved):
            setattr(cls, method, real)
        self._saved.clear()


def run(model: str, modes: list[str], token_counts: list[int], reps: int, sync_after_forward: bool) -> list[dict]:
    import hybridengine as he
    from hybridengine_bench.offload import _batch

    cuda = torch.cuda.is_available()
    seq = 1024 if cuda else 16
    rows = []
    for mode in modes:
        engine = he.HybridEngine(he.model_config(model), he.EngineConfig(
            dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu", offload=mode,
            gpu_memory_utilization=0.9))

        def step(tokens: int) -> None:
            batch = _batch(engine.vocab_size, [seq] * max(1, tokens // seq), 3)
            engine.ppo_step(batch, he.PPOConfig(lr=1e-6, max_grad_norm=1.0, micro_batch_tokens=tokens,
                                                activation_checkpointing=False))

        step(2 * seq)  # the optimizer state exists from here
        marks = _Marks(cuda, sync_after_forward)
        try:
            for tokens in token_counts:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                for rep in range(reps):
                    marks.trace.clear()
                    marks.reduce_peak = 0.0
                    marks.mark("start")
                    error = None
                    try:
                        step(tokens)
                    except torch.OutOfMemoryError as e:
                        error = str(e).splitlines()[0][:300]
                    marks.mark("end")
                    row = dict(model=model, mode=mode, tokens=tokens, rep=rep, sync_after_forward=sync_after_forward,
                               ok=error is None, error=error, trace=list(marks.trace),
                               reduce_max_allocated_GiB=round(marks.reduce_peak, 2))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    if error is not None:
                        break
        finally:
            marks.restore()
        del engine
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-7b" if cuda else "tiny-qwen2")
    parser.add_argument("--modes", nargs="+", default=["none", "optimizer"], choices=["none", "rollout", "optimizer"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192, 16384] if cuda else [32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sync-after-forward", action="store_true")
    args = parser.parse_args(argv)
    return run(args.model, args.modes, args.tokens, args.reps, args.sync_after_forward)


if __name__ == "__main__":
    main()
