"""The mixture-of-experts section (issue 43): the goals from the `ratio` and `fraction` rows of the latest MoE run,
and the grouped GEMM against its floor and a dense GEMM."""

from __future__ import annotations

from .fmt import dur_spread, sig, sig_spread, table
from .rows import latest, pick

BENCHES = ("moe_e2e", "moe_decode", "moe_routing", "grouped_gemm")
GOALS = [
    # (label, bench, provider, case entries, goal text, met(value))
    ("GRPO step: transformers + FSDP2 / hybridengine", "moe_e2e", "hybridengine",
     dict(metric="ratio", case_to="fsdp2_hf", case_phase=None), ">= 3", lambda v: v >= 3),
    ("decode step / bytes floor", "moe_decode", "hybridengine",
     dict(metric="ratio", case_what="decode_step", case_to="floor"), "<= 2", lambda v: v <= 2),
    ("routing mismatch, (token, layer) pairs, prefill", "moe_routing", "hybridengine",
     dict(metric="fraction", case_stat="mismatch_token_layer", case_phase="prefill"), "0", lambda v: v == 0),
    ("routing mismatch, (token, layer) pairs, decode", "moe_routing", "hybridengine",
     dict(metric="fraction", case_stat="mismatch_token_layer", case_phase="decode"), "0", lambda v: v == 0),
    ("max abs log-prob difference, rollout vs training (nats)", "moe_routing", "hybridengine",
     dict(metric="nats", case_stat="max"), "0", lambda v: v == 0),
]


def moe_section(rows: list[dict]) -> str:
    found = {b: latest(rows, b) for b in BENCHES}
    if not any(found.values()):
        return "## Mixture of experts (issue 43)\n\nNo rows yet."
    body = []
    for name, bench, provider, match, goal, met in GOALS:
        r = pick(found[bench], provider=provider, **match)
        if r is None:
            body.append([name, "–", goal, "–", "–", "–"])
            continue
        body.append([name, r["model"], goal, sig(r["value"]), "yes" if met(r["value"]) else "no",
                     f"{r['run_id']} ({r['num_gpus']} x {r['gpu']})"])
    text = ("## Mixture of experts (issue 43)\n\nGoals, each a ratio or count between rows of one run "
            "(hybridengine_bench/moe.py; docs/moe.md).\n\n"
            + table(["quantity", "model", "goal", "measured", "met", "run"], body))
    gemm = [r for r in found["grouped_gemm"] if r["metric"] == "seconds" and r["provider"] != "floor"]
    if gemm:
        lines = [_gemm_line(found["grouped_gemm"], r)
                 for r in sorted(gemm, key=lambda r: (r["case"]["batch"], r["case"]["proj"], r["provider"]))]
        text += ("\n\nGrouped GEMM (M x N x K; rows grouped by expert): time / floor (max of FLOPs / the run's GEMM "
                 "rate and bytes / its HBM bandwidth) and time / a dense GEMM of the same FLOPs.\n\n"
                 + table(["model", "batch", "proj", "provider", "time", "TFLOP/s", "x floor", "x dense"], lines))
    return text


def _gemm_line(rows: list[dict], r: dict) -> list[str]:
    """One grouped_gemm seconds row with its TFLOP/s twin and its ratios to the floor and to the dense GEMM."""
    c = r["case"]
    same = dict(provider=r["provider"], case_batch=c["batch"], case_proj=c["proj"], case_impl=c.get("impl"))
    tflops = pick(rows, metric="TFLOP_per_s", **same)
    ratios = ["–", "–"]
    if r["provider"] != "torch_matmul":
        ratios = [sig((x := pick(rows, metric="ratio", case_to=to, **same)) and x["value"])
                  for to in ("floor", "torch_matmul")]
    return [r["model"], f"{c['batch']} ({c['m']} x {c['n']} x {c['k']})", c["proj"],
            r["provider"] + (f" ({c['impl']})" if "impl" in c else ""), dur_spread(r), sig_spread(tflops), *ratios]
