"""The worker side: in-process elasticity for efdl-aware training scripts."""

from efdl.state.elastic import ElasticState, elastic, elastic_state, init_process_group
from efdl.state.sampler import ElasticSampler

__all__ = ["ElasticSampler", "ElasticState", "elastic", "elastic_state", "init_process_group"]
