"""Piecewise ``torch.compile`` of the decoders: token buckets, attention as a custom op, the compiled
forward. See :mod:`specdec.compilation.compiled_model`."""
