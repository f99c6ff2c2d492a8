"""Constrained decoding: grammar Protocol, outlines-core backend, token bitmasks (see issue 5)."""
