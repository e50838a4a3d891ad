"""Data side: sharded token datasets, importance scoring, mixing, dedup, resumable streaming."""

from .dedup import MinHashLSH, jaccard
from .loader import PackCollate, PositionTracker, ResumableLoader, domain_losses, merge_states, pad_collate
from .mixing import ExponentiatedGradientWeights
from .scoring import Filter, LengthScorer, ModelLossScorer, NGramRepetitionScorer, Scorer, score_dataset
from .shards import ShardError, ShardWriter, TokenDataset, write_dataset
from .stream import StreamingDataset

__all__ = [
    "ExponentiatedGradientWeights", "Filter", "LengthScorer", "MinHashLSH", "ModelLossScorer", "NGramRepetitionScorer",
    "PackCollate", "PositionTracker", "ResumableLoader", "Scorer", "ShardError", "ShardWriter", "StreamingDataset",
    "TokenDataset", "domain_losses", "jaccard", "merge_states", "pad_collate", "score_dataset", "write_dataset",
]
