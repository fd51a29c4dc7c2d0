"""Benchmarks behind `rlt-bench NAME …` (python -m rlt_engine.cli bench NAME …)."""
