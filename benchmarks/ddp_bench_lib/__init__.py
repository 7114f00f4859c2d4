"""Pieces of benchmarks/ddp_bench.py: models, one timed mode (trainer), levers, CUDA diagnostics, report."""
