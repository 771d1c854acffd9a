"""Tensor and expert parallelism as transforms on a built model (``docs/parallel.md``).

    model = KimiK26ForCausalLM(config, ...)          # single-device code, same weights on every rank
    mq.parallel.apply_ep(model)                     # optional: routed experts partitioned (EP)
    mq.parallel.apply_tp(model)                     # attention heads, MLPs, vocabulary sharded (TP)
    logits = model(input_ids)                       # same inputs on every rank -> the full logits

or load each rank's share straight from a checkpoint with :func:`load_sharded`.
"""
from .comm import GroupInfo, group_info
from .ep import ExpertParallelExperts, apply_ep
from .load import load_sharded
from .shard import Shard, Split, shards_of, sharded_bytes
from .tp import VocabParallelEmbedding, apply_tp

__all__ = ["apply_tp", "apply_ep", "load_sharded", "sharded_bytes", "shards_of", "Shard", "Split",
           "ExpertParallelExperts", "VocabParallelEmbedding", "GroupInfo", "group_info"]
