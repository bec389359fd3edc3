"""Tiny models: one intra-op thread is faster than two fighting over a shared 2-core machine."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
