"""Optimizer-state offload (`EngineConfig.offload`, hybridengine/train/offload.py).

On the CPU the "host" is a second CPU allocation and every copy is synchronous: the bookkeeping (which
tensors the optimizer names, when the state moves, what a failure leaves behind) is the CUDA path's.
Everything is compared bit for bit: copies are exact and AdamW is elementwise, so offloaded training
must equal training that never offloads."""

import time

import pytest
import torch
import torch.distributed as dist

import hybridengine as he
from hybridengine.sharding.checkpoint import full_state_dict
from hybridengine.train import offload as off
from hybridengine.train.optimizer import FlatAdamW
from _dist import reporting, spawn

MASTERS = (True, False, "split")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread runs them faster than two on the busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
CFG = he.PPOConfig(lr=1e-2, micro_batch_tokens=20, weight_decay=0.01)


def units(master_weights, sizes=(1, 300, 1025, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if master_weights is False else torch.bfloat16
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    masks = [torch.rand(n, generator=g) < 0.6 for n in sizes]
    return params, masks


def grads_for(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.numel(), generator=g) for p in params]


def snapshot(opt):
    return {k: [t.clone() for t in ts] for k, ts in opt.state_lists().items()} | {
        "params": [p.clone() for p in opt.params]}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for x, y in zip(a[k], b[k], strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k


def optimizer(master_weights, offload="none", **kwargs):
    params, masks = units(master_weights)
    return FlatAdamW(params, masks, lr=1e-2, weight_decay=0.1, master_weights=master_weights, offload=offload,
                     **kwargs)


@pytest.mark.parametrize("master_weights", MASTERS)
def test_round_trips_are_bitwise(master_weights):
    opt = optimizer(master_weights, "rollout")
    opt.offload.chunk_bytes = 100  # many chunks, a partial last one
    for step in range(2):
        opt.step(grads_for(opt.params, step))
    before = snapshot(opt)
    device_tensors = [t for ts in opt.state_lists().values() for t in ts]
    for _ in range(25):
        opt.offload.to_host(wait=False)
        assert opt.offload.in_flight
        opt.offload.join()
        assert opt.state_location() == "host"
        host = [t for ts in opt.state_lists().values() for t in ts]
        assert all(t.untyped_storage().data_ptr() == opt.offload.host.data.untyped_storage().data_ptr() for t in host)
        assert opt.offload.host_state_bytes() == sum(t.numel() * t.element_size() for t in device_tensors)
        assert_same(snapshot(opt), before)
        opt.offload.to_device(wait=True)
        assert opt.state_location() == "device" and opt.offload.host_state_bytes() == 0
        assert_same(snapshot(opt), before)
    # the host allocation is made once and kept, the tensors back on the device are new ones
    assert not any(t is u for t, u in zip(device_tensors, (t for ts in opt.state_lists().values() for t in ts)))


@pytest.mark.parametrize("master_weights", MASTERS)
def test_training_with_offloaded_state_equals_training_without(master_weights):
    ref = optimizer(master_weights)
    rollout = optimizer(master_weights, "rollout")
    streamed = optimizer(master_weights, "optimizer", host_limit_bytes=2**20)
    streamed.offload.step_chunk_numel = 64  # several chunks per unit, slots reused, partial last chunks
    assert streamed.state_location() == "host"
    for step in range(6):
        grads = grads_for(ref.params, step)
        for opt in (ref, rollout, streamed):
            opt.step(grads, grad_scale=0.5)
        if step % 2 == 0:
            rollout.offload.to_host()  # the step after brings it back itself
        if step == 3:
            rollout.offload.to_host()
            rollout.offload.to_device()  # in flight at the next step, which joins it
    for opt in (rollout, streamed):
        assert_same(snapshot(opt), snapshot(ref))
        assert opt.state_dict()["step"] == 6
        for key in ("exp_avg", "exp_avg_sq", "master"):
            for a, b in zip(opt.state_dict()[key] or [], ref.state_dict()[key] or []):
                assert torch.equal(a, b), key
    assert streamed.state_location() == "host"


@pytest.mark.parametrize("master_weights", MASTERS)
def test_cancel_to_host_keeps_the_device_state_live(master_weights):
    """A move to host memory cancelled before it is joined (a rollout whose KV cache never took the state's
    memory): the optimizer keeps naming the same device tensors, bit for bit, nothing is in flight, the next
    steps update them in place and equal an optimizer that never moved. A cancel with no move to host in
    flight (none, a finished one, one back to the device) is a no-op that says so."""
    ref, opt = optimizer(master_weights), optimizer(master_weights, "rollout")
    opt.offload.chunk_bytes = 100  # many chunks, a partial last one
    for o in (ref, opt):
        o.step(grads_for(o.params, 0))
    device_tensors = {k: list(ts) for k, ts in opt.state_lists().items()}
    before = snapshot(opt)
    assert opt.offload.cancel_to_host() is False
    opt.offload.to_host(wait=False)
    assert opt.offload.in_flight
    assert opt.offload.cancel_to_host() is True
    assert not opt.offload.in_flight and opt.state_location() == "device" and opt.offload.host_state_bytes() == 0
    assert opt.offload.device_state_bytes() == sum(t.numel() * t.element_size() for ts in device_tensors.values()
                                                   for t in ts)
    for k, ts in opt.state_lists().items():
        assert all(t is u for t, u in zip(ts, device_tensors[k], strict=True)), k
    assert_same(snapshot(opt), before)
    opt.offload.join()  # nothing left to join: the state stays where it is
    assert opt.state_location() == "device"
    for step in (1, 2):
        for o in (ref, opt):
            o.step(grads_for(o.params, step))
    assert_same(snapshot(opt), snapshot(ref))
    for k, ts in opt.state_lists().items():  # updated in place: the same tensors
        assert all(t is u for t, u in zip(ts, device_tensors[k], strict=True)), k
    # a move that was joined, or one back to the device, is not cancelled
    opt.offload.to_host()
    assert opt.offload.cancel_to_host() is False and opt.state_location() == "host"
    opt.offload.to_device(wait=False)
    assert opt.offload.cancel_to_host() is False
    opt.offload.join()
    assert opt.state_location() == "device"
    assert_same(snapshot(opt), snapshot(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("master_weights", MASTERS)
def test_cuda_transfers_and_streamed_step_are_bitwise(master_weights):
    """The CUDA path: pinned (registered) host memory, side-stream copies joined by the compute stream,
    the streamed step's three slots and two streams, the fused kernel; equal to the step on the device."""
    def make(offload="none"):
        params, masks = units(master_weights, sizes=(1, 300, 70_001, 4097))
        return FlatAdamW([p.cuda() for p in params], [m.cuda() for m in masks], lr=1e-2, weight_decay=0.1,
                         master_weights=master_weights, offload=offload)

    ref, rollout, streamed = make(), make("rollout"), make("optimizer")
    rollout.offload.chunk_bytes = 4096
    streamed.offload.step_chunk_numel = 2048 * 3 + 5  # several chunks per unit, slots reused
    assert streamed.offload.host.pinned and streamed.offload.host.data.is_pinned()
    for step in range(5):
        grads = [g.cuda() for g in grads_for(ref.params, step)]
        for opt in (ref, rollout, streamed):
            opt.step(grads)
        rollout.offload.to_host(wait=False)  # joined by the next step's transfer back
        if step % 2:
            rollout.offload.join()
            assert rollout.state_location() == "host"
            rollout.offload.to_device()  # in flight at the next step
    rollout.offload.join()
    torch.cuda.synchronize()
    for target in ("host", "device"):  # the copies' device time on their stream, the starting calls' host time
        assert rollout.offload.copy_seconds(target) > 0 and rollout.offload.start_seconds[target] > 0
    for opt in (rollout, streamed):
        assert_same({k: [t.cpu() for t in v] for k, v in snapshot(opt).items()},
                    {k: [t.cpu() for t in v] for k, v in snapshot(ref).items()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the launcher need the interpreter; "
                    "on a GPU the CUDA test runs the streamed step with the kernel")
def test_streamed_step_with_the_triton_kernel_matches_the_unit_kernel():
    """The CUDA path's launcher on chunk slices (interpreter on the CPU): the chunks' bits are the units'."""
    from hybridengine.kernels import adamw

    ref, streamed = optimizer("split"), optimizer("split", "optimizer")
    streamed.offload.step_chunk_numel = 96
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, grad_scale=1.0)
    grads = grads_for(ref.params, 0)
    for p, lo, m, v, g, mask in zip(ref.params, ref.master_lo, ref.exp_avg, ref.exp_avg_sq, grads, ref.decay_masks):
        adamw.adamw_step_(lo, m, v, g, mask, p, **hyper)
    streamed.offload.step(adamw.adamw_step_, grads, **hyper)
    assert_same(snapshot(streamed), snapshot(ref))


def test_host_memory_is_checked_before_anything_moves(monkeypatch):
    opt = optimizer("split", "rollout", host_limit_bytes=1000)
    opt.step(grads_for(opt.params, 0))
    before = snapshot(opt)
    with pytest.raises(off.OffloadError, match="offload_host_limit_gib allows"):
        opt.offload.to_host()
    assert opt.state_location() == "device" and opt.offload.host is None
    opt.offload.host_limit_bytes = None
    monkeypatch.setattr(off, "host_available_bytes", lambda: 10)
    with pytest.raises(off.OffloadError, match="GiB is available"):
        opt.offload.to_host()
    monkeypatch.setattr(off, "host_available_bytes", lambda: None)

    def refuse(total):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(off, "allocate_host", refuse)
    with pytest.raises(off.OffloadError, match="cannot allocate"):
        opt.offload.to_host()
    assert opt.state_location() == "device"
    assert_same(snapshot(opt), before)
    with pytest.raises(off.OffloadError, match="offload_host_limit_gib allows"):  # 'optimizer': at construction
        optimizer("split", "optimizer", host_limit_bytes=1000)


@pytest.mark.parametrize("direction", ["to_host", "to_device"])
@pytest.mark.parametrize("fail_at", [0, 7])
def test_an_interrupted_transfer_leaves_the_state_where_it_was(monkeypatch, direction, fail_at):
    opt = optimizer("split", "rollout")
    opt.offload.chunk_bytes = 256
    opt.step(grads_for(opt.params, 0))
    if direction == "to_device":
        opt.offload.to_host()
    before, where = snapshot(opt), opt.state_location()
    calls, copy = [0], off.copy_chunk

    def flaky(dst, src, non_blocking):
        calls[0] += 1
        if calls[0] == fail_at + 1:
            raise RuntimeError("injected copy failure")
        copy(dst, src, non_blocking)

    monkeypatch.setattr(off, "copy_chunk", flaky)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        getattr(opt.offload, direction)(wait=True)
    assert opt.state_location() == where and not opt.offload.in_flight
    assert_same(snapshot(opt), before)
    monkeypatch.setattr(off, "copy_chunk", copy)
    getattr(opt.offload, direction)(wait=True)  # the same transfer runs after the failure
    assert_same(snapshot(opt), before)
    ref = optimizer("split")
    ref.step(grads_for(ref.params, 0))
    for o in (opt, ref):
        o.step(grads_for(ref.params, 1))
    assert_same(snapshot(opt), snapshot(ref))


def test_config_errors():
    for bad in ("cpu", "Rollout", None, 1):
        with pytest.raises(ValueError, match="EngineConfig.offload must be one of"):
            he.EngineConfig(offload=bad)
    for bad in (0, -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="offload_host_limit_gib"):
            he.EngineConfig(offload_host_limit_gib=bad)
    with pytest.raises(ValueError, match="offload must be one of"):
        optimizer(True, "host")


# -- the engine ---------------------------------------------------------------------------------------

def engine(mode, dtype=torch.bfloat16, device="cpu", **kwargs):
    return he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(
        dtype=dtype, device=device, max_model_len=64, max_num_seqs=4, offload=mode, **kwargs))


def batch(step, rank=0, vocab=128):
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = [9, 14, 6]
    return he.PPOBatch(input_ids=[torch.randint(0, vocab, (n,), generator=g) for n in lengths],
                       response_mask=[torch.ones(n - 1) for n in lengths],
                       old_logprobs=[torch.randn(n - 1, generator=g) - 4 for n in lengths],
                       advantages=[torch.randn(n - 1, generator=g) for n in lengths])


def grpo_step(e, step, rank=0):
    """rollout -> log_probs -> ppo_step; returns the generated tokens, the log-probs and the report inside."""
    with e.rollout():
        out = e.generate([[1, 2, 3], [4, 5]], he.SamplingParams(max_tokens=3, temperature=0.0))
        report = e.memory_report()
    b = batch(step, rank)
    logp = e.log_probs(b)
    e.ppo_step(b, CFG)
    return [s.token_ids for o in out for s in o.outputs], logp, report


def engine_state(e):
    """Weights (gathered to the CPU) and the optimizer state, copied to the CPU: offloaded state lives in host
    memory, the rest on the engine's device."""
    return {"weights": full_state_dict(e.sharded), **{
        k: [t.cpu().clone() for t in v or []] for k, v in e.trainer.optimizer.state_dict().items() if k != "step"}}


def check_modes(rank=0, dtype=torch.bfloat16, steps=2, device="cpu"):
    engines = {mode: engine(mode, dtype, device) for mode in off.MODES}
    engines["optimizer"].trainer.optimizer.offload.step_chunk_numel = 1000  # several chunks per unit
    runs = {mode: [grpo_step(e, step, rank) for step in range(steps)] for mode, e in engines.items()}
    for mode in ("rollout", "optimizer"):
        for (tokens, logp, _), (ref_tokens, ref_logp, _) in zip(runs[mode], runs["none"]):
            assert tokens == ref_tokens and torch.equal(logp, ref_logp), mode
        got, want = engine_state(engines[mode]), engine_state(engines["none"])
        for k in want:
            for name in (want[k] if isinstance(want[k], dict) else range(len(want[k] or []))):
                assert torch.equal(got[k][name], want[k][name]), (mode, k, name)
    state = sum(t.numel() * t.element_size() for t in engines["none"].trainer.optimizer.state_tensors()) / 2**30
    none_report, rollout_report, opt_report = (runs[m][-1][2] for m in off.MODES)
    assert none_report["optimizer"] == pytest.approx(state) and none_report["host_optimizer"] == 0
    for mode, report in (("rollout", rollout_report), ("optimizer", opt_report)):
        assert report["host_pinned_total"] >= state
        if mode == "rollout" and device == "cuda":  # a growing KV cache takes the state's memory only when full
            assert report["optimizer"] + report["host_optimizer"] == pytest.approx(state)
            continue
        assert report["optimizer"] == 0 and report["host_optimizer"] == pytest.approx(state)  # in host memory
    return engines


def test_engine_training_with_offload_equals_training_without():
    engines = check_modes()
    e = engines["rollout"]
    assert e.memory_report()["host_optimizer"] == 0  # `trainer` brought it back (a training call)


@pytest.mark.gpu
def test_cuda_engine_training_with_offload_equals_training_without():
    """The engine on CUDA: rollout, log-probs and two steps with offload "rollout" and "optimizer" give the
    tokens, log-probs, weights and optimizer state of offload "none", bit for bit (the copies run on their
    side stream, the streamed AdamW on the device)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_modes(device="cuda")


def test_prepare_rollout_starts_the_offload():
    """offload="rollout": prepare_rollout() (after the last step) starts the copy to host; rollout() joins it
    and the next training call brings the state back, the same bits."""
    e = engine("rollout")
    e.ppo_step(batch(0), CFG)
    opt = e._training.optimizer
    before = snapshot(opt)
    e.prepare_rollout()
    assert opt.state_location() == "host" or opt.offload.in_flight
    with e.rollout():
        assert opt.state_location() == "host" and not opt.offload.in_flight
    assert e.stats["offload_start_out_s"] > 0 and "offload_start_back_s" not in e.stats
    e.log_probs(batch(1))
    assert opt.state_location() == "device"
    assert_same(snapshot(opt), before)
    with e.rollout():  # the round trip's costs: the way back's start is noted at the next rollout
        pass
    assert e.stats["offload_start_back_s"] > 0
    assert not any(k.startswith("offload_copy_") for k in e.stats)  # device copy times: CUDA only


def _modes_at(rank, world, init_file, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        check_modes(rank, torch.float32)


def test_engine_offload_equals_without_on_two_ranks():
    spawn(_modes_at, 2)


def test_engine_failures_leave_the_state_intact_and_the_engine_usable(monkeypatch):
    ref, e = engine("none"), engine("rollout", offload_host_limit_gib=1e-9)
    for x in (ref, e):
        grpo_step(x, 0)
    before = engine_state(e)
    with pytest.raises(off.OffloadError, match="offload_host_limit_gib allows"):  # refused before the switch
        with e.rollout():
            pass
    assert e.sharded.state == "training" and e.trainer.optimizer.state_location() == "device"
    e.trainer.optimizer.offload.host_limit_bytes = None
    calls = [0]
    copy = off.copy_chunk

    def flaky(dst, src, non_blocking):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected copy failure")
        copy(dst, src, non_blocking)

    monkeypatch.setattr(off, "copy_chunk", flaky)
    with pytest.raises(RuntimeError, match="injected copy failure"):  # on the way out
        with e.rollout():
            pass
    assert e.trainer.optimizer.state_location() == "device"
    for k, v in engine_state(e).items():
        for name in (v if isinstance(v, dict) else range(len(v))):
            assert torch.equal(v[name], before[k][name]), k
    calls[0] = -10**9  # the rollout's offload runs whole
    with e.rollout():
        pass
    calls[0] = 2  # the first training call's copy back fails: the state stays in host memory
    with pytest.raises(RuntimeError, match="injected copy failure"):
        e.log_probs(batch(1))
    assert e.trainer.optimizer.offload.location == "host"
    for x in (ref, e):  # usable: the next rollout and step run, and equal the reference's
        grpo_step(x, 1)
    want, got = engine_state(ref), engine_state(e)
    for k in want:
        for name in (want[k] if isinstance(want[k], dict) else range(len(want[k]))):
            assert torch.equal(got[k][name], want[k][name]), (k, name)


def test_optimizer_mode_refuses_a_host_too_small_before_the_step():
    e = engine("optimizer", offload_host_limit_gib=1e-9)
    weights = full_state_dict(e.sharded)
    with pytest.raises(off.OffloadError, match="offload_host_limit_gib allows"):
        e.ppo_step(batch(0), CFG)
    assert not e.trainer.has_optimizer
    assert all(torch.equal(w, weights[n]) for n, w in full_state_dict(e.sharded).items())
    e.log_probs(batch(0))  # scoring needs no optimizer state


@pytest.mark.parametrize("mode", ["rollout", "optimizer"])
def test_checkpoint_of_offloaded_state_resumes_bitwise(tmp_path, mode):
    straight = engine("none")
    for step in range(3):
        grpo_step(straight, step)
    first = engine(mode)
    for step in range(2):
        grpo_step(first, step)
    with first.rollout():  # saved with the state in host memory
        pass
    assert first.trainer.optimizer.offload.location == "host" or mode == "rollout"
    first._training.optimizer.offload.to_host()
    first.save(tmp_path / "ck")
    assert first._training.optimizer.offload.location == "host"  # save does not bring it back
    for load_mode in ("none", mode):
        resumed = he.HybridEngine.load(tmp_path / "ck", he.EngineConfig(
            dtype=torch.bfloat16, device="cpu", max_model_len=64, max_num_seqs=4, offload=load_mode))
        grpo_step(resumed, 2)
        want, got = engine_state(straight), engine_state(resumed)
        for k in want:
            for name in (want[k] if isinstance(want[k], dict) else range(len(want[k]))):
                assert torch.equal(got[k][name], want[k][name]), (load_mode, k, name)


# -- the real-shaped presets (the 14B one is the offload's target: its optimizer state does not fit a GPU) --

@pytest.mark.parametrize("name, billions", [("qwen2.5-1.5b", 1.544), ("qwen2-7b", 7.616), ("qwen2.5-14b", 14.770),
                                            ("qwen2.5-32b", 32.764)])
def test_real_shaped_presets_have_their_models_parameter_counts(name, billions):
    from hybridengine.model.config import ModelConfig
    from hybridengine.model.decoder import CausalLM

    model = CausalLM(ModelConfig.from_hf(he.model_config(name)), dtype=torch.bfloat16, device="meta")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=5e-4)


# -- the windowed copier (CUDA) ------------------------------------------------------------------------

def _copier_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not off.WindowedCopier.available():
        pytest.skip("hybridengine._C was built without CUDA ops")


@pytest.mark.gpu
def test_windowed_copier_copies_bitwise_both_ways_and_checks_its_arguments():
    _copier_or_skip()
    dev = torch.device("cuda")
    host = off.HostBuffer({"a": (torch.float32, [1000, 333_333, 7])}, device=dev)
    views = [host.views["a", i] for i in range(3)]
    src = [torch.randn(v.numel(), device=dev) for v in views]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out = off.WindowedCopier(dev, [(h.data_ptr(), s.data_ptr(), s.numel() * 4) for h, s in zip(views, src)], stream,
                             chunk_bytes=4096, window=2)
    out.synchronize()
    assert out.query() and out.seconds() >= 0
    assert all(torch.equal(h, s.cpu()) for h, s in zip(views, src))
    back = [torch.empty_like(s) for s in src]
    cp = off.WindowedCopier(dev, [(d.data_ptr(), h.data_ptr(), h.numel() * 4) for d, h in zip(back, views)], stream)
    cp.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(back, src))
    with pytest.raises(ValueError, match="window and chunk_bytes must be >= 1"):
        off.WindowedCopier(dev, [], stream, window=0)


@pytest.mark.gpu
@pytest.mark.whole_gpu  # 4 GiB each way, and a bound on time that other workers' copies would break
def test_a_rollouts_readback_passes_the_windowed_copy_out():
    """A decode step's tokens reach the host by kernel stores into mapped pinned memory (`Readback`) while a
    4 GiB device-to-host transfer runs (offload "rollout"'s copy out): they land while the transfer is still
    in flight, in under 5% of its duration, bitwise. (Whether a small copy by the copy engine, or the
    readback beside the transfer queued whole, waits depends on how the engine's queue is interleaved at
    that moment: the probe's decode-shaped loop saw 6 ms per step, a one-shot copy in this test has seen
    no wait. The bound asserted is the one the rollout relies on; the others are in the message.)"""
    from hybridengine.rollout.runner import Readback

    _copier_or_skip()
    dev = torch.device("cuda")
    n = 2**30  # fp32 elements: 4 GiB
    src = torch.ones(n, device=dev)
    host = off.HostBuffer({"a": (torch.float32, [n])}, device=dev)
    dst = host.views["a", 0]
    stream = torch.cuda.Stream()
    packed = torch.stack((torch.arange(256, device=dev, dtype=torch.float64),
                          -torch.rand(256, device=dev, dtype=torch.float64)))
    small = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
    rb = Readback(dev)

    def latency(how: str, windowed: bool) -> tuple[float, float, bool]:
        """(seconds until `how` landed, the transfer's seconds, whether it was still in flight then)."""
        torch.cuda.synchronize()
        t_start = time.perf_counter()
        if windowed:
            cp = off.WindowedCopier(dev, [(dst.data_ptr(), src.data_ptr(), n * 4)], stream)
        else:
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                for a, b in off._chunks(src, off.CHUNK_BYTES):
                    dst[a:b].copy_(src[a:b], non_blocking=True)
                done.record(stream)
        time.sleep(0.005)  # the transfer is under way
        t0 = time.perf_counter()
        if how == "readback":
            out, slot, writes, ready = rb.write(packed)
            ready.synchronize()
        else:
            small.copy_(packed, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        elapsed = time.perf_counter() - t0
        in_flight = not (cp.query() if windowed else done.query())
        cp.synchronize() if windowed else stream.synchronize()
        transfer = time.perf_counter() - t_start
        if how == "readback":
            rb.check(slot, writes)
            assert torch.equal(out, packed.cpu())
        assert torch.equal(dst[-1024:], src[-1024:].cpu())
        return elapsed, transfer, in_flight

    latency("readback", True)  # warm-up
    runs = [latency("readback", True) for _ in range(3)]
    others = dict(copy=[latency("copy", True)[0] for _ in range(2)],
                  readback_whole=[latency("readback", False)[0] for _ in range(2)])
    rb.close()
    assert all(in_flight for _, _, in_flight in runs), runs
    assert all(elapsed < 0.05 * transfer for elapsed, transfer, _ in runs), dict(readback=runs, **others)


def test_copier_absence_is_said_once(monkeypatch):
    """A build without CUDA ops has no windowed copier: asking with warn=True says so once (the transfers are
    then queued whole)."""
    if off.WindowedCopier.available():
        pytest.skip("this build has the copier")
    monkeypatch.setattr(off.WindowedCopier, "_warned", False)
    with pytest.warns(UserWarning, match="offload transfers are queued whole"):
        assert not off.WindowedCopier.available(warn=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not off.WindowedCopier.available(warn=True)
