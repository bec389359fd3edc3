"""Headroom: will this training run fit, where does every byte go, and what fits instead."""

__version__ = "0.1.0"
