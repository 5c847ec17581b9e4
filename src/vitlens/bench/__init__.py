"""Benchmark harness: methods × metrics over data, stored incrementally in SQLite, resumable, with reports."""

from .runner import BenchConfig, parse_spec, run_benchmark, split_specs

__all__ = ["BenchConfig", "run_benchmark", "parse_spec", "split_specs"]
