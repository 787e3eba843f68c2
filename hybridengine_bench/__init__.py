"""Benchmarks as data: floors, peers (DeepSpeed ZeRO-3, FSDP2, HF generate) and hybridengine ops.

`python -m hybridengine_bench run --suite NAME --gpus N` appends one JSON row per measurement to
`hybridengine_bench/results/results.jsonl`; `python -m hybridengine_bench report` turns the rows into `report.md`, PNG
plots and the README's benchmark section. Every row carries the run id, commit, GPU, versions,
so a ratio is only ever taken between rows of the same run.
"""
