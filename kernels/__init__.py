"""Triton kernels beside pure-torch references, one op per file (see issue 7)."""
