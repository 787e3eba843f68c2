"""The bench harness on CPU: the smoke suite's row schema, the report from synthetic rows, the tables."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_harness

from hybridengine_bench.common import FIELDS, METRICS, Recorder, quantiles
from hybridengine_bench.report import BEGIN, END, report
from hybridengine_bench.segment_copy import gather_index, layer_table, row_slices, tile

REPO = Path(__file__).resolve().parent.parent


def check_row(row: dict) -> None:
    assert tuple(row) == FIELDS, f"row fields {tuple(row)} != {FIELDS}"
    for key in ("run_id", "commit", "gpu", "torch", "bench", "provider"):
        assert isinstance(row[key], str) and row[key], (key, row)
    datetime.datetime.fromisoformat(row["time"])
    assert isinstance(row["num_gpus"], int) and row["num_gpus"] >= 0
    assert row["model"] is None or isinstance(row["model"], str)
    assert isinstance(row["case"], dict) and isinstance(row["versions"], dict)
    assert row["metric"] in METRICS
    if row["metric"] == "not_run":
        assert row["value"] is None and isinstance(row["case"]["reason"], str)
        return
    assert isinstance(row["value"], float) and row["value"] >= 0, row
    assert (row["p20"] is None) == (row["p80"] is None)
    if row["p20"] is not None:
        assert row["p20"] <= row["value"] <= row["p80"], row


def bench_env(**env_vars: str) -> dict:
    """The environment of a bench subprocess: this one's without the harness's own knobs (HE_BENCH_*: a GPU
    run that sets HE_BENCH_TAIL for its benches must not change what these tests run), plus `env_vars`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HE_BENCH_")}
    return {**env, "PYTHONPATH": str(REPO), "HE_COMMIT": "test", **env_vars}


def run_suite(tmp_path: Path, suite: str, scale: float, timeout: int, **env_vars: str) -> list[dict]:
    """`python -m hybridengine_bench run --suite S --cpu` in a subprocess (`env_vars` set there); its rows, each checked
    against the schema."""
    out = tmp_path / "rows.jsonl"
    env = bench_env(**env_vars)
    proc = subprocess.run([sys.executable, "-m", "hybridengine_bench", "run", "--suite", suite, "--scale", str(scale),
                           "--cpu", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        check_row(row)
    return rows


def test_smoke_suite_rows(tmp_path):
    rows = run_suite(tmp_path, "smoke", 0.2, 120)
    assert len({r["run_id"] for r in rows}) == 1
    failed = [r["case"]["reason"] for r in rows
              if r["metric"] == "not_run" and r["case"]["reason"].startswith("failed")]
    assert not failed, failed
    measured = {(r["bench"], r["provider"]) for r in rows if r["metric"] != "not_run"}
    for key in [("hbm_copy", "torch_copy"), ("gemm", "torch_matmul"), ("generate", "hf_generate"),
                ("train_step", "fsdp2"), ("switch", "fsdp2"), ("segment_copy", "torch_copy")]:
        assert key in measured, f"{key} missing from {sorted(measured)}"
    assert not any(r["provider"] == "hybridengine" and r["bench"] != "segment_copy" for r in rows)


def test_ppo_e2e_suite_rows_on_cpu(tmp_path):
    """The whole-step bench on a tiny model: per-phase rows that add up to the step, both token counts."""
    rows = run_suite(tmp_path, "ppo_e2e", 0.5, 180)
    ours = [r for r in rows if r["provider"] == "hybridengine"]
    assert ours and all(r["bench"] == "ppo_e2e" for r in ours)
    step = next(r for r in ours if r["metric"] == "seconds" and "phase" not in r["case"])
    phases = {r["case"]["phase"]: r["value"] for r in ours if r["metric"] == "seconds" and "phase" in r["case"]}
    assert set(phases) == {"switch_to_generation", "rollout_setup", "generate", "switch_to_training", "log_probs",
                           "update"}
    assert sum(phases.values()) == pytest.approx(step["value"], rel=1e-6)  # one step: medians of single samples
    counts = {r["case"]["count"]: r["value"] for r in ours if r["metric"] == "tokens_per_s"}
    assert counts["all"] == pytest.approx(counts["response"] * (8 + 4) / 4)
    assert any(r["provider"] == "deepspeed_zero3" and r["metric"] == "not_run" for r in rows)


def test_prefill_attention_suite_rows_on_cpu(tmp_path):
    """The prefill bench's plumbing on CPU: the reference and SDPA on one tiny case, TFLOP/s rows, no Triton."""
    rows = run_suite(tmp_path, "prefill_attention", 1.0, 120)
    measured = {(r["provider"], r["metric"]) for r in rows if r["bench"] == "prefill_attention"}
    assert measured == {(p, m) for p in ("torch_ref", "sdpa") for m in ("seconds", "TFLOP_per_s")}


def test_requests_suite_rows_on_cpu(tmp_path):
    """The request-API benches on a tiny model: both sides of each, the prefix-cache hits a conversation
    must get, the carry of partial rollouts, step() and generate per decode step."""
    rows = run_suite(tmp_path, "requests", 0.3, 120)
    failed = [r["case"]["reason"] for r in rows if r["metric"] == "not_run"]
    assert not failed, failed
    assert {r["bench"] for r in rows} == {"multi_turn", "long_tail", "request_api"}

    shapes = {"multi_turn": {"sessions", "turns", "observation", "reply", "block_size"},
              "long_tail": {"prompts", "samples", "prompt", "lengths", "median", "sigma", "max_tokens",
                            "finish_fraction"},
              "request_api": {"seqs", "prompt", "new_tokens", "groups", "every_steps"}}

    def value(bench, metric, **case):
        """The one row of bench and metric whose case is `case` plus the workload's shapes."""
        (row,) = [r for r in rows if r["bench"] == bench and r["metric"] == metric
                  and case.items() <= r["case"].items() and r["case"].keys() - case.keys() <= shapes[bench]]
        return row["value"]
    # 4 sessions x 3 turns of 16-token observations and replies, 16-token blocks: prompts of 16, 48, 80 tokens;
    # turn t + 1 finds the full blocks of turn t's KV (its prompt and all its reply but the last token): 16, 48.
    for caching, hit in ((True, 4 * (16 + 48)), (False, 0)):
        assert value("multi_turn", "tokens", prefix_caching=caching, count="prompt") == 4 * (16 + 48 + 80)
        assert value("multi_turn", "tokens", prefix_caching=caching, count="prefix_cache_hit") == hit
        assert value("multi_turn", "seconds", prefix_caching=caching) > 0
    assert value("multi_turn", "fraction", prefix_caching=True, count="prefill_saved") == pytest.approx(256 / 576)
    for rollout in ("wait_longest", "partial"):
        phases = [value("long_tail", "seconds", rollout=rollout, phase=p) for p in ("rollout", "update")]
        assert sum(phases) == pytest.approx(value("long_tail", "seconds", rollout=rollout))  # one measured step
        decode = value("long_tail", "seconds", rollout=rollout, phase="rollout_decode")
        assert 0 < value("long_tail", "seconds", rollout=rollout, phase="rollout_decode_step") < decode < phases[0]
    assert value("long_tail", "fraction", rollout="wait_longest", count="carried") == 0
    assert value("long_tail", "fraction", rollout="wait_longest", count="stale_tokens") == 0
    assert 0 < value("long_tail", "fraction", rollout="partial", count="carried") <= 0.1 + 1e-9
    for case in (dict(api="generate"), dict(api="step", arrival="at_once", output_kind="cumulative"),
                 dict(api="step", arrival="at_once", output_kind="delta"),
                 dict(api="step", arrival="staggered", output_kind="delta")):
        assert value("request_api", "seconds", timing="decode_step", **case) > 0
        assert value("request_api", "tokens_per_s", **case) > 0


def test_long_tail_lengths_from_the_environment(tmp_path):
    """HE_BENCH_TAIL=MEDIAN,MAX_TOKENS replaces the long tail's lengths; the rows' case says which ran."""
    rows = run_suite(tmp_path, "long_tail", 0.3, 120, HE_BENCH_TAIL="3,12")
    cases = {(r["case"]["median"], r["case"]["max_tokens"]) for r in rows if r["metric"] == "seconds"}
    assert cases == {(3, 12)}


@pytest.mark.parametrize("text", ["512", "512,4096,1", "a,4096", "0,16", "64,16"])
def test_long_tail_lengths_reject_bad_values(text):
    from hybridengine_bench.requests import _tail_lengths

    with pytest.raises(ValueError, match="HE_BENCH_TAIL must be 'MEDIAN,MAX_TOKENS'"):
        _tail_lengths(text)


def test_offload_optimizer_suite_rows_on_cpu(tmp_path):
    """bench offload_optimizer on a tiny model: the most tokens per micro-batch for both settings, seconds and
    tokens/s at every rung of the ladder, and the resident figures of memory_report."""
    rows = run_suite(tmp_path, "offload_optimizer", 0.3, 180)
    assert not [r for r in rows if r["metric"] == "not_run"]
    most = {r["case"]["offload"]: r["value"] for r in rows if r["metric"] == "tokens" and "count" not in r["case"]}
    assert set(most) == {"none", "optimizer"} and all(v > 0 for v in most.values()), most
    for mode in most:
        rungs = {r["case"]["tokens_per_gpu"] for r in rows if r["case"].get("offload") == mode
                 and r["metric"] == "tokens_per_s"}
        assert max(rungs) == most[mode], (mode, rungs)
    keys = {(r["case"]["offload"], r["case"]["key"]) for r in rows if r["case"].get("source") == "memory_report"}
    assert keys == {(m, k) for m in most for k in ("parameters_shard", "gradients", "optimizer", "host_optimizer",
                                                     "host_pinned_total")}


def test_offload_optimizer_suite_runs_the_modes_it_is_given(tmp_path):
    """HE_BENCH_OFFLOAD_MODES: one mode per process on the GPU (each ladder ends in an out-of-memory step);
    a name that is not a mode fails the suite, naming the knob."""
    rows = run_suite(tmp_path, "offload_optimizer", 0.3, 180, HE_BENCH_OFFLOAD_MODES="optimizer")
    assert {r["case"]["offload"] for r in rows if r["case"].get("part") == "max_micro_batch"} == {"optimizer"}
    env = bench_env(HE_BENCH_OFFLOAD_MODES="none,optimiser")
    proc = subprocess.run([sys.executable, "-m", "hybridengine_bench", "run", "--suite", "offload_optimizer", "--cpu",
                           "--out", str(tmp_path / "bad.jsonl")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    assert "HE_BENCH_OFFLOAD_MODES names offload modes" in proc.stdout + proc.stderr


def test_offload_ladder_stops_at_the_first_failure():
    """Nothing runs after a step that ran out of memory (it may leave memory behind in the process)."""
    import types

    from hybridengine_bench import offload

    ctx = types.SimpleNamespace(cuda=True)  # what _ladder reads of the bench's context
    tried = []

    def try_step(tokens):
        tried.append(tokens)
        return None if tokens > 12288 else [1.0]

    most, ran, failed = offload._ladder(ctx, try_step)
    assert (most, failed) == (12288, 14336) and tried == [2048, 4096, 8192, 10240, 12288, 14336]
    assert sorted(ran) == tried[:-1]
    ctx.cuda = False
    assert offload._ladder(ctx, lambda tokens: [1.0]) == (64, {32: [1.0], 64: [1.0]}, None)


def test_offload_rollout_suite_rows_on_cpu(tmp_path):
    """bench offload_rollout on a tiny model: every part with both settings, and the transfer rows (where the
    round trip's time goes) for offload 'rollout' only."""
    rows = run_suite(tmp_path, "offload_rollout", 0.3, 120)
    failed = [r["case"]["reason"] for r in rows if r["metric"] == "not_run"]
    assert not failed, failed
    parts = {(r["case"]["part"], r["case"].get("offload")) for r in rows if "part" in r["case"]}
    assert {(p, m) for p in ("kv_capacity", "grpo_step", "big_rollout") for m in ("none", "rollout")} <= parts
    transfers = {(r["case"]["offload"], r["case"]["transfer"]) for r in rows if "transfer" in r["case"]}
    assert transfers == {("rollout", "offload_start_out"), ("rollout", "offload_start_back")}  # copies: CUDA


def test_soak_rows_on_cpu(tmp_path):
    """`bench soak` on a tiny model: a row per step with its shapes and readings, the summary row, the report."""
    out = tmp_path / "rows.jsonl"
    env = bench_env()
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    proc = subprocess.run([sys.executable, "-m", "hybridengine_bench", "soak", "--cpu", "--model", "tiny-qwen2",
                           "--steps", "3", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        check_row(row)
    assert {(r["bench"], r["provider"], r["model"], r["metric"]) for r in rows} == {
        ("soak", "hybridengine", "tiny-qwen2", "seconds")}
    steps = [r for r in rows if not r["case"].get("summary")]
    assert [r["case"]["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        c = r["case"]
        assert c["alloc_conf"] == "default" and c["fixed_shapes"] is False
        assert 2 <= c["max_tokens"] <= 6 and c["response_tokens"] == 4 * c["max_tokens"]  # 2 prompts x 2 samples
        assert c["tokens"] == c["trained_tokens"] > c["response_tokens"]
        assert set(c["phases"]) == {"rollout", "log_probs", "update"} and sum(c["phases"].values()) <= r["value"]
        assert set(c["memory_GiB"]) == {"nvml_used", "nvml_peak", "allocated", "reserved", "max_allocated",
                                        "max_reserved"}
        assert set(c["allocator"]) == {"segments", "cuda_mallocs", "alloc_retries"}
        assert c["rollout"]["kv_blocks"] > 0
    summary = [r for r in rows if r["case"].get("summary")]
    assert len(summary) == 1 and rows[-1] is summary[0]
    s = summary[0]["case"]
    assert s["steps"] == 3 and s["warmup_steps"] == 1 and s["swing_GiB"]["nvml_peak"] is None  # no NVML on CPU
    assert s["drift"] == pytest.approx(steps[2]["value"] / steps[1]["value"])
    assert summary[0]["value"] == pytest.approx((steps[1]["value"] + steps[2]["value"]) / 2)
    text = report(out, tmp_path / "report", tmp_path / "README.md").read_text()
    assert "| tiny-qwen2 | 0 x cpu | default | no | 3 (1) |" in text
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "report" / "soak.png").exists()


def test_soak_summary_swing_and_drift():
    """Swing = half the range after the warm-up (the first 10%); drift = last fifth's median / the first fifth's."""
    from hybridengine_bench.report.soak import summarize

    def step(i: int, seconds: float, nvml: float | None) -> dict:
        return dict(value=seconds, case=dict(step=i, tokens=100, memory_GiB=dict(nvml_peak=nvml, max_reserved=None)))

    # 20 steps: 2 of warm-up (ignored, however large), then 18: fifths of 3 steps.
    steps = [step(i, 9.0, 99.0) for i in range(2)] + [step(2 + i, 1.0 + (i >= 15), 40.0 + i % 3) for i in range(18)]
    got = summarize(steps[::-1])
    assert got["steps"] == 20 and got["warmup_steps"] == 2
    assert got["swing_GiB"]["nvml_peak"] == 1.0 and got["range_GiB"]["nvml_peak"] == [40.0, 42.0]
    assert got["swing_GiB"]["max_reserved"] is None and got["swing_GiB"]["reserved"] is None
    assert got["drift"] == 2.0 and got["drift_per_token"] == 2.0 and len(got["step_seconds"]) == 18
    assert summarize([step(0, 1.0, None)]) is None


def synthetic_rows(path: Path) -> None:
    rec = Recorder(path=path, run_id="r1", gpu="NVIDIA H200", num_gpus=2, commit="abc", versions={"triton": "3"})
    rec.add("hbm_copy", "torch_copy", None, {"bytes": 2**32}, "GB_per_s", [4000.0, 4200.0, 4100.0])
    rec.add("gemm", "torch_matmul", None, {"m": 8192, "n": 8192, "k": 8192}, "TFLOP_per_s", [790.0])
    rec.add("all_gather", "nccl", None, {"bytes": 2**32, "world": 2}, "busbw_GB_per_s", [250.0, 276.0])
    sw = {"tg": 1, "params": 7.6e9, "received_bytes_per_rank": int(7.6e9)}
    for provider, gather in (("fsdp2", 0.050), ("deepspeed_zero3", 0.045)):
        rec.add("switch", provider, "qwen2-7b", {**sw, "phase": "gather"}, "seconds", [gather, gather * 1.1])
        rec.add("switch", provider, "qwen2-7b", {**sw, "phase": "release"}, "seconds", [0.01])
        rec.add("switch", provider, "qwen2-7b", {**sw, "source": "torch"}, "peak_GiB", 60.0)
    gen = {"batch_per_gpu": 64, "prompt": 128, "new_tokens": 128, "params": 7.6e9}
    rec.add("generate", "hf_generate", "qwen2-7b", {**gen, "cache": "dynamic"}, "tokens_per_s", [1800.0])
    rec.add("generate", "hf_generate", "qwen2-7b", {**gen, "cache": "dynamic"}, "seconds", [9.1])
    rec.add("generate", "deepspeed_gather_once", "qwen2-7b", {**gen, "timer_sync": True}, "tokens_per_s", [900.0])
    rec.not_run("generate", "deepspeed_hybrid_engine", "qwen2-7b", "no Qwen2 container")
    tr = {"batch_per_gpu": 4, "seq": 1024, "params": 7.6e9}
    rec.add("train_step", "fsdp2", "qwen2-7b", tr, "seconds", [0.5, 0.52])
    rec.add("train_step", "deepspeed_zero3", "qwen2-7b", tr, "seconds", [1.0])
    # hybridengine's switch and unit gather, in the peers' run (ratios inside r1).
    he = {"tg": 1, "dtype": "bf16", "gen_GB": 15.2, "received_GB": 7.6}
    rec.add("switch", "hybridengine", "qwen2-7b", {**he, "direction": "train_to_gen"}, "seconds", [0.0315])
    rec.add("switch", "hybridengine", "qwen2-7b", {**he, "direction": "gen_to_train"}, "seconds", [0.007])
    rec.add("switch", "hybridengine", "qwen2-7b", {**he, "direction": "train_to_gen", "after_idle_s": 0.5}, "seconds",
            [0.0275])
    rec.add("switch", "hybridengine", "qwen2-7b", {**he, "direction": "train_to_gen", "after_idle_s": 0.5,
                                                    "pages": "mapped ahead"}, "seconds", [0.026])
    rec.add("switch", "hybridengine", "qwen2-7b", {**he, "model_over_tg_GiB": 14.2, "source": "nvml"}, "peak_GiB", 16.3)
    rec.add("switch", "hybridengine", "qwen2-7b", {**he, "model_over_tg_GiB": 14.2, "source": "nvml",
                                                    "scope": "above_baseline", "baseline_GiB": 1.4}, "peak_GiB", 14.9)
    rec.add("switch_memory", "hybridengine", "qwen2-7b", {**he, "before_GiB": 7.1}, "peak_GiB", 7.1)
    rec.add("switch", "nccl", "qwen2-7b", {"tg": 1, "direction": "train_to_gen"}, "seconds", [0.025])
    tg2 = {"tg": 2, "received_GB": 0.0}
    rec.add("switch", "hybridengine", "qwen2-7b", {**tg2, "direction": "train_to_gen"}, "seconds", [2.4e-5])
    rec.add("switch", "hybridengine", "qwen2-7b", {**tg2, "direction": "gen_to_train"}, "seconds", [2.8e-5])
    unit = {"unit": "layers.0", "MB": 470.0}
    rec.add("unit_gather", "hybridengine", "qwen2-7b", {**unit, "tg": 1, "unpack": False}, "seconds", [0.00105])
    rec.add("unit_gather", "hybridengine", "qwen2-7b", {**unit, "tg": 1, "unpack": False}, "busbw_GB_per_s", [225.0])
    rec.add("unit_gather", "nccl", "qwen2-7b", unit, "seconds", [0.001])
    rec.add("unit_gather", "nccl", "qwen2-7b", unit, "busbw_GB_per_s", [250.0])
    rec.add("unit_gather", "fsdp2", "qwen2-7b", {"unit": "layers.0"}, "seconds", [0.0021])
    # A retired variant (ShardedBuffer's direct_gather): counted in its own section, shown in no table.
    rec.add("unit_gather", "hybridengine", "qwen2-7b", {**unit, "tg": 2, "unpack": True, "gather": "direct"}, "seconds",
            [0.0017])
    seg = {"bytes": 2**30, "pattern": "layer_unpack", "rows": 10}
    rec.add("segment_copy", "torch_copy", None, seg, "GB_per_s", [4000.0])
    rec.add("segment_copy", "hybridengine", None, seg, "GB_per_s", [3000.0])
    seg = {"bytes": 2**26, "pattern": "layer_unpack", "rows": 5}
    rec.add("segment_copy", "torch_copy", None, seg, "GB_per_s", [3300.0])
    rec.add("segment_copy", "hybridengine", None, seg, "GB_per_s", [2805.0])
    # A later one-GPU run: generation, decode attention, PPO loss; its generate peers are in r1 (another run).
    rec = Recorder(path=path, run_id="r2", gpu="NVIDIA H200", num_gpus=1, commit="abd", versions={})
    rec.add("hbm_copy", "torch_copy", None, {"bytes": 2**32}, "GB_per_s", [4000.0])
    rec.add("gemm", "torch_matmul", None, {"m": 8192, "n": 8192, "k": 8192}, "TFLOP_per_s", [800.0])
    ours = {"case": "rollout", "tg": 1, "samples": 1, "batch_per_gpu": 64, "prompt": 128, "new_tokens": 128}
    rec.add("generate", "hybridengine", "qwen2-7b", ours, "tokens_per_s", [2700.0])
    rec.add("decode_step", "hybridengine", "qwen2-7b", ours, "seconds", 0.006)
    rec.add("decode_step", "floor", "qwen2-7b", {"case": "rollout", "batch_per_gpu": 64, "mean_context": 192,
                                                "hbm_GBps": 4210.0, "weights_GiB": 14.2}, "seconds", 0.004)
    pa = {"batch": 128, "context": 1024, "kv_bytes": 2**28}
    rec.add("paged_attention", "hybridengine", "qwen2-7b", {**pa, "split": "auto", "num_partitions": 1}, "seconds",
            [8e-5])
    rec.add("paged_attention", "hybridengine", "qwen2-7b", {**pa, "split": "auto", "num_partitions": 1}, "GB_per_s",
            [2**28 / 8e-5 / 1e9])
    rec.add("paged_attention", "sdpa_dense", "qwen2-7b", pa, "seconds", [1e-4])
    rec.add("paged_attention", "sdpa_dense", "qwen2-7b", pa, "GB_per_s", [2**28 / 1e-4 / 1e9])
    ppo = {"tokens": 32768, "seq": 1024}
    for provider, case, secs, extra in (("hybridengine", {**ppo, "chunk_rows": 3328}, 0.2, 2.0),
                                        ("torch_ref", ppo, 0.3, 90.0), ("torch_chunked", ppo, 0.5, 4.0),
                                        ("hybridengine", {**ppo, "chunk_rows": 1024, "sweep": True}, 0.25, 1.5)):
        rec.add("ppo_loss", provider, "qwen2-7b", case, "seconds", [secs])
        rec.add("ppo_loss", provider, "qwen2-7b", case, "TFLOP_per_s", [400.0 * 0.2 / secs])
        rec.add("ppo_loss", provider, "qwen2-7b", {**case, "source": "torch", "scope": "extra"}, "peak_GiB", extra)
    rec.not_run("ppo_loss", "liger", "qwen2-7b", "liger_kernel is not installed", **ppo)
    samp = {"batch": 128, "vocab": 152064, "dtype": "bf16", "logits_bytes": 38928384}
    rec.add("sampler", "hybridengine", None, {**samp, "splits": 5, "block": 1024}, "seconds", [3.0e-5])
    rec.add("sampler", "torch_sample", None, samp, "seconds", [3.0e-4])
    pf = {"batch": 8, "length": 2048, "tokens": 16384, "q_heads": 28, "kv_heads": 4, "head_dim": 128, "dtype": "bf16"}
    rec.add("prefill_attention", "hybridengine", "qwen2-7b", pf, "TFLOP_per_s", [200.0])
    rec.add("prefill_attention", "torch_varlen", "qwen2-7b", pf, "TFLOP_per_s", [400.0])
    rec.add("prefill_attention", "hybridengine", "qwen2-7b", {**pf, "sweep": True, "path": "dot16-p8", "BLOCK_M": 128,
                                                              "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
            "TFLOP_per_s", [300.0])
    # Rows of benches this report has no section for must not break it.
    rec.add("new_bench", "torch_ref", None, {"size": 3}, "seconds", [2.5e-6])


def test_report_from_synthetic_rows(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    synthetic_rows(rows)
    for row in map(json.loads, rows.read_text().splitlines()):
        check_row(row)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    text = report(rows, tmp_path / "out", readme).read_text()
    for heading in ("## Key ratios", "## Floors", "## Train -> generate switch", "## Unit gather",
                    "## Rollout generation", "## Train step", "## Segment copy", "## Sampler",
                    "## Paged decode attention", "## Prefill attention", "## PPO / GRPO loss",
                    "## Other benches", "## Not run", "## Retired variants", "## Runs"):
        assert heading in text
    # Ratios inside run r1: floor 6 * 7.6e9 * 4096 / 790 TFLOP/s = 0.236 s; fsdp2 0.51 s / 1.0 s = 0.51.
    assert "| qwen2-7b | deepspeed_zero3 | off | 1.000 (1.000–1.000) | – | 0.236 | 0.24 | 0.51 |" in text
    # 7.6 GB / 263 GB/s (the best all-gather median) = 28.9 ms; fsdp2 52.5 ms / 47.25 ms = 1.11.
    assert "| qwen2-7b | deepspeed_zero3 (phase=gather, tg=1) | 47.2 (45.9–48.6) | 7.60 | 28.9 | 0.61 | 1.11 |" in text
    assert "| layer_unpack | 1 GiB | 10 | hybridengine | 3,000 (3,000–3,000) | 0.73 | 0.75 |" in text
    assert "| qwen2-7b | deepspeed_gather_once (timer_sync=True) | 900 (900–900) | – | 32,997 | 0.03 | 0.50 |" in text
    assert "no Qwen2 container" in text
    # Switch, all in r1: 31.5 ms / NCCL 25 ms = 1.26; after idle 27.5 / 25 = 1.10; pages mapped ahead 26 / 25 = 1.04;
    # ZeRO-3 47.25 ms / 31.5 = 1.50; FSDP2 52.5 / 31.5 = 1.67.
    assert ("| qwen2-7b | 1 | 31.5 ms (31.5–31.5) | 7.00 ms (7.00–7.00) | – | 7.60 | – | 25.0 ms (25.0–25.0) | 1.26 | "
            "27.5 ms (27.5–27.5), 1.10 | 26.0 ms (26.0–26.0), 1.04 | 1.50 | 1.67 | 16.3 (14.2), +14.9 over 1.40 | "
            "7.10 → 7.10 | r1 |") in text
    assert ("| qwen2-7b | 2 | 24.0 us (24.0–24.0) | 28.0 us (28.0–28.0) | – | 0 | – | no bytes move | "
            "– | – | – | – | – |") in text
    # Unit gather: 225 / 250 GB/s = 0.90; FSDP2 2.1 ms / 1.05 ms = 2.00.
    assert "| qwen2-7b | 470 | hybridengine tg=1 | 1.05 ms (1.05–1.05) | 225 | 0.90 | 2.00 | r1 |" in text
    assert "tg=2" not in text.split("## Unit gather")[1].split("## ")[0] and "1.70 ms" not in text
    assert "| ShardedBuffer(direct_gather=True) | 1 | r1 |" in text
    # Generate: one GPU at 2,700 tok/s vs the peers' per-GPU rates of run r1 (2 GPUs), marked as another run.
    assert ("| qwen2-7b | rollout (n=1, tg=1) | 64 x 128 | 2,700 (2,700–2,700) | 1 | 2,700 | 6.00 ms | 4.00 ms [1] | "
            "1.50 | 3.00 [2] | – | 6.00 [3] | – | r2 |") in text
    assert "[2] other run: hf_generate qwen2-7b from run r1 (2 x NVIDIA H200), not from run r2." in text
    # Decode attention: 80 us vs SDPA 100 us = 1.25; 3,355 GB/s / 4,000 GB/s HBM copy = 0.84.
    assert "| 128 | 1,024 | 256 MiB | 80.0 (1) | 3,355 | – | – | 100 | 2,684 | – | – | 1.25 | 0.84 |" in text
    # PPO loss: 200 ms, 400 TFLOP/s = 0.50 of the 800 GEMM; 1.50x vs torch_ref, 2.50x vs torch_chunked.
    assert "| 32,768 | hybridengine | 3,328 | 200 (200–200) | 400 | 0.50 | 2.00 | 1.50 | 2.50 | r2 |" in text
    assert "| 32,768 | liger | – | not run [1] |" in text and "[1] liger: liger_kernel is not installed" in text
    assert "| 32,768 | 1,024 | 250 (250–250) | 320 | 1.50 | 0.80 | r2 |" in text
    assert "| new_bench | – | torch_ref | size=3 | seconds | 2.50 us (2.50–2.50) | r2 |" in text
    # Sampler: floor 38.9 MB / 4,000 GB/s = 9.73 us; 30 us / 9.73 = 3.08; torch 300 us / 30 = 10.
    assert "| 128 | hybridengine | 5 x 1024 | 30.0 us (30.0–30.0) | 9.73 us | 3.08 | 10.00 |" in text
    # Prefill: 200 TFLOP/s of the 800 GEMM = 0.25, half of torch_varlen's 400; the sweep's 300 = 0.75 of it.
    assert "| 8 x 2,048 | hybridengine | default | 200 (200–200) | 0.25 | 0.50 |" in text
    assert "| 8 x 2,048 | hybridengine | dot16-p8 128x64, 8 warps, 2 stages | 300 (300–300) | 0.38 | 0.75 |" in text
    if importlib.util.find_spec("matplotlib"):
        assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == [
            "all_gather.png", "generate.png", "paged_attention.png", "ppo_loss.png", "segment_copy.png", "switch.png",
            "train_step.png"]
    new = readme.read_text()
    assert "old table" not in new and new.startswith("# x\n\nbefore\n" + BEGIN) and new.endswith(END + "\nafter\n")
    # The key ratios open report.md; the README's table holds their headline rows (here: the switch against NCCL).
    for line in ("| Switch train->gen time / NCCL all-gather of the same 7.60 GB per rank, qwen2-7b tg=1 | 31.5 ms | "
                 "25.0 ms | 1.26 | <= 1.15 | 2 x H200, r1 |",
                 "| Switch train->gen with its pages mapped ahead (`prepare_generation()` during the training step) / "
                 "NCCL all-gather of the same bytes, qwen2-7b tg=1 | 26.0 ms | 25.0 ms | 1.04 | <= 1.15 | "
                 "2 x H200, r1 |"):
        assert line in new and line in text, line
    assert "Segment copy" not in new and "Decode step" not in new
    for line in ("| Switch train->gen time / NCCL all-gather of the same 7.60 GB per rank, qwen2-7b tg=1 | 31.5 ms | "
                 "25.0 ms | 1.26 | <= 1.15 | 2 x H200, r1 |",
                 "| Switch speed vs DeepSpeed ZeRO-3 gather of every parameter, qwen2-7b tg=1 | "
                 "31.5 ms | 47.2 ms | 1.50x |",
                 "| Switch train->gen 0.5 s after the last release (a training step between the switches) / NCCL "
                 "all-gather of the same bytes, qwen2-7b tg=1 | 27.5 ms | 25.0 ms | 1.10 | <= 1.15 | 2 x H200, r1 |",
                 "| Segment copy GB/s / `copy_` GB/s, 64 MiB (layer_unpack; range over 1 table pattern) | 2,805 GB/s | "
                 "3,300 GB/s | 0.85 (0.85–0.85) | – | 2 x H200, r1 |",
                 "| Rollout tok/s per GPU / DeepSpeed gather-once, qwen2-7b, 64 prompts x 128 new tokens per GPU | "
                 "2,700 tok/s | 450 tok/s | 6.00x | – | 1 x H200, r2; deepspeed_gather_once: other run r1 (2 GPUs) |",
                 "| Decode step / its floor (weights + KV bytes at HBM bandwidth), qwen2-7b, 64 sequences at mean "
                 "context 192 | 6.00 ms | 4.00 ms | 1.50 | <= 1.5 | 1 x H200, r2 |",
                 "| 200 ms (2.00 GiB) | 300 ms (90.0 GiB) | 1.50x | – | 1 x H200, r2 |"):
        assert line in text, line


def test_readme_without_markers_is_left_alone(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    synthetic_rows(rows)
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    report(rows, tmp_path, readme)
    assert readme.read_text() == "# no markers\n"
    assert "no <!-- bench:begin -->" in capsys.readouterr().out
    report(rows, tmp_path, tmp_path / "missing.md")
    assert "does not exist" in capsys.readouterr().out


def test_quantiles_and_metric_check(tmp_path):
    assert quantiles([3.0, 1.0, 2.0, 4.0, 5.0]) == pytest.approx((1.8, 3.0, 4.2))
    rec = Recorder(path=None, run_id="r", gpu="cpu", num_gpus=0, commit="c", versions={})
    with pytest.raises(ValueError, match="metric 'ms' is not one of"):
        rec.add("x", "y", None, {}, "ms", 1.0)


@pytest.mark.parametrize("numel", [1, 1000, 5000, 12345])
def test_segment_tables_cover_exactly(numel):
    from hybridengine.ops import validate_table

    table, src_numel, dst_numel = tile(*layer_table("tiny-qwen2"), numel)
    assert int(table[:, 2].sum()) == numel and (table[:, 2] > 0).all()
    validate_table(table, src_numel, dst_numel)
    index = gather_index(table, torch.device("cpu"))
    src = torch.randn(src_numel)
    dst = torch.full((dst_numel,), float("nan"))
    for s, d, n in table.tolist():
        dst[d:d + n] = src[s:s + n]
    written = torch.cat([dst[d:d + n] for s, d, n in table[torch.argsort(table[:, 1])].tolist()])
    assert torch.equal(written, src[index])
    rows, src_numel, dst_numel = row_slices(4 * 1792 * 3)
    validate_table(rows, src_numel, dst_numel)
    assert sorted(rows[:, 1].tolist()) == list(range(0, dst_numel, 1792))


def test_profile_train_runs_on_cpu(tmp_path):
    """hybridengine_bench.probes.profile_train on a tiny model: both checkpointing settings, step times and the JSON."""
    from hybridengine_bench.probes.profile_train import main

    result = main(["--model", "tiny-qwen2", "--seqs", "2", "--seq-len", "12", "--device", "cpu",
                   "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "profile_train.json").read_text())
    assert saved["settings"].keys() == {"activation_checkpointing_on", "activation_checkpointing_off"}
    for setting in result["settings"].values():
        assert setting["step_s"] > 0 and setting["tokens_per_s"] > 0


def test_profile_switch_analyse():
    """Interval arithmetic of hybridengine_bench.probes.profile_switch (microseconds in, milliseconds out)."""
    from hybridengine_bench.probes.profile_switch import analyse

    got = analyse((0.0, 100.0), maps=[(0.0, 10.0), (20.0, 30.0)], nccl=[(10.0, 40.0), (50.0, 90.0), (95.0, 120.0)])
    assert got["wall_ms"] == 0.1 and got["map_ms"] == 0.02 and got["nccl_kernels"] == 3
    assert abs(got["nccl_busy_ms"] - 0.075) < 1e-12  # the last kernel counts up to the window's end
    assert abs(got["map_under_nccl_ms"] - 0.01) < 1e-12 and abs(got["gpu_idle_ms"] - 0.025) < 1e-12
    assert abs(got["first_nccl_after_ms"] - 0.01) < 1e-12


def _profile_switch_rank(rank, world, store, out, errors):
    import torch.distributed as dist
    from _dist import reporting

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        from hybridengine_bench.probes.profile_switch import run

        res = run("tiny-qwen2", torch.device("cpu"), Path(out), None)
        assert [v["variant"] for v in res["variants"]] == ["mapped", "kept"]
        for v in res["variants"]:
            assert v["wall_ms"] > 0 and v["maps"] == 4 and v["nccl_kernels"] == 0, v
        if rank == 0:
            assert json.loads((Path(out) / "profile_switch.json").read_text())["world_size"] == 2


def test_profile_switch_runs_on_cpu(tmp_path):
    """hybridengine_bench.probes.profile_switch over two gloo processes on a tiny model: both variants, the JSON."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _dist import spawn

    spawn(_profile_switch_rank, 2, str(tmp_path / "out"))


@pytest.mark.parametrize("block,iters", [(256, 3), (1024, 1), (64, 8)])
def test_read_floor_kernel_sums_every_element_once(block, iters):
    # The paged-attention read floor must read each element exactly once: its per-program sums add up to
    # the plain fp32 sum (an odd length leaves a partial last tile, masked).
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    from hybridengine_bench.paged_attention import cold_read

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(10_001, device=device).remainder(97).to(torch.bfloat16)  # small integers: fp32 sums are exact
    out = cold_read(x, block=block, iters=iters, num_warps=4)
    assert out.numel() == -(-x.numel() // (block * iters))
    assert out.sum().item() == x.float().sum().item()


def test_probe_gemm_rows_and_their_report_table():
    # probe_gemm's JSON becomes bench rows (schema FIELDS; a floor row per shape) and report.md's decode-GEMM table.
    from hybridengine_bench.probes.probe_gemm import to_rows
    from hybridengine_bench.report import decode_gemm_section

    probe = {"device": "NVIDIA H200", "torch": "2.11.0", "hbm_copy_GB_per_s": 4000.0, "rows": [
        dict(variant="cublas", model="m1", gemm="qkv", m=128, n=64, k=32, weight_bytes=4000, us=2.0, p20_us=1.9,
             p80_us=2.1, floor_us=1.0),
        dict(variant="triton", config={"SPLIT_K": 2}, model="m1", gemm="qkv", m=128, n=64, k=32, weight_bytes=4000,
             us=3.0, p20_us=2.9, p80_us=3.1, floor_us=1.0),
        dict(variant="triton_sweep", config={"SPLIT_K": 4}, model="m1", gemm="qkv", m=128, n=64, k=32,
             weight_bytes=4000, us=2.5, p20_us=2.4, p80_us=2.6, floor_us=1.0)]}
    rows = to_rows(probe, run_id="r1", time="2026-11-30T23:00:00+00:00", commit="abc", versions={})
    for row in rows:
        check_row(row)
    assert [r["provider"] for r in rows] == ["cublas", "triton", "triton_sweep", "floor"]
    assert "config" not in rows[0]["case"] and rows[1]["case"]["config"] == {"SPLIT_K": 2}
    assert rows[3]["value"] == 1e-6 and rows[3]["case"]["hbm_GBps"] == 4000.0
    text = decode_gemm_section(rows)
    line = next(l for l in text.splitlines() if l.startswith("| m1 | qkv | 128 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4].startswith("2.00 us") and cells[7] == "0.50"   # of floor: 1 us / 2 us
    assert cells[8] == "3.00 us" and cells[9] == "2.50 us" and cells[10] == "1.25"  # best Triton / cuBLAS
    assert "| m1 | 128 | 2.00 us | 1.00 us | 0.50 |" in text


@cpu_harness
def test_probe_request_step_times_both_paths_and_restores_what_it_wrapped(capsys):
    """The probe's harness on CPU (tiny model): a timed line for generate and for step() per measured rep,
    and the engine's methods and the collector's callbacks as they were."""
    import gc

    from hybridengine_bench.probes import probe_request_step
    from hybridengine.rollout import async_decode, requests

    wrapped = (requests.RolloutSession.step, async_decode.Sampled.wait, requests.Request.output)
    callbacks = list(gc.callbacks)
    probe_request_step.main([])
    lines = capsys.readouterr().out.splitlines()
    for api in ("generate", "step"):
        timed = [line for line in lines if line.startswith(f"tiny-qwen2 {api}: total ")]
        assert len(timed) == 2, lines  # reps 1 and 2 (rep 0 warms up)
    assert all("outputs" in line for line in lines if line.startswith("tiny-qwen2 step:"))
    assert (requests.RolloutSession.step, async_decode.Sampled.wait, requests.Request.output) == wrapped
    assert gc.callbacks == callbacks


@cpu_harness
def test_probe_exact_decode_harness_finds_the_engines_launch_exact(capsys, monkeypatch):
    """The probe under the Triton interpreter: the engine's own decode launch (the shared forward tile) gives
    every sequence the varlen kernel's bits, at both head shapes."""
    from hybridengine_bench.probes import probe_exact_decode
    from hybridengine.ops import _launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_launch, "use_kernel", _launch.use_kernel)  # the probe points it at the kernels
    probe_exact_decode.main(["--cpu"])
    lines = capsys.readouterr().out.splitlines()
    engine = [line for line in lines if " forward_tile: " in line]
    assert len(engine) == 2 and all(line.endswith(": 4/4 sequences bitwise equal") for line in engine), lines


@cpu_harness
def test_probe_offload_transfers_harness_on_cpu(capsys):
    """The probe on CPU (a few MiB of state, synchronous copies): the allocation and both copies timed."""
    from hybridengine_bench.probes import probe_offload_transfers

    probe_offload_transfers.main([])
    out = capsys.readouterr().out
    for what in ("alloc allocate_state: ", "copy copy_out: ", "copy copy_back: "):
        assert what in out, out


@cpu_harness  # on a GPU the probe trains Qwen2-7B on 16k tokens: a bench run, not a test
def test_probe_step_memory_marks_every_phase_and_restores_what_it_wrapped(capsys):
    """The probe's harness on CPU (tiny model, both modes, two consecutive steps): one JSON line per step with
    the marks of every phase in order, and the trainer's methods as they were."""
    import json

    from hybridengine_bench.probes import probe_step_memory
    from hybridengine.train.gathered_model import GatheredModel
    from hybridengine.train.trainer import Trainer

    wrapped = [getattr(Trainer, m) for m in ("_micro_step", "_clip_and_step", "_reduce")]
    wrapped.append(GatheredModel.forward_layers_with_graphs)
    rows = probe_step_memory.main(["--reps", "2", "--sync-after-forward"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == json.loads(json.dumps(rows)) and len(rows) == 4
    assert [(r["mode"], r["rep"]) for r in rows] == [("none", 0), ("none", 1), ("optimizer", 0), ("optimizer", 1)]
    for r in rows:
        assert r["ok"] and [label for label, _, _ in r["trace"]] == [
            "start", "forward", "micro_batch", "optimizer_step", "end"]
    assert [getattr(Trainer, m) for m in ("_micro_step", "_clip_and_step", "_reduce")] + [
        GatheredModel.forward_layers_with_graphs] == wrapped
