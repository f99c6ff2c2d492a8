"""Hydra config directory of ``python -m experiments.run`` (a package so tests can compose it)."""
