"""Headroom api package (see shared design)."""
