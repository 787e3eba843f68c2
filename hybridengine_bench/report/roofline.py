"""The floors a run measured (HBM copy, bf16 GEMM, all-gather bus bandwidth) and what they bound."""

from __future__ import annotations

from hybridengine.model.presets import MODEL_CONFIGS

from .fmt import fmt, ratio, size, spread, table
from .rows import pick, shown_runs

DATASHEET = {"hbm_copy": 4800.0, "gemm": 989.0}
"""H200 SXM datasheet: 4.8 TB/s HBM3e, ~989 dense bf16 TFLOP/s; all-gather has no datasheet floor."""


class Floors:
    """The floor rows of one run."""

    def __init__(self, rows: list[dict], run_id: str):
        run = [r for r in rows if r["run_id"] == run_id]
        hbm, gemm = pick(run, bench="hbm_copy", metric="GB_per_s"), pick(run, bench="gemm", metric="TFLOP_per_s")
        busbw = [r["value"] for r in run if r["bench"] == "all_gather" and r["metric"] == "busbw_GB_per_s"]
        self.hbm_GBps = hbm and hbm["value"]
        self.gemm_TFLOPs = gemm and gemm["value"]
        self.busbw_GBps = max(busbw, default=None)

    def switch_s(self, case: dict) -> float | None:
        if "received_bytes_per_rank" not in case:
            return None
        return self.busbw_GBps and case["received_bytes_per_rank"] / (self.busbw_GBps * 1e9)

    def train_s(self, case: dict) -> float | None:
        if any(k not in case for k in ("params", "batch_per_gpu", "seq")):
            return None
        return self.gemm_TFLOPs and 6 * case["params"] * case["batch_per_gpu"] * case["seq"] / (self.gemm_TFLOPs * 1e12)

    def generate_tok_s(self, model: str, case: dict, num_gpus: int) -> float | None:
        needed = ("params", "prompt", "new_tokens", "batch_per_gpu")
        if not self.hbm_GBps or model not in MODEL_CONFIGS or any(k not in case for k in needed):
            return None
        cfg = MODEL_CONFIGS[model]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        context = case["prompt"] + case["new_tokens"] / 2
        kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * context * case["batch_per_gpu"]
        step = (2 * case["params"] + kv) / (self.hbm_GBps * 1e9)
        return max(num_gpus, 1) * case["batch_per_gpu"] / step


def floors_section(rows: list[dict]) -> str:
    body = []
    for run_id in shown_runs(rows):
        for r in rows:
            if r["run_id"] != run_id:
                continue
            if r["bench"] in DATASHEET and r["metric"] in ("GB_per_s", "TFLOP_per_s"):
                unit = "GB/s" if r["metric"] == "GB_per_s" else "TFLOP/s"
                what = size(r["case"]["bytes"]) if "bytes" in r["case"] else f"{r['case']['m']}^3 bf16"
                body.append([r["bench"], what, f"{spread(r)} {unit}", fmt(DATASHEET[r["bench"]]),
                             ratio(r["value"], DATASHEET[r["bench"]]), run_id])
            elif r["bench"] == "all_gather" and r["metric"] == "busbw_GB_per_s":
                body.append([f"all_gather busbw ({r['provider']}, {r['case']['world']} ranks)",
                             size(r["case"]["bytes"]), f"{spread(r)} GB/s", "–", "–", run_id])
    return "## Floors\n\n" + table(["quantity", "size", "median (p20–p80)", "datasheet", "of datasheet", "run"], body)
