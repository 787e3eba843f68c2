"""The example GRPO trainer, shortened: it runs end to end and writes its log and plot."""

import json

from hybridengine.__main__ import main as cli
from hybridengine.examples import grpo


def test_grpo_example_runs_and_logs(tmp_path):
    history = grpo.main(["--steps", "3", "--prompts", "4", "--n", "4", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows == history
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0
        assert set(r) >= {"loss", "kl", "entropy", "grad_norm", "step_s"}
        assert r["entropy"] > 0
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_grpo_through_the_console_entry(tmp_path):
    cli(["grpo", "--steps", "1", "--prompts", "2", "--n", "2", "--no-plot", "--out", str(tmp_path)])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_reward():
    assert grpo.reward([3, 1, 4], [3]) == 1.0
    assert grpo.reward([3, 1, 4], [1, 3]) == 0.0
    assert grpo.reward([3], []) == 0.0
