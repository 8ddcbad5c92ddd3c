"""Placement policies, chosen by name from :data:`POLICIES`.

The contract (call order, hooks) is in :mod:`kvtier.core.policies.base`; each policy is one small
module of :mod:`kvtier.core.policies`. The live store and ``kvtier replay`` build policies here
and drive them the same way, so what replay measures is what the store does.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.policies.attentionstore import AttentionStorePolicy
from kvtier.core.policies.base import EvictionPolicy, FutureUses, TierContext
from kvtier.core.policies.clairvoyant import ClairvoyantPolicy
from kvtier.core.policies.cost import CostPolicy
from kvtier.core.policies.fifo import FIFOPolicy
from kvtier.core.policies.lru import LRUPolicy
from kvtier.core.policies.optimal import OptimalPolicy
from kvtier.core.policies.returns import ReturnsPolicy

__all__ = [
    "LIVE_POLICIES",
    "POLICIES",
    "AttentionStorePolicy",
    "ClairvoyantPolicy",
    "CostPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "FutureUses",
    "LRUPolicy",
    "OptimalPolicy",
    "ReturnsPolicy",
    "TierContext",
    "make_policy",
]

POLICIES: dict[str, Callable[[TierContext], EvictionPolicy]] = {
    "lru": lambda context: LRUPolicy(),
    "fifo": lambda context: FIFOPolicy(),
    "attentionstore": lambda context: AttentionStorePolicy(),
    "cost": CostPolicy,
    "returns": ReturnsPolicy,
    "optimal": OptimalPolicy,
    "clairvoyant": ClairvoyantPolicy,
}
"""Name -> factory taking the tier's context. Listed baselines first."""

LIVE_POLICIES: tuple[str, ...] = ("lru", "fifo", "attentionstore", "cost", "returns")
"""Those a live store can run (``optimal`` needs the future)."""


def make_policy(name: str, context: TierContext | None = None) -> EvictionPolicy:
    """Build policy ``name`` for a tier. ValueError for an unknown name, or for ``optimal``
    without :attr:`TierContext.future`."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {list(POLICIES)}") from None
    return factory(context if context is not None else TierContext())
