"""The MoE suite (hybridengine_bench/moe.py, grouped_gemm.py) on CPU with tiny-qwen3-moe: every bench's rows, and each
ratio row equal to the quotient of the rows it compares (measured in the same run, never a constant)."""

from __future__ import annotations

import types

import pytest
import torch
from test_bench import run_suite

from hybridengine_bench import e2e, moe
from hybridengine_bench.common import Ctx, Recorder
from hybridengine_bench.moe import RoutingLog, _mismatch
from hybridengine_bench.report import report
from hybridengine_bench.report.fmt import sig


def one(rows, **match):
    """The single row whose top-level fields and case entries match (case keys are passed as case_<key>)."""
    found = [r for r in rows if all((r["case"].get(k[5:]) if k.startswith("case_") else r.get(k)) == v
                                    for k, v in match.items())]
    assert len(found) == 1, (match, len(found))
    return found[0]


def test_moe_suite_rows_and_ratios_on_cpu(tmp_path):
    # one thread: a tiny model's ops on a shared CPU run ~3x faster than with torch's default pool
    rows = run_suite(tmp_path, "moe", 0.3, 180, OMP_NUM_THREADS="1")
    failed = [r["case"]["reason"] for r in rows if r["metric"] == "not_run" and "impl" not in r["case"]
              and r["provider"] != "torch_grouped_mm"]
    assert not failed, failed
    assert {r["model"] for r in rows if r["bench"].startswith("moe")} == {"tiny-qwen3-moe"}

    # GRPO step: the peer's step over ours, from the two seconds rows
    ours = one(rows, bench="moe_e2e", provider="hybridengine", metric="seconds", case_phase=None)
    peer = one(rows, bench="moe_e2e", provider="fsdp2_hf", metric="seconds", case_phase=None)
    ratio = one(rows, bench="moe_e2e", metric="ratio", case_to="fsdp2_hf", case_phase=None)
    assert ratio["value"] == pytest.approx(peer["value"] / ours["value"], rel=1e-9)
    phases = {r["case"]["phase"] for r in rows if r["bench"] == "moe_e2e" and r["provider"] == "fsdp2_hf"
              and "phase" in r["case"]}
    assert phases == {"generate", "log_probs", "update"}

    # decode: the floor reads this run's HBM copy bandwidth and touched experts; the ratio is step / floor
    hbm = one(rows, bench="hbm_copy", metric="GB_per_s")
    touched = one(rows, bench="moe_routing", metric="fraction", case_stat="touched_experts")
    assert 0 < touched["value"] <= 1
    floor = one(rows, bench="moe_decode", provider="floor", metric="seconds")
    assert floor["case"]["hbm_GBps"] == hbm["value"] and floor["case"]["hbm_source"] == "hbm_copy row of this run"
    assert floor["case"]["touched_experts_per_layer"] == pytest.approx(touched["value"] * 8)
    assert floor["case"]["touched_source"] == "moe_routing row of this run"
    step = one(rows, bench="moe_decode", provider="hybridengine", metric="seconds", case_what="decode_step")
    decode_ratio = one(rows, bench="moe_decode", metric="ratio", case_what="decode_step")
    assert decode_ratio["value"] == pytest.approx(step["value"] / floor["value"], rel=1e-9)

    # routing mismatch: every stat of both phases, as fractions of the tokens the rollout fed
    for phase, tokens in (("prefill", 2 * 2 * 8), ("decode", 2 * 2 * 3)):  # CPU_E2E: 2 prompts of 8, n 2, 4 new
        for stat in ("mismatch_token_layer", "mismatch_token"):
            r = one(rows, bench="moe_routing", metric="fraction", case_phase=phase, case_stat=stat)
            assert 0 <= r["value"] <= 1 and r["case"]["tokens"] == tokens and r["case"]["positions_not_logged"] == 0
    assert one(rows, bench="moe_routing", metric="nats", case_stat="max")["value"] >= 0

    # grouped GEMM: each ratio is the impl's median over the floor's / the dense GEMM's of the same case
    gg = [r for r in rows if r["bench"] == "grouped_gemm" and r["metric"] == "ratio"]
    assert {r["case"]["impl"] for r in gg if r["provider"] == "hybridengine"} >= {"grouped_gemm_ref"}
    for r in gg:
        key = dict(case_batch=r["case"]["batch"], case_proj=r["case"]["proj"], metric="seconds")
        mine = one(rows, bench="grouped_gemm", provider=r["provider"], case_impl=r["case"].get("impl"), **key)
        other = one(rows, bench="grouped_gemm", provider=r["case"]["to"], **key)
        assert r["value"] == pytest.approx(mine["value"] / other["value"], rel=1e-9)
    assert len(gg) >= 2 * 4  # to floor and to dense, 2 batches x 2 projections, for the reference at least

    # the report's MoE section shows the goals from these rows
    text = report(tmp_path / "rows.jsonl", tmp_path / "report", tmp_path / "no_readme.md").read_text()
    section = text[text.index("## Mixture of experts"):]
    for label, goal, row in (("GRPO step: transformers + FSDP2 / hybridengine", ">= 3", ratio),
                             ("decode step / bytes floor", "<= 2", decode_ratio)):
        assert f"| {label} | tiny-qwen3-moe | {goal} | {sig(row['value'])} |" in section


def test_routing_mismatch_counts_the_differing_tokens_and_layers():
    """Two layers, one prompt of 3 tokens with 2 samples of 3 new tokens: training's routing equals the rollout's
    but for one decode token in one layer (and differs in order only at another, which is no mismatch)."""
    log = RoutingLog()
    prompt_rows = torch.tensor([[0, 1], [2, 3], [1, 3]])
    log.steps.append(([(5, 0), (5, 1), (5, 2)], "prefill", {0: prompt_rows, 1: prompt_rows + 1}))
    decode = {(0, 3): [0, 2], (1, 3): [1, 2], (0, 4): [2, 3], (1, 4): [0, 3]}
    for pos in (3, 4):
        keys = [(5, s, pos) for s in (0, 1)]
        experts = torch.tensor([decode[s, pos] for s in (0, 1)])
        log.steps.append((keys, "decode", {0: experts, 1: experts + 1}))
    seqs, rows = [], []
    for s in (0, 1):
        layer0 = torch.cat([prompt_rows, torch.tensor([decode[s, 3], decode[s, 4], [0, 1]])])
        rows.append(torch.stack([layer0, layer0 + 1]))
        seqs.append(([9, 9, 9], [1, 1, 1], [0.0] * 3))
    rows[1][1, 4] = torch.tensor([5, 1])  # sample 1, position 4, layer 1: {1, 5} against the rollout's {1, 4}
    rows[0][0, 3] = rows[0][0, 3].flip(0)  # the same set in another order
    attn = types.SimpleNamespace(cu=[0, 6, 12], routing={i: (None, torch.cat([rows[0][i], rows[1][i]]))
                                                         for i in (0, 1)})
    out, missing = _mismatch(log, [([0, 1], attn)], seqs, [(0, 0), (0, 1)])
    assert missing == 0
    assert out["prefill"] == (0.0, 0.0, 6)
    assert out["decode"] == (pytest.approx(1 / 8), pytest.approx(1 / 4), 4)
    assert log.touched_fraction(6) == pytest.approx(3 / 6)  # 3 of 6 experts in each decode step and layer


def test_a_failed_cuda_graph_warm_up_is_recorded_and_the_step_runs_without_graphs(monkeypatch):
    """moe_e2e's fallback (a graph capture that fails, as one of `grouped_mlp_ref`'s host reads would): a not_run
    row naming the error, then the GRPO step and decode rows of an engine without graphs."""
    engine_step, configs = e2e.engine_step, []

    def first_fails(ctx, engine, *args):
        configs.append(engine.config.cuda_graphs)
        if len(configs) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return engine_step(ctx, engine, *args)

    monkeypatch.setattr(e2e, "engine_step", first_fails)
    monkeypatch.setattr(moe, "cuda_graphs_first", lambda ctx: True)
    rec = Recorder(path=None, run_id="test", gpu="cpu", num_gpus=0, commit="test", versions={})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moe.moe_e2e(Ctx(rec=rec, device=torch.device("cpu"), rank=0, world=1, models=[], scale=0.3))
    finally:
        torch.set_num_threads(threads)
    assert configs[:2] == [True, False]
    failed = one(rec.rows, metric="not_run")
    assert failed["case"]["cuda_graphs"] is True and "stream is capturing" in failed["case"]["reason"]
    step = one(rec.rows, bench="moe_e2e", metric="seconds", case_phase=None)
    assert step["case"]["cuda_graphs"] is False
    assert one(rec.rows, bench="moe_decode", metric="ratio", case_what="decode_step")["case"]["cuda_graphs"] is False
