"""The run supervisor: launch queued runs, watch them, record how they ended.

A ``Supervisor`` (one per service process, a thread; or ``run_now`` in the foreground for
``headroom launch``) claims queued runs (``transitions.claim``), so several workers never
start the same run; writes each run's validated specs into its own directory; starts
``headroom train`` through the run's launcher backend in a new process group; and records how
it ended (``transitions.finish``): the exit code and a reason read from the trainer's report
(which phase ran out of memory) or from the signal that killed it. Cancelling ends the whole
process group. Runs that a stopped service left ``running`` are reconciled when a supervisor
starts: a trainer still alive is stopped, and the run ends as failed with the reason, or as
succeeded if its report shows it finished.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import IO, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from headroom import planner, store
from headroom.launch import transitions
from headroom.launch.backends import (
    EXIT_OOM,
    describe_exit,
    end_process_group,
    end_process_groups,
    launcher,
    process_cmdline,
    process_start_ticks,
)
from headroom.launch.devices import host_ram_available, resolve_device
from headroom.launch.plan import RunPlan
from headroom.planner.report import TrainerReport, read_report
from headroom.planner.trainable import TORCH_DTYPE, working_precision
from headroom.store import Run

log = logging.getLogger("headroom.runs")


class SupervisorSettings(Protocol):
    """What a supervisor reads of its settings (the service's ``Settings`` has them)."""

    @property
    def run_dir(self) -> Path: ...

    @property
    def run_device(self) -> str: ...

    @property
    def max_running(self) -> int: ...


def this_process() -> str:
    """The owner tag of this process: host, pid and start time (a reused pid differs)."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_ticks(os.getpid())}"


def owner_alive(owner: str | None) -> bool | None:
    """Whether the process ``owner`` names still runs (None: it is on another host)."""
    if not owner:
        return False
    host, _, rest = owner.partition(":")
    if host != socket.gethostname():
        return None
    pid_text, _, ticks = rest.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return str(process_start_ticks(pid)) == ticks


def run_dir(settings: SupervisorSettings, run: Run) -> Path:
    """The run's own directory, ``RUN_DIR/<uid>``, resolved. A uid that would not name a
    directory directly inside RUN_DIR (``.``, ``..``, a separator, a link out: a row stored
    before uids were checked, or by hand) is refused with ``ValueError``: a run never writes
    outside RUN_DIR."""
    base = Path(settings.run_dir).resolve()
    directory = (base / run.uid).resolve()
    if directory.parent != base:
        raise ValueError(
            f"uid: {run.uid[:64]!r} does not name a directory inside the run directory; "
            f"allowed: {store.RUN_UID_RULE}"
        )
    return directory


def inside_run_dir(settings: SupervisorSettings, path: str | Path) -> Path:
    """``path`` resolved, if it lies inside RUN_DIR; ``ValueError`` if not. Every file a run's
    row names (its log, its report) is read through here, so a stored path cannot point the
    service at another file."""
    base = Path(settings.run_dir).resolve()
    resolved = Path(path).resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise ValueError("the path is not inside the run directory")
    return resolved


def report_of(run: Run, settings: SupervisorSettings | None = None) -> TrainerReport:
    """The trainer's report, if it wrote one (an empty report if not, or if ``settings`` are
    given and the report would lie outside their RUN_DIR)."""
    if not run.log_path:
        return TrainerReport()
    path = Path(run.log_path).parent / "report.json"
    if settings is not None:
        try:
            path = inside_run_dir(settings, path)
        except ValueError:
            return TrainerReport()
    return read_report(path)


def plan_of(run: Run) -> RunPlan:
    """The specs a stored run trains, validated once (not estimated)."""
    return RunPlan(
        model=planner.ModelSpec.model_validate(run.plan["model"]),
        train=planner.TrainSpec.model_validate(run.plan["train"]),
        hw=planner.Hardware.model_validate(run.plan["hardware"]),
    )


def _ours(run: Run) -> bool:
    """Whether ``run.pid`` is still this run's trainer (its command line names the run)."""
    return bool(run.pid) and run.uid in process_cmdline(run.pid or 0)


def ending(run: Run, code: int, settings: SupervisorSettings) -> tuple[str, str]:
    """(status, reason) of a trainer that exited with ``code``."""
    report = report_of(run, settings)
    if code == 0:
        return "succeeded", f"completed {report.completed_steps} step(s)"
    reason = describe_exit(code)
    if code == EXIT_OOM and report.oom is not None:
        oom = report.oom
        reason = f"out of memory in {oom.phase}, step {oom.step} (exit {EXIT_OOM})"
    elif code > 0 and run.log_path:
        try:
            log_path = inside_run_dir(settings, run.log_path)
            lines = log_path.read_text(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            lines = []
        if lines:
            reason += f": {lines[-1][:500]}"
    return "failed", reason


def write_specs(plan: RunPlan, run: Run, directory: Path) -> list[str]:
    """Write the run's validated specs into its directory; the trainer's arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.json").write_text(json.dumps(plan.model.model_dump(mode="json")))
    (directory / "train.json").write_text(json.dumps(plan.train.model_dump(mode="json")))
    device = run.device or "cpu"
    args = [
        str(directory / "model.json"),
        "--train",
        str(directory / "train.json"),
        "--steps",
        str(run.steps),
        "--device",
        device,
        "--dtype",
        TORCH_DTYPE[working_precision(plan.train)],
        "--report",
        str(directory / "report.json"),
    ]
    if device == "cpu":  # the planned card's memory, on a simulated device
        args += ["--memory-cap", str(plan.hw.memory_bytes - plan.hw.cuda_context_bytes)]
    return args


def cpu_refusal(plan: RunPlan, run: Run) -> str | None:
    """Why a CPU run would exhaust this host's RAM (None: it will not)."""
    if (run.device or "cpu") != "cpu":
        return None
    predicted = plan.predicted()
    needed = predicted.gpu_peak_bytes - plan.hw.cuda_context_bytes + predicted.host_peak_bytes
    available = host_ram_available()
    if available is not None and needed > 0.8 * available:
        return (
            f"refused: training on the CPU needs about {planner.format_bytes(needed)} of host "
            f"RAM and {planner.format_bytes(available)} is available"
        )
    return None


class Supervisor:
    """Launches queued runs and watches them (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], settings: SupervisorSettings) -> None:
        self.sessions = sessions
        self.settings = settings
        self.owner = this_process()
        self.children: dict[int, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.device: str | None = None

    # -- the loop ---------------------------------------------------------------------------
    def start(self, interval_s: float = 0.25) -> None:
        self.thread = threading.Thread(
            target=self._loop, args=(interval_s,), name="headroom-runs", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        # the service is going away: its trainers go with it, recorded as such; all are
        # signalled at once and share one grace, so N trainers take one grace, not N
        children = list(self.children.items())
        end_process_groups([proc for _, (proc, _) in children], grace_s=5)
        for run_id, (proc, logfile) in children:
            proc.wait()
            logfile.close()
            with self.sessions() as session:
                transitions.finish(
                    session,
                    run_id,
                    status="failed",
                    reason="stopped: the service shut down while it ran",
                    exit_code=proc.returncode,
                )
            del self.children[run_id]

    def _loop(self, interval_s: float) -> None:
        reconciled = False
        while not self.stop.wait(0 if not reconciled else interval_s):
            try:
                if not reconciled:  # first, the runs a stopped service left running
                    self.reconcile()
                    reconciled = True
                self.tick()
            except Exception:  # keep supervising (e.g. a database not yet migrated); logged
                log.exception("run supervisor tick failed")
                self.stop.wait(max(interval_s, 1.0))

    def tick(self) -> None:
        """Record children that ended, then start queued runs up to the limit."""
        self.tick_children()
        while len(self.children) < self.settings.max_running and self._start_next():
            pass

    def tick_children(self) -> None:
        """Record how each child that ended did."""
        for run_id, (proc, logfile) in list(self.children.items()):
            code = proc.poll()
            if code is None:
                continue
            logfile.close()
            del self.children[run_id]
            with self.sessions() as session:
                run = session.get(Run, run_id)
                if run is None:
                    continue
                status, reason = ending(run, code, self.settings)
                if not transitions.finish(
                    session, run_id, status=status, reason=reason, exit_code=code
                ):
                    run.exit_code = code  # cancelled meanwhile: keep how the trainer ended
                    session.commit()

    # -- starting ---------------------------------------------------------------------------
    def _start_next(self) -> bool:
        with self.sessions() as session:
            run_id = transitions.next_queued(session)
            if run_id is None:
                return False
            if not self._claim(session, run_id):
                return True  # another worker took it; look again
            run = session.get(Run, run_id)
            assert run is not None
            session.refresh(run)
            self.launch(session, run)
            return True

    def _claim(self, session: Session, run_id: int) -> bool:
        """queued → running, owned by this process; False if another claimed it first."""
        if self.device is None:
            self.device = resolve_device(self.settings.run_device)
        return transitions.claim(session, run_id, owner=self.owner, device=self.device)

    def _fail(self, session: Session, run: Run, reason: str) -> None:
        transitions.finish(session, run.id, status="failed", reason=reason, exit_code=None)

    def launch(self, session: Session, run: Run, plan: RunPlan | None = None) -> None:
        """Start a claimed run's trainer (or end the run with the reason it cannot start);
        ``plan`` is the run's, where the caller has it validated already."""
        try:
            plan = plan or plan_of(run)
            refusal = cpu_refusal(plan, run)
            if refusal is not None:
                self._fail(session, run, refusal)
                return
            directory = run_dir(self.settings, run)
            args = write_specs(plan, run, directory)
            if run.plan.get("probe") and not run.plan.get("probes"):
                confirmed = self.probe(session, run, plan, directory)
                if confirmed is None:
                    return
                plan = confirmed
                args = write_specs(plan, run, directory)
            backend = launcher(run.backend)
            log_path = directory / "log.txt"
            logfile = open(log_path, "ab")  # noqa: SIM115 - closed when the child is reaped
        except (OSError, ValueError, planner.HeadroomError) as exc:
            self._fail(session, run, f"could not start: {exc}")
            return
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if plan.train.expandable_segments:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        try:
            proc = backend.start(args, logfile, directory, env)
        except OSError as exc:
            logfile.close()
            self._fail(session, run, f"could not start: {exc}")
            return
        self.children[run.id] = (proc, logfile)
        started = transitions.note_started(
            session, run.id, pid=proc.pid, log_path=str(log_path), backend=backend.name
        )
        if not started:
            end_process_group(proc)  # cancelled between the claim and the start

    def probe(self, session: Session, run: Run, plan: RunPlan, directory: Path) -> RunPlan | None:
        """Confirm the run's plan with probes (``launch.probing``), each recorded as a
        calibration; the confirmed plan replaces the run's (None: none was confirmed, and the
        run has failed saying why)."""
        from headroom.launch.probing import autofit, subprocess_prober
        from headroom.launch.recording import probe_recorder

        transitions.note_probing(session, run.id)
        result = autofit(
            plan.model,
            plan.train,
            plan.hw,
            subprocess_prober(str(directory / "model.json"), plan.hw, run.device or "cpu"),
            record=probe_recorder(self.sessions, plan.model, plan.hw),
        )
        stored = {**run.plan, "probes": [p.model_dump(mode="json") for p in result.probes]}
        if result.fits and result.plan is not None:
            stored["train"] = result.plan
        transitions.record_probes(session, run, stored)
        if not result.fits:
            self._fail(session, run, f"no plan confirmed by probes: {result.reason}")
            return None
        return RunPlan.of_fit(plan.model, result.fit, plan.hw, result.confirmed)

    def run_now(self, run_id: int, plan: RunPlan | None = None, poll_s: float = 0.2) -> Run:
        """Claim, start and wait for one queued run in the foreground (``headroom launch``),
        ``plan`` being its validated plan; an interrupt cancels it, ending its process group."""
        with self.sessions() as session:
            claimed = self._claim(session, run_id)
            run = session.get(Run, run_id)
            assert run is not None
            if claimed:
                session.refresh(run)
                self.launch(session, run, plan)
        try:
            while run_id in self.children:
                self.stop.wait(poll_s)
                self.tick_children()
        except KeyboardInterrupt:
            with self.sessions() as session:
                run = session.get(Run, run_id)
                if run is not None:
                    cancel(session, run, end_group=False)
            proc, _ = self.children.get(run_id, (None, None))
            if proc is not None:  # our own child: end its group here, and wait for it
                end_process_group(proc)  # reaped there: gone as soon as it exits
                proc.wait()
            self.tick_children()
        with self.sessions() as session:
            run = session.get(Run, run_id)
            assert run is not None
            return run

    # -- restarts ---------------------------------------------------------------------------
    def reconcile(self) -> int:
        """End the runs that a stopped supervisor left ``running``; how many were ended."""
        ended = 0
        with self.sessions() as session:
            for run in session.scalars(select(Run).where(Run.status == "running")):
                if run.owner == self.owner or owner_alive(run.owner) is not False:
                    continue
                alive = _ours(run)
                if alive:
                    end_process_group(run.pid or 0)
                report = report_of(run, self.settings)
                if not alive and report.losses and report.oom is None:
                    status, reason = (
                        "succeeded",
                        f"completed {report.completed_steps} step(s) while its service was down",
                    )
                else:
                    status = "failed"
                    reason = (
                        "orphaned: the service supervising it stopped; the trainer was ended"
                        if alive
                        else "orphaned: the service supervising it stopped and the trainer is "
                        "gone; its exit status was lost"
                    )
                ended += transitions.finish(
                    session, run.id, status=status, reason=reason, exit_code=None
                )
        return ended


def cancel(session: Session, run: Run, end_group: bool = True) -> Run:
    """Cancel a queued or running run; a running one's whole process group is ended (in the
    background; ``end_group=False`` leaves that to a caller that owns the process)."""
    was_running = run.status == "running"
    if transitions.cancel(session, run) and end_group and was_running and _ours(run):
        threading.Thread(
            target=end_process_group, args=(run.pid,), name="headroom-cancel", daemon=True
        ).start()
    return run
