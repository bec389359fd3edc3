"""Headroom migrations package (see shared design)."""
