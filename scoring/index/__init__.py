"""Block indexes: which pods hold which block keys, per storage tier."""

from scoring.index.base import DEFAULT_TIERS, BlockIndex, PodHits

__all__ = ["DEFAULT_TIERS", "BlockIndex", "PodHits"]
