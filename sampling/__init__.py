"""Sampling: parameters, the batched sampler, and (later) the rejection sampler for speculation."""

from sampling.beam_search import BeamSearchParams as BeamSearchParams
from sampling.params import SamplingParams

__all__ = ["SamplingParams"]
