"""Headroom runtime package (see shared design)."""
