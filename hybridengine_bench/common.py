"""What every bench shares: the row writer, timing with quantiles, peak memory, the workload."""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import json
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "hybridengine_bench" / "results" / "results.jsonl"
FIELDS = ("run_id", "time", "commit", "gpu", "num_gpus", "torch", "bench", "provider", "model", "case",
          "metric", "value", "p20", "p80", "versions")
METRICS = ("seconds", "tokens_per_s", "GB_per_s", "busbw_GB_per_s", "TFLOP_per_s", "peak_GiB", "nats", "fraction",
           "GiB", "tokens", "ratio", "not_run")
"""`ratio`: one measurement over another of the same run (or over its floor); case.to names the denominator."""
MiB = 2**20
GiB = 2**30


def new_run_id() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + secrets.token_hex(2)


def commit() -> str:
    """$HE_COMMIT when set (for a copy of the tree without .git, or with a stale one), else HEAD of the
    checkout (with `-dirty` when tracked files differ)."""
    if os.environ.get("HE_COMMIT"):
        return os.environ["HE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    out = {p: _version(p) for p in ("triton", "transformers", "deepspeed")}
    out["cuda"] = torch.version.cuda
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no NVIDIA driver (CPU machine): the field stays null
        out["driver"] = None
    return out


def append_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Appends a probe's rows (free-form dicts, not the bench schema) to a JSONL file and says where."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"rows -> {path}")


@dataclass(kw_only=True, slots=True)
class Recorder:
    """Appends rows to a JSONL file; only rank 0 writes (`path=None` elsewhere)."""

    path: Path | None
    run_id: str
    gpu: str
    num_gpus: int
    commit: str = field(default_factory=commit)
    versions: dict = field(default_factory=versions)
    rows: list[dict] = field(default_factory=list)

    def add(self, bench: str, provider: str, model: str | None, case: dict, metric: str,
            samples: list[float] | float) -> dict:
        """One row; a list of samples gives the median as value and its p20/p80."""
        if metric not in METRICS:
            raise ValueError(f"metric {metric!r} is not one of {METRICS}")
        if isinstance(samples, list):
            p20, value, p80 = quantiles(samples)
        else:
            p20, value, p80 = None, samples, None
        row = dict(run_id=self.run_id, time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   commit=self.commit, gpu=self.gpu, num_gpus=self.num_gpus, torch=torch.__version__,
                   bench=bench, provider=provider, model=model, case=case, metric=metric, value=value,
                   p20=p20, p80=p80, versions=self.versions)
        self.rows.append(row)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    def not_run(self, bench: str, provider: str, model: str | None, reason: str, **case) -> None:
        """A measurement that could not be taken: value null, the reason in case.reason."""
        self.add(bench, provider, model, {**case, "reason": reason}, "not_run", None)


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(p20, median, p80), linear interpolation."""
    if not xs:
        raise ValueError("quantiles: no samples")
    q = torch.tensor(xs, dtype=torch.float64).quantile(torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64))
    return tuple(float(v) for v in q)


@dataclass(kw_only=True, slots=True, frozen=True)
class Workload:
    """Per-GPU generation and training shapes (issue 3: 64 prompts x 128 new tokens; 4 x 1024 tokens)."""

    batch: int
    prompt: int
    new_tokens: int
    train_batch: int
    train_seq: int


GPU_WORKLOAD = Workload(batch=64, prompt=128, new_tokens=128, train_batch=4, train_seq=1024)
CPU_WORKLOAD = Workload(batch=4, prompt=16, new_tokens=8, train_batch=2, train_seq=32)


@dataclass(kw_only=True, slots=True)
class Ctx:
    """One process's view of a run: device, rank, world, the recorder and the repeat scale."""

    rec: Recorder
    device: torch.device
    rank: int
    world: int
    models: list[str]
    scale: float = 1.0
    """Multiplies every repeat count (0.3 for a quick pass)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def work(self) -> Workload:
        return GPU_WORKLOAD if self.cuda else CPU_WORKLOAD

    def reps(self, n: int) -> int:
        return max(1, round(n * self.scale))

    def log(self, msg: str) -> None:
        if self.rank == 0:
            tqdm.write(msg)

    def sync(self, *, device_wide: bool = True) -> None:
        """Wait for the GPU (every stream; with `device_wide=False` only the current stream, which is what a
        caller reading a call's result waits for, so side-stream copies run on), then for the other ranks."""
        if self.cuda:
            if device_wide:
                torch.cuda.synchronize(self.device)
            else:
                torch.cuda.current_stream(self.device).synchronize()
        if self.world > 1:
            dist.barrier()

    def slowest(self, xs: list[float]) -> list[float]:
        """Elementwise max over ranks: a step is as slow as its slowest rank."""
        if self.world == 1:
            return xs
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def timed(self, fn) -> float:
        """Seconds of one call of fn, after a barrier: CUDA events on GPU, perf_counter on CPU."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def measure(self, fn, *, warmup: int, repeats: int, desc: str) -> list[float]:
        """Seconds per call over `repeats` calls (scaled) after `warmup`, slowest rank per call."""
        for _ in range(warmup):
            fn()
        bar = tqdm(range(self.reps(repeats)), desc=desc, disable=self.rank != 0, mininterval=5, leave=False)
        times = [self.timed(fn) for _ in bar]
        return self.slowest(times)

    def peak(self) -> "PeakMemory":
        return PeakMemory(self)

    def record_peak(self, pm: "PeakMemory", bench: str, provider: str, model: str | None, case: dict) -> None:
        """Two rows: torch's allocator peak and NVML's device-used peak (max over ranks)."""
        if not self.cuda:
            return
        self.rec.add(bench, provider, model, {**case, "source": "torch"}, "peak_GiB", pm.torch_gib)
        self.rec.add(bench, provider, model, {**case, "source": "nvml", "scope": "device_used"}, "peak_GiB",
                     pm.nvml_gib)


def graph_seconds(fn, *, calls: int = 1, warmup: int = 3, replays: int = 15, before_replay=None) -> list[float]:
    """Seconds per call of `fn` (CUDA): `warmup` eager calls on a side stream, then `calls` calls captured back
    to back in one CUDA graph; each of 3 untimed and `replays` timed replays is preceded by `before_replay`
    (e.g. a barrier across ranks) and a device sync, and timed with CUDA events. The probes' timer: no launch
    overhead between the calls, as in a captured decode step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for i in range(replays + 3):
        if before_replay is not None:
            before_replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3 / calls)
    graph.reset()
    return times


class PeakMemory:
    """Peak GPU memory of a region, max over ranks.

    torch: `max_memory_allocated` (tensors only). nvml: the device's used memory as the driver
    reports it, sampled by a thread every 20 ms: the CUDA context, allocator cache, NCCL buffers and
    mapped pages count. Each rank owns its GPU, so device-used is that process's footprint. Memory
    the caching allocator reserved stays reserved inside the region, so a slow sampler misses little,
    and it keeps the GIL away from host-bound loops such as HF generate.
    """

    def __init__(self, ctx: Ctx):
        self.ctx, self.torch_gib, self.nvml_gib = ctx, 0.0, 0.0
        self._stop = threading.Event()
        self._nvml_peak = 0

    def __enter__(self) -> "PeakMemory":
        release_memory()
        if self.ctx.cuda:
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
            self._handle = _nvml_handle(self.ctx.device)
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import pynvml

        while True:
            self._nvml_peak = max(self._nvml_peak, pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            if self._stop.wait(0.02):
                return

    def __exit__(self, *exc) -> None:
        if not self.ctx.cuda:
            return
        torch.cuda.synchronize(self.ctx.device)
        self._stop.set()
        self._thread.join()
        peaks = [torch.cuda.max_memory_allocated(self.ctx.device) / GiB, self._nvml_peak / GiB]
        if exc[0] is None:  # a failing rank must not enter a collective its peer may never reach
            peaks = self.ctx.slowest(peaks)
        self.torch_gib, self.nvml_gib = peaks


def nvml_used_gib(ctx: Ctx) -> float:
    """The device's used memory now (NVML; max over ranks), after emptying torch's cache: the baseline a
    region's NVML peak adds to (CUDA context, NCCL communicators, loaded kernels). 0 without CUDA."""
    if not ctx.cuda:
        return 0.0
    import pynvml

    release_memory()
    torch.cuda.synchronize(ctx.device)
    return ctx.slowest([pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(ctx.device)).used / GiB])[0]


def _nvml_handle(device: torch.device):
    """The NVML handle of a CUDA device, matched by PCI bus id (NVML and CUDA orders can differ)."""
    import pynvml

    pynvml.nvmlInit()
    props = torch.cuda.get_device_properties(device)
    try:
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId_v2(bus)
    except (AttributeError, pynvml.NVMLError):  # older torch: no PCI ids; same order without CUDA_VISIBLE_DEVICES
        return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_ids(ctx: Ctx, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(ctx.device)


def generate(model, ctx: Ctx, ids: torch.Tensor, new_tokens: int, **kwargs) -> None:
    """HF generate of exactly `new_tokens` greedy tokens for every prompt (no EOS stop)."""
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         **kwargs)
    if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected "
                           f"{(ids.shape[0], ids.shape[1] + new_tokens)}")


def record_generate(ctx: Ctx, provider: str, model: str, times: list[float], pm: PeakMemory, **case) -> None:
    """Rows of one generation measurement: seconds per generate call, total tok/s over all GPUs, peaks."""
    w = ctx.work
    case = dict(batch_per_gpu=w.batch, prompt=w.prompt, new_tokens=w.new_tokens, **case)
    ctx.rec.add("generate", provider, model, case, "seconds", times)
    ctx.rec.add("generate", provider, model, case, "tokens_per_s",
                [ctx.world * w.batch * w.new_tokens / t for t in times])
    ctx.record_peak(pm, "generate", provider, model, case)
    ctx.log(f"  generate {provider} {model} {case}: {quantiles(times)[1]:.2f} s/call, "
            f"{ctx.world * w.batch * w.new_tokens / quantiles(times)[1]:,.0f} tok/s, peak {pm.torch_gib:.1f} GiB")


def record_train(ctx: Ctx, provider: str, model: str, times: list[float], pm: PeakMemory,
                 buffer_gib: float | None = None, **case) -> None:
    """`buffer_gib`: memory a provider holds outside torch's allocator (hybridengine's parameter buffer is
    driver-mapped pages), recorded as a third peak row, source "torch+buffer" = the torch peak plus it,
    the figure to set against a peer's torch peak."""
    w = ctx.work
    case = dict(batch_per_gpu=w.train_batch, seq=w.train_seq, **case)
    ctx.rec.add("train_step", provider, model, case, "seconds", times)
    ctx.rec.add("train_step", provider, model, case, "tokens_per_s",
                [ctx.world * w.train_batch * w.train_seq / t for t in times])
    ctx.record_peak(pm, "train_step", provider, model, case)
    if buffer_gib is not None and ctx.cuda:
        ctx.rec.add("train_step", provider, model, {**case, "source": "torch+buffer"}, "peak_GiB",
                    pm.torch_gib + buffer_gib)
    ctx.log(f"  train_step {provider} {model}: {quantiles(times)[1]:.3f} s, peak {pm.torch_gib:.1f} GiB")
