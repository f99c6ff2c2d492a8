"""Engine-layer tests on a fake model runner (no model on disk): see ``tests/engine/fake_runner.py``."""
