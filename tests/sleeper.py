"""A test that only sleeps: what ``tests/test_caches.py`` runs pytest on and kills mid-test
(not collected by the suite: its name is not ``test_*.py``)."""

from __future__ import annotations

import time


def test_sleeps() -> None:
    time.sleep(60)
