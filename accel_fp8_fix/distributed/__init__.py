"""Collectives that name their group explicitly, and the cross-rank agreement check."""
