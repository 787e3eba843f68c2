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

from bench.common import FIELDS, METRICS, Recorder, quantiles
from bench.report import BEGIN, END, report
from bench.segment_copy import gather_index, layer_table, row_slices, tile

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


def test_smoke_suite_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HE_COMMIT": "test"}
    env.pop("HE_BENCH_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "bench", "run", "--suite", "smoke", "--scale", "0.2", "--cpu",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        check_row(row)
    assert len({r["run_id"] for r in rows}) == 1
    failed = [r["case"]["reason"] for r in rows if r["metric"] == "not_run" and r["case"]["reason"].startswith("failed")]
    assert not failed, failed
    measured = {(r["bench"], r["provider"]) for r in rows if r["metric"] != "not_run"}
    for key in [("hbm_copy", "torch_copy"), ("gemm", "torch_matmul"), ("generate", "hf_generate"),
                ("train_step", "fsdp2"), ("switch", "fsdp2"), ("segment_copy", "torch_copy")]:
        assert key in measured, f"{key} missing from {sorted(measured)}"
    assert not any(r["provider"] == "hybridengine" and r["bench"] != "segment_copy" for r in rows)


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
    rec.add("generate", "deepspeed_gather_once", "qwen2-7b", gen, "tokens_per_s", [900.0])
    rec.not_run("generate", "deepspeed_hybrid_engine", "qwen2-7b", "no Qwen2 container")
    tr = {"batch_per_gpu": 4, "seq": 1024, "params": 7.6e9}
    rec.add("train_step", "fsdp2", "qwen2-7b", tr, "seconds", [0.5, 0.52])
    rec.add("train_step", "deepspeed_zero3", "qwen2-7b", tr, "seconds", [1.0])
    # Rows of benches this report has no section for, or with other case keys, must not break it.
    rec.add("switch", "hybridengine", "qwen2-7b", {"tg": 2, "direction": "train_to_gen"}, "seconds", [0.001])
    rec.add("paged_attention", "torch_ref", "qwen2-7b", {"batch": 128, "context": 1024}, "GB_per_s", [3000.0])
    seg = {"bytes": 2**30, "pattern": "layer_unpack", "rows": 10}
    rec.add("segment_copy", "torch_copy", None, seg, "GB_per_s", [4000.0])
    rec.add("segment_copy", "hybridengine", None, seg, "GB_per_s", [3000.0])


def test_report_from_synthetic_rows(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    synthetic_rows(rows)
    for row in map(json.loads, rows.read_text().splitlines()):
        check_row(row)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    text = report(rows, tmp_path / "out", readme).read_text()
    for heading in ("## Floors", "## Train -> generate switch", "## Rollout generation", "## Train step",
                    "## Segment copy", "## Not run", "## Runs"):
        assert heading in text
    # Ratios inside run r1: floor 6 * 7.6e9 * 4096 / 790 TFLOP/s = 0.236 s; fsdp2 0.51 s / 1.0 s = 0.51.
    assert "| qwen2-7b | deepspeed_zero3 | 1.000 (1.000–1.000) | – | 0.236 | 0.24 | 0.51 |" in text
    # 7.6 GB / 263 GB/s (the best all-gather median) = 28.9 ms; fsdp2 52.5 ms / 47.25 ms = 1.11.
    assert "| qwen2-7b | deepspeed_zero3 (phase=gather, tg=1) | 47.2 (45.9–48.6) | 7.60 | 28.9 | 0.61 | 1.11 |" in text
    assert "| layer_unpack | 1 GiB | 10 | hybridengine | 3,000 (3,000–3,000) | 0.73 | 0.75 |" in text
    assert "| qwen2-7b | deepspeed_gather_once | 900 (900–900) | – | 32,997 | 0.03 | 0.50 |" in text
    assert "no Qwen2 container" in text
    assert "| qwen2-7b | hybridengine (direction=train_to_gen, tg=2) | 1.0 (1.0–1.0) | – | – | – | 52.50 |" in text
    assert "| paged_attention | qwen2-7b | torch_ref | batch=128, context=1024 | GB_per_s | 3,000.0 (3,000.0–3,000.0) | r1 |" in text
    if importlib.util.find_spec("matplotlib"):
        assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == [
            "all_gather.png", "generate.png", "segment_copy.png", "switch.png", "train_step.png"]
    new = readme.read_text()
    assert "old table" not in new and new.startswith("# x\n\nbefore\n" + BEGIN) and new.endswith(END + "\nafter\n")
    assert "deepspeed_gather_once" in new


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
