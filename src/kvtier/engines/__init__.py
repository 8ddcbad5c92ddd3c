"""Thin adapters that put kvtier in front of inference engines."""
