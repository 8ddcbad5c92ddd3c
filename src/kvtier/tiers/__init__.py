"""Storage tiers behind one contract (:mod:`kvtier.tiers.base`)."""
