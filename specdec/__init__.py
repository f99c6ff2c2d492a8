"""specdec: speculative and constrained decoding on a paged-KV engine, exact and measured."""

from sampling.params import SamplingParams
from specdec.llm import LLM
from specdec.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
