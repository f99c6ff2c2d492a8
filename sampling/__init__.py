"""Sampling: parameters, the batched sampler, and (later) the rejection sampler for speculation."""

from sampling.params import SamplingParams

__all__ = ["SamplingParams"]
