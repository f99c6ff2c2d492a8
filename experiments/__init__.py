"""Experiments: the main job, benchmarks against transformers, sweeps and plots."""
