"""Benchmarks as data: floors, peers (DeepSpeed ZeRO-3, FSDP2, HF generate) and hybridengine ops.

`python -m bench run --suite NAME --gpus N` appends one JSON row per measurement to
`bench/results/results.jsonl`; `python -m bench report` turns the rows into `report.md`, PNG
plots and the README's benchmark section. Every row carries the run id, commit, GPU, versions,
so a ratio is only ever taken between rows of the same run.
"""
