"""Headroom calibration package (see shared design)."""
