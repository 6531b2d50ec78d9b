"""Benchmarks against the peers (bench/README.md); `python -m bench` runs the headline ones."""
