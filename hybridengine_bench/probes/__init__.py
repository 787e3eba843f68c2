"""Probes and profilers: one-off questions about where time or memory goes (`python -m
hybridengine_bench.probes.NAME`). Unlike the suites of `python -m hybridengine_bench run`, most print what they
find rather than store rows; the few that store rows say so in their docstring."""
