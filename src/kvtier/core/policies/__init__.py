"""Placement policies. Pick one by name through :data:`kvtier.core.policy.POLICIES`."""
