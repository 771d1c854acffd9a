"""A small reference engine: continuous batching, chunked prefill, prefix sharing, page tags, phase recipes
(docs/engine.md)."""
from .engine import Engine, EngineStats
from .request import RequestResult, SamplingParams, Status
from .sampling import sample, top_p_filter
from .scheduler import Pool, PrefixCache, Scheduler

__all__ = ["Engine", "EngineStats", "SamplingParams", "RequestResult", "Status", "Scheduler", "Pool", "PrefixCache",
           "sample", "top_p_filter"]
