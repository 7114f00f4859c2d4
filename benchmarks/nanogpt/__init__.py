"""nanoGPT, vendored unedited (README.md here); this file alone is the project's: model.py is importable
as `nanogpt.model` from benchmarks/ (benchmarks/graph_breaks.py, nanogpt_swap.py's FLOP count, the tests)."""
