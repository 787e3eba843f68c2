"""The model runner of rollout: batch preparation, one model step over the paged KV cache, CUDA graphs.

Block bookkeeping stays in plain Python (scheduler.py, block_manager.py); tensors appear only here,
where a batch is turned into flat token ids, positions, slot mappings and block tables.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from hybridengine.model.decoder import Kernels
from hybridengine.ops.exact_attention import exact_attention, exact_decode_attention
from hybridengine.ops.kv_store import rope_store_kv, store_kv
from hybridengine.ops.paged_attention import paged_decode_attention
from hybridengine.ops.prefill_attention import prefill_attention
from hybridengine.rollout.kv_cache import KVCache
from hybridengine.rollout.routing import RoutingRecord
from hybridengine.rollout.scheduler import Batch
from hybridengine.rollout.sequence import PLACEHOLDER, Sequence


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every CUDA graph capture on `device` runs on, one for the process (as torch.cuda.graph
    keeps one): torch keeps a cuBLAS workspace per stream that has run a GEMM until the process ends, so a
    new stream per rollout would add one (tens of MiB) at every rollout."""
    key = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(key)
    return _CAPTURE_STREAMS[key]


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer of one step needs; `attend` is what the model calls, and `kernels`
    tells the model which layer implementation runs over the paged cache."""

    kv: KVCache
    is_prefill: bool
    slot_mapping: torch.Tensor
    scale: float
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    cu_seqlens_k: torch.Tensor | None = None
    """Prefill with cached prefixes: sequence b's keys are rows cu_seqlens_k[b] .. cu_seqlens_k[b+1] of its
    whole context (None: the keys are the queries' own tokens, cu_seqlens)."""
    max_seqlen_k: int | None = None
    """The longest context of a prefill with cached prefixes (None: max_seqlen)."""
    key_slots: torch.Tensor | None = None
    """Prefill with cached prefixes: the cache slots of every key (int64 [cu_seqlens_k[-1]]), read back after
    the step's own K/V are stored, so a prefix cached by a sequence of the same step is read once written."""
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    fused: bool = False
    """The layers run the rollout's fused kernels (`Kernels.ROLLOUT`, hybridengine.ops; the runner
    sets it on CUDA) instead of the module code (`Kernels.TORCH`)."""
    exact: bool = False
    """Exact mode (EngineConfig.exact_logprobs): `linear_exact` projections and the exact attention ops,
    whose per-token bits do not depend on the batch (the training forward computes the same)."""
    routing: RoutingRecord | None = None
    """Where the MoE layers' choices go (`EngineConfig.return_routed_experts`); None: nowhere."""

    @property
    def kernels(self) -> Kernels:
        return Kernels.ROLLOUT if self.fused else Kernels.TORCH

    def record_routing(self, layer: int, router_logits: torch.Tensor, experts: torch.Tensor) -> None:
        """An MoE layer's routing (`FlatAttention.record_routing`): the chosen experts at the tokens' slots when
        the rollout reports them (`routing`), else nothing."""
        if self.routing is not None:
            self.routing.write(self.slot_mapping, layer, experts)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Store this step's K/V in the cache and attend. `rope` = (cos, sin) (`Kernels.ROLLOUT`): q and k
        are not rotated yet; the rotation and the store run as one kernel (`attention.rope_store_kv`)."""
        k_cache, v_cache = self.kv.layers[layer]
        if rope is None:
            store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        else:
            q, k = rope_store_kv(q, k, v, *rope, k_cache, v_cache, self.slot_mapping)
        if not self.is_prefill:
            if self.exact:
                return exact_decode_attention(q, k_cache, v_cache, self.block_tables, self.context_lens,
                                              scale=self.scale, sliding_window=sliding_window)
            return paged_decode_attention(q, k_cache, v_cache, self.block_tables, self.context_lens, scale=self.scale,
                                          sliding_window=sliding_window)
        if self.key_slots is not None:  # cached prefixes: every key of the context, this step's just stored
            k, v = k_cache.flatten(0, 1)[self.key_slots], v_cache.flatten(0, 1)[self.key_slots]
        if self.exact:
            return exact_attention(q, k, v, self.cu_seqlens, scale=self.scale, max_seqlen=self.max_seqlen,
                                   sliding_window=sliding_window, cu_seqlens_k=self.cu_seqlens_k,
                                   max_seqlen_k=self.max_seqlen_k)
        cu_k = self.cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k
        return prefill_attention(q, k, v, self.cu_seqlens, cu_k, scale=self.scale, sliding_window=sliding_window,
                                 max_seqlen_q=self.max_seqlen, max_seqlen_k=self.max_seqlen_k or self.max_seqlen)


def mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on CUDA `device` over pinned host tensor `host`'s bytes (uint8): kernels store to the host
    memory through the link, not through the copy engine. Pinned memory is mapped into every device's
    address space at the same address (unified addressing, every 64-bit CUDA platform)."""

    class Interface:
        __cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                    "data": (host.data_ptr(), False), "version": 2}

    if not host.is_pinned():
        raise ValueError("mapped(host): host must be a pinned CPU tensor")
    return torch.as_tensor(Interface(), device=device)


class Readback:
    """Where a step's sampled tokens and log-probs reach the host: SLOTS pinned buffers used in turn.

    On CUDA a kernel stores them into the slot through its mapped address (`mapped`), not a copy: with
    offload "rollout" the optimizer state's copy out runs while the rollout decodes, and a copy of a few
    hundred bytes by the copy engine waits milliseconds beside it, where a kernel's stores pass between its
    chunks (`train.offload.WindowedCopier`). The values are bit copies (a bitwise OR with 0 of the float64
    words).

    A slot is rewritten SLOTS steps later; the rollout loop reads every step before two more are launched
    (async decode keeps at most two in flight), and `check` says whether a slot was rewritten.
    On CPU the slots are plain tensors written the same way."""

    SLOTS = 4

    def __init__(self, device: torch.device):
        self.device = device
        self._host: list[torch.Tensor] = []  # int64 [capacity] per slot
        self._dest: list[torch.Tensor] = []  # what a kernel writes: the slot's mapped view (CUDA) or the slot
        self._writes = [0] * self.SLOTS  # per slot: how many steps it has held
        self._turn = 0
        self._last: torch.cuda.Event | None = None

    def write(self, packed: torch.Tensor) -> tuple[torch.Tensor, int, int, torch.cuda.Event | None]:
        """Queue the store of `packed` (float64, contiguous, on self.device) into the next slot: (the slot's
        host view shaped as packed, the slot, its write count, the event that marks the store done)."""
        n = packed.numel()
        if not self._host or self._host[0].numel() < n:
            self.close()  # the old slots go: every store into them must have landed
            cuda = self.device.type == "cuda"
            self._host = [torch.empty(max(n, 256), dtype=torch.int64, pin_memory=cuda) for _ in range(self.SLOTS)]
            self._dest = [mapped(h, self.device).view(torch.int64) if cuda else h for h in self._host]
        slot = self._turn
        self._turn = (slot + 1) % self.SLOTS
        self._writes[slot] += 1
        torch.bitwise_or(packed.view(torch.int64).reshape(-1), 0, out=self._dest[slot][:n])
        ready = None
        if self.device.type == "cuda":
            ready = self._last = torch.cuda.Event()
            ready.record()
        return self._host[slot][:n].view(torch.float64).view(packed.shape), slot, self._writes[slot], ready

    def check(self, slot: int, writes: int) -> None:
        if self._writes[slot] != writes:
            raise RuntimeError(f"readback slot {slot} was rewritten before its step was read: more than "
                               f"{self.SLOTS - 1} steps in flight")

    def close(self) -> None:
        """Wait for the stores in flight (before the slots' memory may go back to the host allocator)."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None


class ModelRunner:
    """Runs prefill and decode steps of a CausalLM against a paged KV cache."""

    def __init__(self, model, kv: KVCache, *, max_num_seqs: int, max_model_len: int, use_cuda_graphs: bool,
                 lazy_cuda_graphs: bool = False, exact: bool = False, routed_experts: bool = False):
        self.model, self.kv = model, kv
        self.exact = exact  # EngineConfig.exact_logprobs: the batch-invariant kernels (AttentionMetadata.exact)
        self.device = kv.data.device
        self.block_size = kv.block_size
        c = model.config
        self.routing = RoutingRecord(num_slots=kv.capacity * kv.block_size, block_size=kv.block_size,
                                     num_layers=c.num_hidden_layers, top_k=c.num_experts_per_tok,
                                     num_experts=c.num_experts, device=self.device) if routed_experts else None
        """EngineConfig.return_routed_experts: each token's routed experts, by KV slot (rollout/routing.py)."""
        self.max_blocks = math.ceil(max_model_len / self.block_size)
        self.scale = model.config.head_dim ** -0.5
        self.fused = self.device.type == "cuda"  # the layers' kernels, chosen once: Kernels.ROLLOUT on GPU
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}
        self.graph_capture_s = 0.0
        self.readback = Readback(self.device)
        """Where the sampled tokens go to the host (the rollout loop's `_launch`)."""
        # Decode inputs are written on the host into one of two staging buffers (pinned on CUDA) and
        # sent in one copy; a buffer is rewritten only once the copy that last read it has run.
        self._staging: list[torch.Tensor] = []
        self._host_views: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # numpy views per (buffer, rows)
        self._staged = [torch.cuda.Event() for _ in range(2)] if self.device.type == "cuda" else []
        self._turn = 0
        # Host mirror of the decode block tables, row i = batch row i of the last decode step, with
        # (list, length, last block) of the table it holds: a row is rewritten only when one changed.
        self._tables = np.full((0, self.max_blocks), -1, dtype=np.int32)
        self._table_lens = np.zeros(0, dtype=np.int64)
        self._table_rows: list[tuple] = []
        # Decode batch size buckets with a CUDA graph: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs.
        # Captured all at once here (largest first), or each at its first decode step (lazy).
        self._sizes = (sorted({s for s in [1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)] if s <= max(max_num_seqs, 1)}
                              | {max_num_seqs}) if use_cuda_graphs and self.device.type == "cuda" else [])
        self._lazy = lazy_cuda_graphs
        self._pool = None
        if self._sizes and not self._lazy:
            with torch.inference_mode():
                for size in reversed(self._sizes):  # largest first: the smaller graphs reuse its memory pool
                    self._capture(size)

    def close(self) -> None:
        """Drop the CUDA graphs (and their memory pool) and the KV cache now, not when a garbage
        collection finds the runner: a rollout's exit frees that memory before training starts."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self._pool = None
        self.readback.close()
        self._staging.clear()
        self._host_views.clear()
        self.kv = None

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device="cpu").to(self.device, non_blocking=True)

    @torch.inference_mode()
    def step(self, batch: Batch, prev_tokens: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Logits [len(batch.seqs), V] (the model dtype: the samplers read them in fp32, so no fp32 copy is
        made per step) of the last token of every sequence of the batch; under TP, this rank's
        vocabulary slice [.., rows] (`CausalLM.vocab_shard`).

        `prev_tokens` = (tokens, rows), decode only: the batch's input ids are still on the device,
        row i's is tokens[rows[i]] (rows None: tokens[i]); the sequences' last host token is then
        PLACEHOLDER (the rollout loop's async decode). The ids are copied into the step's inputs on the
        stream, after the host-staged inputs, so the step waits for nothing on the host.
        """
        self.kv.copy_blocks(batch.block_copies)
        if self.routing is not None:
            self.routing.copy_blocks(batch.block_copies)
        if batch.is_prefill:
            if prev_tokens is not None:
                raise RuntimeError("prev_tokens is for decode steps only")
            return self._prefill(batch.seqs)
        return self._decode(batch.seqs, prev_tokens)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Computes tokens num_cached_tokens .. num_tokens of each sequence; they attend over the whole
        context, the cached prefix's K/V read from its blocks (`AttentionMetadata.key_slots`)."""
        ids, positions, slots, cu, last = [], [], [], [0], []
        key_slots, cu_k = [], [0]
        for seq in seqs:
            start, n = seq.num_cached_tokens, seq.num_tokens
            context = self._slots(seq, 0, n)
            ids.extend(seq.token_ids[start:])
            positions.extend(range(start, n))
            slots.extend(context[start:])
            key_slots.extend(context)
            cu.append(cu[-1] + n - start)
            cu_k.append(cu_k[-1] + n)
            last.append(cu[-1] - 1)
        meta = AttentionMetadata(self.kv, True, self._tensor(slots), self.scale,
                                 cu_seqlens=self._tensor(cu, torch.int32),
                                 max_seqlen=max(s.num_tokens - s.num_cached_tokens for s in seqs),
                                 fused=self.fused, exact=self.exact, routing=self.routing)
        if cu_k[-1] > cu[-1]:
            meta.cu_seqlens_k = self._tensor(cu_k, torch.int32)
            meta.max_seqlen_k = max(s.num_tokens for s in seqs)
            meta.key_slots = self._tensor(key_slots)
        hidden = self.model.hidden_states_paged(self._tensor(ids), self._tensor(positions), meta)
        return self._logits(hidden[self._tensor(last)])

    # -- decode inputs: ids, positions, slots (int64 [n]), lens (int32 [n]) and block tables (int32
    # [n, max_blocks]) as views of one int64 buffer, so that a step needs one host-to-device copy.

    def _decode_numel(self, n: int) -> int:
        return 3 * n + -(-n * (1 + self.max_blocks) // 2)

    def _decode_views(self, buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        words = buf[3 * n:].view(torch.int32)
        return dict(ids=buf[:n], positions=buf[n:2 * n], slots=buf[2 * n:3 * n], lens=words[:n],
                    tables=words[n:n + n * self.max_blocks].view(n, self.max_blocks))

    def _next_staging(self, n: int) -> torch.Tensor:
        """The host buffer for this step's inputs, once the copy that last read it has run."""
        numel = self._decode_numel(n)
        if not self._staging or self._staging[0].numel() < numel:
            pin = self.device.type == "cuda"
            self._staging = [torch.empty(numel, dtype=torch.int64, pin_memory=pin) for _ in range(1 + pin)]
            self._host_views.clear()
        self._turn = (self._turn + 1) % len(self._staging)
        if self._staged:
            # at once in the rollout loop: each step already waited for its tokens
            self._staged[self._turn].synchronize()
        return self._staging[self._turn][:numel]

    def _set_table_row(self, row: int, table: list[int]) -> None:
        n = len(table)
        if n > self.max_blocks:
            raise ValueError(f"a block table of {n} blocks is longer than max_model_len allows ({self.max_blocks})")
        self._tables[row, :n] = table
        self._tables[row, n:] = -1
        self._table_lens[row] = n
        self._table_rows[row] = (table, n, table[-1] if table else None)

    def _stage_decode(self, seqs: list[Sequence], pad_to: int) -> torch.Tensor:
        """The decode inputs of seqs, padded to pad_to rows, written into a host staging buffer.

        O(B) Python per step: a table row is rewritten only when its sequence's block-table list, its
        length or its last block changed. That catches every change BlockManager makes (a new list
        on allocate/free/fork, an append, a copy-on-write of the last block).
        """
        B, bs = len(seqs), self.block_size
        if len(self._table_rows) < B:
            grow = B - len(self._table_rows)
            self._tables = np.concatenate([self._tables, np.full((grow, self.max_blocks), -1, np.int32)])
            self._table_lens = np.concatenate([self._table_lens, np.zeros(grow, np.int64)])
            self._table_rows += [(None, 0, None)] * grow
        ids = [seq.token_ids[-1] for seq in seqs]
        lens = [len(seq.token_ids) for seq in seqs]
        for i, (seq, (cached, n, last)) in enumerate(zip(seqs, self._table_rows)):
            table = seq.block_table
            if cached is not table or n != len(table) or (n and last != table[-1]):
                self._set_table_row(i, table)
        buf = self._next_staging(pad_to)
        v = self._host_views.get((self._turn, pad_to))
        if v is None:
            v = self._host_views[self._turn, pad_to] = {k: t.numpy()
                                                        for k, t in self._decode_views(buf, pad_to).items()}
        lens = np.array(lens, dtype=np.int64)
        positions = lens - 1
        block = positions // bs
        if B and (block >= self._table_lens[:B]).any():
            i = int(np.argmax(block >= self._table_lens[:B]))
            raise RuntimeError(f"sequence {seqs[i].seq_id}: position {positions[i]} has no KV block "
                               f"(block table of {self._table_lens[i]} blocks)")
        # slot of the last token, as `_slots`: table[p // bs] * bs + p % bs
        slots = self._tables[np.arange(B), block].astype(np.int64) * bs + positions % bs
        for name, value, pad in (("ids", ids, 0), ("positions", positions, 0), ("slots", slots, -1), ("lens", lens, 0),
                                 ("tables", self._tables[:B], -1)):
            v[name][:B] = value
            v[name][B:] = pad  # 0 lens: a padding row, output zeros; -1 slots: nothing stored
        return buf

    def _upload(self, host: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
        """host staging -> device in one copy (into dest, the static inputs of a graph, when given)."""
        if self.device.type != "cuda":
            return host if dest is None else dest.copy_(host)
        dest = host.to(self.device, non_blocking=True) if dest is None else dest.copy_(host, non_blocking=True)
        self._staged[self._turn].record()
        return dest

    def _decode_inputs(self, seqs: list[Sequence], pad_to: int) -> dict[str, torch.Tensor]:
        return self._decode_views(self._upload(self._stage_decode(seqs, pad_to)), pad_to)

    @staticmethod
    def _device_ids(ids: torch.Tensor, B: int, prev_tokens) -> None:
        """Write the previous step's device tokens over the staged placeholder ids (rows < B)."""
        if prev_tokens is None:
            return
        tokens, rows = prev_tokens
        if rows is None:
            ids[:B].copy_(tokens[:B])
        else:
            torch.index_select(tokens, 0, rows, out=ids[:B])

    def _decode_forward(self, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata(self.kv, False, inp["slots"], self.scale, context_lens=inp["lens"],
                                 block_tables=inp["tables"], fused=self.fused, exact=self.exact,
                                 routing=self.routing)
        return self._logits(self.model.hidden_states_paged(inp["ids"], inp["positions"], meta))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head; under TP only this rank's vocabulary slice (`CausalLM.vocab_shard`): the sampler
        samples vocab-parallel or gathers."""
        return self.model.local_logits(hidden, exact=self.exact)

    def _decode(self, seqs: list[Sequence], prev_tokens=None) -> torch.Tensor:
        B = len(seqs)
        if prev_tokens is None and any(seq.token_ids[-1] == PLACEHOLDER for seq in seqs):
            raise RuntimeError("a decode step's input token is still on the device and no prev_tokens were given")
        size = next((s for s in self._sizes if s >= B), None)
        if size is None:
            inputs = self._decode_inputs(seqs, B)
            self._device_ids(inputs["ids"], B, prev_tokens)
            return self._decode_forward(inputs)
        if size not in self.graphs:
            self._capture(size)  # lazy: this bucket's first decode step
        graph, static = self.graphs[size]
        self._upload(self._stage_decode(seqs, size), dest=static["buffer"])
        self._device_ids(static["ids"], B, prev_tokens)
        graph.replay()
        return static["logits"][:B]  # a view of the graph's output: sampled on this stream before the next replay

    def _capture(self, size: int) -> None:
        """Capture the decode step of batch bucket `size` with fake sequences (block 0, slots -1: the
        capture reads the cache but writes nothing), in the graphs' shared memory pool."""
        t0 = time.perf_counter()
        fake = Sequence(request=-1, token_ids=[0], num_prompt_tokens=1, params=None, block_table=[0])
        buffer = torch.empty(self._decode_numel(size), dtype=torch.int64, device=self.device)
        self._upload(self._stage_decode([fake] * size, size), dest=buffer)
        static = dict(self._decode_views(buffer, size), buffer=buffer)
        static["slots"].fill_(-1)
        stream = _capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up on the capture stream, outside the graph: Triton compilation and autotuning, and the
            # stream's cuBLAS workspace, which torch keeps per (handle, stream) for the process; allocated
            # inside a capture it would come from the graphs' pool and hold that pool past the rollout.
            self._decode_forward(static)
        torch.cuda.synchronize(self.device)
        # What torch.cuda.graph does, without its empty_cache of device and pinned host memory at every
        # capture: a rollout captures up to ~36 buckets, and each emptying would hand back cached blocks that
        # the steps around it allocate again.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._pool)
            try:
                static["logits"] = self._decode_forward(static)
            finally:
                graph.capture_end()
        self._pool = graph.pool()
        self.graphs[size] = (graph, static)
        torch.cuda.synchronize(self.device)
        self.graph_capture_s += time.perf_counter() - t0
