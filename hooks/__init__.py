"""A hook for training code: its run's measured memory back to Headroom as a calibration record.

::

    from headroom.hooks import MemoryReporter

    reporter = MemoryReporter("http://headroom:8000", run_uid="llama3-8b-run-42",
                              spec={"model": "llama-3-8b", "train": {...}, "gpu": "H100-80GB"})
    for step in range(1, steps + 1):
        loss = model(batch).loss;   reporter.phase("forward", step)
        loss.backward();            reporter.phase("backward", step)
        optimizer.step();           reporter.phase("optimizer", step)

``phase(name, step)`` reads the allocator's peaks since the previous call
(``torch.cuda.memory_stats()``: ``allocated_bytes.all.peak``, ``reserved_bytes.all.peak``, then
``reset_peak_memory_stats``; on a CPU run of the bundled trainer, its simulated device's count,
``runtime.cap.DeviceCap``) and, once step ``report_after_step`` (2: the first step holds no
optimizer state yet) has passed its optimizer phase, sends the record: the largest allocated
and reserved peaks, the phase of the largest (the estimate's phase names: ``step1_forward``
... ``optimizer``) and every phase's peaks. The reporter is also the bundled trainer's
``on_phase`` hook (``reporter(name, step)``).

Where it goes: ``target`` is the service's URL (``POST /api/v1/calibrations``, the bearer token
from ``token`` or ``HEADROOM_TOKEN``), or a file or directory to write the record to (the
request's JSON). The hook never makes training fail: every error is caught and logged once
(logger ``headroom.hooks``), and a record the service did not take (it is down, or answered an
error) is kept in ``spool`` (default ``~/.cache/headroom/pending``) for :func:`send_pending`.

Nothing here imports torch until a phase is read; the slim install (``pip install
headroom-planner``) has it all.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("headroom.hooks")

#: the estimate's phase names for the trainer's (phase, step)
_FIRST = {"forward": "step1_forward", "backward": "step1_backward", "optimizer": "optimizer"}
_LATER = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}

Stats = Callable[[], dict[str, int] | None]


def default_spool() -> Path:
    """Where records the service did not take wait (``HEADROOM_SPOOL`` or the user's cache)."""
    env = os.environ.get("HEADROOM_SPOOL")
    return Path(env) if env else Path.home() / ".cache" / "headroom" / "pending"


def device_stats() -> dict[str, int] | None:
    """The current device's peaks since the last call, and reset them: CUDA's allocator, else
    the bundled trainer's simulated device; None where neither is measuring."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        out = {
            "allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
        }
        torch.cuda.reset_peak_memory_stats()
        return out
    cap_module = sys.modules.get("headroom.runtime.cap")
    active = getattr(cap_module, "_active", None)
    if active:
        return {"allocated_bytes": int(active[-1].take_window_peak())}
    return None


class MemoryReporter:
    """Reads the device's peaks at the phase boundaries it is told of and reports the run once
    (see the module docstring). Never raises into the training loop."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        run_uid: str,
        spec: Mapping[str, Any],
        *,
        token: str | None = None,
        report_after_step: int = 2,
        stats: Stats = device_stats,
        spool: str | os.PathLike[str] | None = None,
        timeout: float = 5.0,
        notes: str = "",
    ) -> None:
        self.target = str(target)
        self.run_uid = run_uid
        self.spec = dict(spec)
        self.token = token if token is not None else os.environ.get("HEADROOM_TOKEN")
        self.report_after_step = report_after_step
        self.stats = stats
        self.spool = Path(spool) if spool is not None else default_spool()
        self.timeout = timeout
        self.notes = notes
        self.phases: list[dict[str, Any]] = []
        self.sent: dict[str, Any] | None = None  # what the service answered, or where it went
        self.seconds = 0.0  # time spent in the hook
        self._warned = False
        self._done = False

    # --- the training loop's side -------------------------------------------------------------

    def __call__(self, name: str, step: int) -> None:
        self.phase(name, step)

    def phase(self, name: str, step: int) -> None:
        """The phase ``name`` of step ``step`` has just ended."""
        if self._done:
            return
        start = time.perf_counter()
        try:
            self._phase(name, step)
        except Exception as exc:  # the hook never fails a run
            self._warn(f"reading memory at {name} of step {step} failed: {exc}")
        finally:
            self.seconds += time.perf_counter() - start

    def step(self, step: int) -> None:
        """Step ``step`` has ended (for a loop that marks no optimizer phase)."""
        self.phase("optimizer", step)

    def _phase(self, name: str, step: int) -> None:
        read = self.stats()
        if read is None:
            self._warn("no device memory statistics (no CUDA device, no simulated device)")
            return
        names = _FIRST if step <= 1 else _LATER
        self.phases.append({"phase": names.get(name, name), "step": step, **read})
        if name == "optimizer" and step >= self.report_after_step:
            self._done = True
            self._send(self.record())

    # --- the record ---------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The ``POST /api/v1/calibrations`` body of what was read so far."""
        measured_phases = [p for p in self.phases if p.get("allocated_bytes")]
        if not measured_phases:
            raise ValueError("nothing was measured")
        top = max(measured_phases, key=lambda p: p["allocated_bytes"])
        measured: dict[str, Any] = {"allocated_bytes": top["allocated_bytes"]}
        reserved = [p["reserved_bytes"] for p in self.phases if p.get("reserved_bytes")]
        if reserved:
            measured["reserved_bytes"] = max(reserved)
        if top["phase"] in ("step1_forward", "step1_backward", "forward", "backward", "optimizer"):
            measured["phase"] = top["phase"]
        phases = json.dumps(self.phases, separators=(",", ":"))
        return {
            "uid": self.run_uid,
            **self.spec,
            "measured": measured,
            "source": "external",
            "notes": (self.notes + " " if self.notes else "")
            + f"MemoryReporter phases {phases}"[:3900],
        }

    def _send(self, body: dict[str, Any]) -> None:
        if self.target.startswith(("http://", "https://")):
            try:
                self.sent = post(self.target, body, self.token, self.timeout)
                return
            except Exception as exc:
                kept = keep(self.spool, body)
                self._warn(
                    f"the service at {self.target} did not take the record ({exc}); kept "
                    f"in {kept} for send_pending"
                )
                self.sent = {"kept": str(kept)}
                return
        path = Path(self.target)
        if path.is_dir() or self.target.endswith(("/", os.sep)):
            path = path / f"{self.run_uid}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=2))
        self.sent = {"path": str(path)}

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("headroom MemoryReporter: %s", message)


def post(
    service: str, body: dict[str, Any], token: str | None, timeout: float = 5.0
) -> dict[str, Any]:
    """``POST /api/v1/calibrations`` to ``service``: the stored record (raises on any failure)."""
    request = urllib.request.Request(
        service.rstrip("/") + "/api/v1/calibrations",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def keep(spool: Path, body: dict[str, Any]) -> Path:
    """Write a record the service did not take to ``spool`` (one file per run)."""
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / f"{body.get('uid', 'record')}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    return path


def send_pending(
    service: str, token: str | None = None, spool: str | os.PathLike[str] | None = None
) -> list[str]:
    """Send every kept record to ``service``; each one taken (or already stored: the same uid
    answers 200) is removed. The uids sent."""
    folder = Path(spool) if spool is not None else default_spool()
    token = token if token is not None else os.environ.get("HEADROOM_TOKEN")
    sent = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        body = json.loads(path.read_text())
        try:
            post(service, body, token)
        except urllib.error.HTTPError as exc:
            log.warning("headroom send_pending: %s refused %s (%s)", service, path.name, exc.code)
            continue
        path.unlink()
        sent.append(str(body.get("uid")))
    return sent


__all__ = ["MemoryReporter", "device_stats", "keep", "post", "send_pending"]
