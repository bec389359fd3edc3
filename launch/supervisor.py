"""The run supervisor: launch queued runs, watch them, record how they ended.

A ``Supervisor`` (one per service process, a thread; or ``run_now`` in the foreground for
``headroom launch``) claims queued runs (``transitions.claim``), so several workers never
start the same run; writes each run's validated specs into its own directory; starts
``headroom train`` through the run's launcher backend in a new process group; and records how
it ended (``transitions.finish``): the exit code and a reason read from the trainer's report
(which phase ran out of memory) or from the signal that killed it. Cancelling ends the whole
process group.

A run with ``probe`` is confirmed first where it will train (``launch.probe_process``): beside
a local run, as the run's own child (a process group of its own, which a cancel ends; bound to
the service, so it dies with it; its files and temporary folder in the run's directory), whose
end the loop learns as a trainer's while it starts other runs; then its probes are recorded, if
the run still runs, and its trainer starts on the plan they confirmed. A Slurm job runs them on
its node before its trainer, and they are recorded once they end.

A trainer stays the supervisor's (``Child``) until its ending is in the store: how it ended is
kept in its run directory first (``rundirs.save_ending``), and a write the database refused is
tried again each tick, so a database that is away for a while delays the record, never loses
it. Such an outage is logged once when it begins and once when it ends.

Replicas of the service on one database share ``max_running``: a claim counts every running
run (``transitions.claim``), so a supervisor starts nothing while all places are taken.

A run with ``backend: slurm`` is a batch job instead (``launch.slurm``): the supervisor writes
the batch script into the run's directory, submits it, keeps the job id in the store and
watches the job through the controller (every ``JOB_POLL_S``); the job's end is the run's
(the trainer's exit code and report as for a process; a signal, a time limit, a node failure
or a cancellation from Slurm's side); cancelling is ``scancel``. A job outlives the service that
submitted it: a supervisor that stops leaves its jobs running, and the next to reconcile takes
them over (``transitions.adopt``) and records how they end.

Each supervisor beats for its running runs (``owner_seen_at``, every third of
``owner_timeout_s``): a Slurm job whose supervisor is on another host and has not beaten for
``owner_timeout_s`` is taken over by a replica here (a process-run there is left to that host,
whose trainer only it can see).

Runs that a stopped service left ``running`` are reconciled when a supervisor starts (and from
time to time after): a Slurm job is taken over; a trainer process still alive is stopped; the
run ends with the ending its supervisor kept, or as failed with the reason, or as succeeded if
its report shows it finished.
Runs this supervisor claimed but lost track of (the database failed while one started) are
ended the same way. The directories of runs that ended longer ago than
``HEADROOM_RUN_RETENTION_DAYS`` are removed (``rundirs.remove_expired``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO, Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from headroom import planner, store
from headroom.calibration.processes import die_with_parent
from headroom.launch import slurm, transitions
from headroom.launch.backends import (
    EXIT_OOM,
    TRAINER_UMASK,
    describe_exit,
    end_process_group,
    end_process_groups,
    launcher,
    process_cmdline,
    process_start_ticks,
)
from headroom.launch.devices import cpu_ram_refusal, resolve_device
from headroom.launch.plan import RunPlan
from headroom.launch.probing import (
    HARDWARE_FILE,
    SCRATCH,
    LadderOutcome,
    probe_process_argv,
    read_outcome,
)
from headroom.launch.rundirs import (
    Ending,
    RunDirSettings,
    inside_run_dir,
    make_private_dir,
    open_log,
    read_ending,
    remove_expired,
    run_dir,
    save_ending,
    write_private,
)
from headroom.launch.settings import from_environment, ranks_per_node
from headroom.planner.report import TrainerReport, read_report
from headroom.planner.trainable import TORCH_DTYPE, working_precision
from headroom.store import Run, utcnow

log = logging.getLogger("headroom.runs")
#: seconds between two sweeps of expired run directories (reconciliations: the settings')
SWEEP_EVERY_S = 300.0
#: seconds between two questions to the Slurm controller about one job
JOB_POLL_S = 1.0
#: how the reason of a run whose probes confirmed no plan starts
NOT_CONFIRMED = "no plan confirmed by probes"


class SupervisorSettings(RunDirSettings, Protocol):
    """What a supervisor reads of its settings (the service's ``Settings`` has them)."""

    @property
    def run_device(self) -> str: ...

    @property
    def max_running(self) -> int: ...

    @property
    def reconcile_every_s(self) -> float: ...

    @property
    def owner_timeout_s(self) -> float: ...


def this_process() -> str:
    """The owner tag of this process: host, pid and start time (a reused pid differs)."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_ticks(os.getpid())}"


def owner_alive(owner: str | None) -> bool | None:
    """Whether the process ``owner`` names still runs (None: it is on another host). An owner
    tag is ``this_process()``, and a supervisor's adds its own instance after it."""
    if not owner:
        return False
    host, _, rest = owner.partition(":")
    if host != socket.gethostname():
        return None
    pid_text, _, rest = rest.partition(":")
    ticks = rest.partition(":")[0]
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return str(process_start_ticks(pid)) == ticks


def report_of(run: Run, settings: RunDirSettings | None = None) -> TrainerReport:
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


def ending(code: int, directory: Path) -> Ending:
    """How a trainer that exited with ``code`` ended, read from its report and log in
    ``directory``: succeeded, or failed with the phase it ran out of memory in, the signal that
    killed it, or its exit code and last line of output."""
    report = read_report(directory / "report.json")
    if code == 0:
        return Ending("succeeded", f"completed {report.completed_steps} step(s)", code)
    reason = describe_exit(code)
    if code == EXIT_OOM and report.oom is not None:
        oom = report.oom
        reason = f"out of memory in {oom.phase}, step {oom.step} (exit {EXIT_OOM})"
    elif code > 0:
        try:
            lines = (directory / "log.txt").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        if lines:
            reason += f": {lines[-1][:500]}"
    return Ending("failed", reason, code)


def job_ending(job_id: str, job: slurm.JobState, directory: Path | None) -> Ending:
    """How a Slurm job that has ended ended: where the trainer's own exit is the job's (it
    completed or exited with a code), read as a process's (``ending``); else Slurm's reason
    (a signal, a time limit, a node failure, a cancellation from Slurm's side)."""
    if job.state in ("COMPLETED", "FAILED") and not job.signal and directory is not None:
        probed = read_outcome(directory)
        if probed is not None and not probed.result.fits:
            return probes_ending(probed, job.exit_code)
        return ending(job.exit_code, directory)
    status, reason = slurm.ending(job)
    if status == "cancelled":  # not through Headroom (that run is cancelled already)
        status, reason = "failed", "cancelled in Slurm (scancel, preemption or an administrator)"
    code = -job.signal if job.signal else job.exit_code
    return Ending(status, f"slurm job {job_id}: {reason}", code)


def probes_ending(probed: LadderOutcome, code: int | None) -> Ending:
    """How a run ended whose probes confirmed no plan (its reason starts ``NOT_CONFIRMED``)."""
    return Ending("failed", f"{NOT_CONFIRMED}: {probed.result.reason}", code)


#: the file in a run's directory where its trainer writes one JSON line per step
PROGRESS = "progress.jsonl"


def spec_documents(plan: RunPlan) -> dict[str, dict[str, Any]]:
    """The run's validated specs as the trainer reads them: file name -> JSON object
    (``model.json``, ``train.json``)."""
    return {
        "model.json": plan.model.model_dump(mode="json"),
        "train.json": plan.train.model_dump(mode="json"),
    }


def trainer_args(
    plan: RunPlan,
    *,
    steps: int,
    device: str,
    specs: PurePath,
    report: PurePath,
    progress: PurePath | None = None,
) -> list[str]:
    """``headroom train``'s arguments for ``plan``: the spec files in ``specs`` (as
    ``spec_documents`` names them), ``steps``, ``device`` (a CPU run simulates the planned
    card's memory), the dtype the plan trains in, the report's path and, given, where the
    trainer writes a line per step (``headroom launch`` follows it)."""
    args = [
        str(specs / "model.json"),
        "--train",
        str(specs / "train.json"),
        "--steps",
        str(steps),
        "--device",
        device,
        "--dtype",
        TORCH_DTYPE[working_precision(plan.train)],
        "--report",
        str(report),
    ]
    if progress is not None:
        args += ["--progress", str(progress)]
    if device == "cpu":  # the planned card's memory, on a simulated device
        args += ["--memory-cap", str(plan.hw.memory_bytes - plan.hw.cuda_context_bytes)]
    return args


def write_specs(plan: RunPlan, run: Run, directory: Path) -> list[str]:
    """Write the run's validated specs into its (private) directory; the trainer's arguments."""
    make_private_dir(directory)
    for name, document in spec_documents(plan).items():
        write_private(directory / name, json.dumps(document))
    return trainer_args(
        plan,
        steps=run.steps,
        device=run.device or "cpu",
        specs=directory,
        report=directory / "report.json",
        progress=directory / PROGRESS,
    )


def cpu_refusal(plan: RunPlan, run: Run) -> str | None:
    """Why a CPU run would exhaust this host's RAM (None: it will not)."""
    predicted = plan.predicted()
    return cpu_ram_refusal(
        "training",
        device=run.device or "cpu",
        gpu_peak_bytes=predicted.gpu_peak_bytes,
        host_peak_bytes=predicted.host_peak_bytes,
        cuda_context_bytes=plan.hw.cuda_context_bytes,
    )


@dataclass(eq=False)
class Child:
    """A run this supervisor started (or failed to start), kept until its ending is in the
    store: ``noted`` once the store knows its pid and log, ``ending`` once it has ended."""

    run_id: int
    directory: Path | None
    proc: subprocess.Popen[bytes] | None = None
    logfile: IO[bytes] | None = None
    backend: str = "local"
    noted: bool = True
    ending: Ending | None = None
    job_id: str | None = None  # a Slurm job's (watched through the controller, not a process)
    next_poll: float = 0.0  # when the controller is asked about the job next (monotonic)
    unreachable: str | None = None  # why the controller did not answer last (logged once)
    #: the run is confirmed by probes first: ``proc`` is its probe process (``probe_process``),
    #: or its Slurm job runs that before the trainer
    probing: bool = False
    probes_exit: int | None = None  # how the probe process ended (its trainer is next)
    probes_recorded: bool = False  # a probing job's probes are in the store

    def poll(self) -> None:
        """Learn whether the trainer (or the probe process) has ended, and how (a trainer's
        ending is kept in its directory at once)."""
        if self.ending is None and self.job_id is not None:
            self._poll_job(self.job_id)
            return
        if self.ending is not None or self.proc is None or self.probes_exit is not None:
            return
        code = self.proc.poll()
        if code is None:
            return
        if self.logfile is not None:
            self.logfile.close()
        if self.probing:
            self.probes_exit = code  # what follows is the supervisor's (``_after_probes``)
            return
        assert self.directory is not None  # a started trainer has its directory
        self.ending = ending(code, self.directory)
        save_ending(self.directory, self.ending)

    def _poll_job(self, job_id: str) -> None:
        """Ask the controller about the job (at most every ``JOB_POLL_S``); an unreachable
        controller is asked again later (logged when it stops answering and when it answers
        again, not at every poll)."""
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + JOB_POLL_S
        try:
            job = slurm.job_state(job_id)
        except slurm.SlurmError as exc:
            if self.unreachable != str(exc):
                log.warning("slurm job %s of run %d: %s", job_id, self.run_id, exc)
            self.unreachable = str(exc)
            return
        if self.unreachable is not None:
            log.info("slurm job %s of run %d: the controller answers again", job_id, self.run_id)
            self.unreachable = None
        if job is None:
            self.ending = Ending(
                "failed",
                f"slurm job {job_id} is gone and the controller kept no record of its end "
                "(no accounting)",
                None,
            )
        elif job.state in slurm.ENDED:
            self.ending = job_ending(job_id, job, self.directory)
        else:
            return
        save_ending(self.directory, self.ending)


class Supervisor:
    """Launches queued runs and watches them (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], settings: SupervisorSettings) -> None:
        self.sessions = sessions
        self.settings = settings
        # the process and this supervisor in it: another supervisor in the same process (a
        # test's, a second app's) is alive, so it leaves this one's runs alone, and vice versa
        self.owner = f"{this_process()}:{secrets.token_hex(4)}"
        self.children: dict[int, Child] = {}
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.device: str | None = None
        self.outage = False  # the database could not be reached at the last attempt
        self._recovered = False  # ... and has been reached since: reconcile again
        self._failures: dict[str, str] = {}  # per step, the error last logged

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
        for child in self.children.values():
            child.poll()  # one that ended by itself keeps its own ending
        # a Slurm job runs on the cluster, not in this service: it keeps running, and the next
        # supervisor to reconcile takes it over
        jobs = [c for c in self.children.values() if c.job_id is not None and c.ending is None]
        for child in jobs:
            del self.children[child.run_id]
        if jobs:
            log.info(
                "%d slurm job(s) keep running; the next supervisor to start watches them",
                len(jobs),
            )
        for child in self.children.values():
            if child.probes_exit is not None and child.ending is None:
                # its probes ended (or died with the loop's thread); its trainer never starts
                child.ending = Ending(
                    "failed", "stopped: the service shut down while it probed", child.probes_exit
                )
                save_ending(child.directory, child.ending)
        running = [c for c in self.children.values() if c.proc is not None and c.ending is None]
        end_process_groups([c.proc for c in running if c.proc is not None], grace_s=5)
        for child in running:
            assert child.proc is not None
            child.proc.wait()
            if child.logfile is not None:
                child.logfile.close()
            what = "probed" if child.probing else "ran"
            child.ending = Ending(
                "failed", f"stopped: the service shut down while it {what}", child.proc.returncode
            )
            save_ending(child.directory, child.ending)
        if not self._guarded(self.tick_children, only_outages=True) and self.children:
            log.warning(
                "the endings of %d run(s) are kept in their directories; the next supervisor "
                "to start records them",
                len(self.children),
            )

    def _loop(self, interval_s: float) -> None:
        reconciled = swept = beat = -float("inf")
        wait = 0.0  # the runs a stopped service left running come first
        while not self.stop.wait(wait):
            now = time.monotonic()
            if now - beat >= self.settings.owner_timeout_s / 3:
                self._guarded(self._heartbeat_step)
                beat = now
            if now - reconciled >= self.settings.reconcile_every_s or self._recovered:
                self._recovered = False
                self._guarded(self._reconcile_step)
                reconciled = now
            if now - swept >= SWEEP_EVERY_S:
                self._guarded(self._sweep_step)
                swept = now
            wait = interval_s if self._guarded(self._tick_step) else max(interval_s, 1.0)

    def _guarded(self, step: Callable[[], bool], only_outages: bool = False) -> bool:
        """Run one step of the loop; False if it failed. A database that cannot be reached is
        logged once when it goes (one line) and once when a step reaches it again (``step``
        returns whether it used the database); another error's traceback is logged once, not
        again while the same step fails the same way (``only_outages``: it is raised)."""
        name = getattr(step, "__name__", "step")
        try:
            used_database = step()
        except Exception as exc:
            if only_outages and not store.unavailable(exc):
                raise
            if store.unavailable(exc):
                if not self.outage:
                    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
                    log.warning(
                        "database unreachable (%s); trainers are watched and how they end is "
                        "recorded when it returns",
                        reason[0] if reason else type(exc).__name__,
                    )
                self.outage = True
            else:
                failure = f"{type(exc).__name__}: {exc}"
                if self._failures.get(name) != failure:  # e.g. a database not yet migrated
                    log.exception("run supervisor step %s failed", name)
                self._failures[name] = failure
            return False
        self._failures.pop(name, None)
        if used_database and self.outage:
            self.outage, self._recovered = False, True
            pending = sum(c.ending is not None for c in self.children.values())
            log.info("database reachable again; %d run ending(s) to record", pending)
        return True

    def _tick_step(self) -> bool:
        return self.tick()

    def _heartbeat_step(self) -> bool:
        with self.sessions() as session:
            transitions.heartbeat(session, self.owner)
        return True

    def _reconcile_step(self) -> bool:
        self.reconcile()
        return True

    def _sweep_step(self) -> bool:
        if self.settings.run_retention_days is None:
            return False
        with self.sessions() as session:
            removed = remove_expired(session, self.settings, keep=set(self.children))
        if removed:
            log.info(
                "removed %d run directories of runs that ended over %g day(s) ago",
                removed,
                self.settings.run_retention_days,
            )
        return True

    def tick(self) -> bool:
        """Record children that ended, then start queued runs up to the limit; whether the
        store was asked. With every place taken and nothing to record it is not: such a tick
        says nothing of whether the database is back (``_guarded``)."""
        used = self.tick_children()
        while len(self.children) < self.settings.max_running:
            used = True
            if not self._start_next():
                break
        return used

    def tick_children(self) -> bool:
        """Record each child's start and, once it ended, how it ended; a child is forgotten only
        once its ending is in the store (a write that fails is tried again next tick). Whether
        the store was written."""
        wrote = False
        for child in self.children.values():  # every ending is learnt (and kept) before a write
            child.poll()
        for child in list(self.children.values()):
            if not child.noted:
                with self.sessions() as session:
                    self._note_started(session, child)
                wrote = True
            if child.probes_exit is not None and child.ending is None:
                with self.sessions() as session:
                    self._after_probes(session, child)
                wrote = True
            elif child.job_id is not None and child.probing and not child.probes_recorded:
                probed = read_outcome(child.directory) if child.directory else None
                if probed is not None:  # the job's probes ended; its trainer runs next
                    with self.sessions() as session:
                        self._record_probes(session, child.run_id, probed)
                    child.probes_recorded = True
                    wrote = True
            if child.ending is not None:
                with self.sessions() as session:
                    self._record(session, child)
                wrote = True
        return wrote

    def _note_started(self, session: Session, child: Child) -> None:
        """Tell the store the child's pid (or job id) and log; a run cancelled meanwhile has its
        trainer ended."""
        assert child.directory is not None
        if child.job_id is not None:
            submitted = transitions.note_submitted(
                session,
                child.run_id,
                job_id=child.job_id,
                log_path=str(child.directory / "log.txt"),
            )
            child.noted = True
            if not submitted and child.ending is None:
                _scancel(child.job_id)  # cancelled between the claim and the submission
            return
        assert child.proc is not None
        if child.probing:
            started = transitions.note_probing(
                session, child.run_id, pid=child.proc.pid, log_path=str(child.directory / "log.txt")
            )
        else:
            started = transitions.note_started(
                session,
                child.run_id,
                pid=child.proc.pid,
                log_path=str(child.directory / "log.txt"),
                backend=child.backend,
            )
        child.noted = True
        if not started and child.ending is None:
            end_process_group(child.proc)  # cancelled between the claim and the start
            child.poll()

    def _record(self, session: Session, child: Child) -> None:
        """Write the child's ending, and forget the child."""
        assert child.ending is not None
        finished = transitions.finish(
            session,
            child.run_id,
            status=child.ending.status,
            reason=child.ending.reason,
            exit_code=child.ending.exit_code,
        )
        if not finished and child.proc is not None:
            # cancelled meanwhile: the run stays cancelled, with how its trainer ended
            transitions.note_exit(session, child.run_id, exit_code=child.ending.exit_code)
        del self.children[child.run_id]

    # -- starting ---------------------------------------------------------------------------
    def _start_next(self) -> bool:
        with self.sessions() as session:
            run_id = transitions.next_queued(session)
            if run_id is None:
                return False
            if not self._claim(session, run_id, self.settings.max_running):
                # another worker took it (look again), or the replicas run all they may
                return self._running(session) < self.settings.max_running
            run = session.get(Run, run_id)
            assert run is not None
            session.refresh(run)
            self.launch(session, run)
            return True

    def _claim(self, session: Session, run_id: int, max_running: int | None = None) -> bool:
        """queued → running, owned by this supervisor; False if another claimed it first (or,
        with ``max_running``, that many run already on the database)."""
        if self.device is None:
            self.device = resolve_device(self.settings.run_device)
        return transitions.claim(
            session, run_id, owner=self.owner, device=self.device, max_running=max_running
        )

    @staticmethod
    def _running(session: Session) -> int:
        """Runs running on the database, whoever supervises them."""
        return session.scalar(select(func.count()).where(Run.status == "running")) or 0

    def _fail(self, session: Session, run: Run, reason: str, directory: Path | None) -> None:
        """End a run that could not start; kept as a child until the store has its ending."""
        failed = Ending("failed", reason, None)
        self.children[run.id] = child = Child(run.id, directory, ending=failed)
        save_ending(directory, failed)
        self._record(session, child)

    def launch(self, session: Session, run: Run, plan: RunPlan | None = None) -> None:
        """Start a claimed run's trainer, or its probes where it asked for them (or end the
        run with the reason it cannot start); ``plan`` is the run's, where the caller has it
        validated already."""
        directory: Path | None = None
        try:
            plan = plan or plan_of(run)
            # a job runs on the cluster's nodes, whose RAM this host cannot see (its probes
            # check the node's)
            refusal = cpu_refusal(plan, run) if run.backend != "slurm" else None
            if refusal is not None:
                self._fail(session, run, refusal, directory)
                return
            directory = run_dir(self.settings, run)
            args = write_specs(plan, run, directory)
            probing = bool(run.plan.get("probe")) and not run.plan.get("probes")
            if probing:
                write_private(directory / HARDWARE_FILE, plan.hw.model_dump_json())
            if run.backend == "slurm":
                self._submit(session, run, plan, args, directory, probing=probing)
                return
            if probing:
                self._start_probes(session, run, directory)
                return
        except (OSError, ValueError, planner.HeadroomError) as exc:
            self._fail(session, run, f"could not start: {exc}", directory)
            return
        self._start_trainer(session, run, plan, args, directory)

    def _start_trainer(
        self, session: Session, run: Run, plan: RunPlan, args: list[str], directory: Path
    ) -> None:
        """Start the run's trainer through its launcher backend, output into its log."""
        try:
            backend = launcher(run.backend, plan.train.parallel.dp)
            logfile = open_log(directory / "log.txt")  # closed when the child is reaped
        except (OSError, ValueError) as exc:
            self._fail(session, run, f"could not start: {exc}", directory)
            return
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if plan.train.expandable_segments:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        try:
            proc = backend.start(args, logfile, directory, env)
        except OSError as exc:
            logfile.close()
            self._fail(session, run, f"could not start: {exc}", directory)
            return
        child = Child(run.id, directory, proc, logfile, backend=backend.name, noted=False)
        self.children[run.id] = child  # before any write: a failed one is tried again
        self._note_started(session, child)

    def _start_probes(self, session: Session, run: Run, directory: Path) -> None:
        """Start the run's probe process (``probe_process``): the run's child as its trainer
        is (its own process group, which a cancel ends; output into the run's log), bound to
        this process (``die_with_parent``: it and its probes die with the service, even a
        SIGKILLed one), its temporary files inside the run's directory. Its end is learnt by
        ``tick_children``; the loop goes on meanwhile."""
        scratch = directory / SCRATCH
        make_private_dir(scratch)
        logfile = open_log(directory / "log.txt")  # closed when the child is reaped
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(scratch)}
        try:
            # started from the thread that watches it (the death signal follows the thread)
            proc = subprocess.Popen(
                probe_process_argv(directory, run.device or "cpu"),
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                cwd=directory,
                env=env,
                start_new_session=True,
                umask=TRAINER_UMASK,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        except OSError as exc:
            logfile.close()
            self._fail(session, run, f"could not start its probes: {exc}", directory)
            return
        child = Child(run.id, directory, proc, logfile, noted=False, probing=True)
        self.children[run.id] = child  # before any write: a failed one is tried again
        self._note_started(session, child)

    def _after_probes(self, session: Session, child: Child) -> None:
        """The run's probe process ended: record its probes while the run is still running
        (a cancelled run keeps nothing of them), then start the trainer on the plan they
        confirmed, or end the run saying why there is none."""
        assert child.directory is not None and child.probes_exit is not None
        code = child.probes_exit
        run = session.get(Run, child.run_id)
        assert run is not None
        session.refresh(run)
        probed = read_outcome(child.directory)
        if run.status != "running" or probed is None:
            child.ending = Ending("failed", f"probes ended: {describe_exit(code)}", code)
        elif not self._record_probes(session, run.id, probed):
            child.ending = Ending("failed", "probes ended: the run was no longer running", code)
        elif code != 0 or not probed.result.fits:
            child.ending = probes_ending(probed, code)
        else:
            self._after_confirmed(session, child, run, probed)
            return
        save_ending(child.directory, child.ending)

    def _after_confirmed(
        self, session: Session, child: Child, run: Run, probed: LadderOutcome
    ) -> None:
        """Start the trainer of a run whose probes confirmed a plan (now the run's)."""
        assert child.directory is not None
        del self.children[child.run_id]
        session.refresh(run)
        plan = plan_of(run)
        try:
            confirmed = RunPlan.of_fit(plan.model, probed.result.fit, plan.hw, plan.train)
            args = write_specs(confirmed, run, child.directory)
        except (OSError, ValueError) as exc:
            self._fail(session, run, f"could not start: {exc}", child.directory)
            return
        self._start_trainer(session, run, confirmed, args, child.directory)

    def _record_probes(self, session: Session, run_id: int, probed: LadderOutcome) -> bool:
        """Store a running run's probes: each that measured something as a calibration, all
        of them and the plan they confirmed in the run's plan; False if the run is no longer
        running (nothing is stored then)."""
        from headroom.launch.recording import probe_recorder

        run = session.get(Run, run_id)
        assert run is not None
        session.refresh(run)
        if run.status != "running":
            return False
        plan = plan_of(run)
        record = probe_recorder(self.sessions, plan.model, plan.hw)
        result = probed.result
        for made, train in zip(result.probes, probed.probed, strict=True):
            budget = planner.estimate(plan.model, train, plan.hw)
            made.calibration_uid = record(train, budget, made.outcome)
        stored = {**run.plan, "probes": [p.model_dump(mode="json") for p in result.probes]}
        if result.fits and result.plan is not None:
            stored["train"] = result.plan
        return transitions.record_probes(session, run, stored)

    def _submit(
        self,
        session: Session,
        run: Run,
        plan: RunPlan,
        args: list[str],
        directory: Path,
        probing: bool = False,
    ) -> None:
        """Submit a claimed run as a Slurm batch job (its allocation: ``HEADROOM_SLURM_*`` with
        the run's own over them; ``parallel.dp`` ranks over its nodes), output into the run's
        log; watched from then on. With ``probing`` the job runs the run's probes on its node
        first (``probe_process``), and its trainer on the plan they confirmed."""
        overrides = slurm.SlurmOverrides.model_validate(run.plan.get("slurm") or {})
        nodes = overrides.nodes
        try:
            ranks = ranks_per_node(plan.train.parallel.dp, nodes)
        except planner.SpecError as exc:
            self._fail(session, run, f"could not submit: {exc}", directory)
            return
        settings = overrides.applied(from_environment(slurm.SlurmSettings))
        settings = settings.model_copy(update={"ranks_per_node": ranks})
        script = directory / "job.sbatch"
        write_private(
            script,
            slurm.batch_script(
                args,
                job_name=f"headroom-{run.uid}",
                log=directory / "log.txt",
                nodes=nodes,
                settings=settings,
                python=sys.executable,
                chdir=directory,
                first=(
                    probe_process_argv(directory, run.device or "cpu", python=sys.executable)
                    if probing
                    else None
                ),
            ),
        )
        try:
            job_id = slurm.submit(script)
        except slurm.SlurmError as exc:
            self._fail(session, run, f"could not submit: {exc}", directory)
            return
        child = Child(
            run.id, directory, backend="slurm", noted=False, job_id=job_id, probing=probing
        )
        self.children[run.id] = child  # before any write: a failed one is tried again
        self._note_started(session, child)

    def run_now(self, run_id: int, plan: RunPlan | None = None, poll_s: float = 0.2) -> Run:
        """Claim, start and wait for one queued run in the foreground (``headroom launch``),
        ``plan`` being its validated plan; an interrupt cancels it, ending its process group.
        A database that goes away meanwhile is waited for, as the service's supervisor does."""
        with self.sessions() as session:
            claimed = self._claim(session, run_id)
            claimed_run = session.get(Run, run_id)
            assert claimed_run is not None
            if claimed:
                session.refresh(claimed_run)

                def start() -> bool:
                    self.launch(session, claimed_run, plan)
                    return True

                self._guarded(start, only_outages=True)
        try:
            beat = time.monotonic()
            while run_id in self.children:
                self.stop.wait(poll_s)
                self._guarded(self.tick_children, only_outages=True)
                if time.monotonic() - beat >= self.settings.owner_timeout_s / 3:
                    self._guarded(self._heartbeat_step, only_outages=True)
                    beat = time.monotonic()
        except KeyboardInterrupt:
            self._guarded(lambda: self._cancel_own(run_id), only_outages=True)
            child = self.children.get(run_id)
            if child is not None and child.job_id is not None and child.ending is None:
                _scancel(child.job_id)  # its end (CANCELLED) is watched for a while
                deadline = time.monotonic() + 30
                while child.ending is None and time.monotonic() < deadline:
                    self.stop.wait(poll_s)
                    child.poll()
            if child is not None and child.proc is not None:
                # our own child: end its group here, and wait for it (reaped there: gone as
                # soon as it exits)
                end_process_group(child.proc)
                child.proc.wait()
            # once: if the database is away, the ending stays in the run's directory
            self._guarded(self.tick_children, only_outages=True)
        with self.sessions() as session:
            run = session.get(Run, run_id)
            assert run is not None
            return run

    def _cancel_own(self, run_id: int) -> bool:
        with self.sessions() as session:
            run = session.get(Run, run_id)
            if run is not None:
                cancel(session, run, end_group=False)
        return True

    # -- restarts ---------------------------------------------------------------------------
    def reconcile(self) -> int:
        """End the runs left ``running`` by a stopped supervisor, or claimed by this one and
        lost (never in ``children``); how many were ended."""
        ended = 0
        with self.sessions() as session:
            for run in session.scalars(select(Run).where(Run.status == "running")):
                if run.id in self.children:
                    continue
                supervised = owner_alive(run.owner) if run.owner != self.owner else False
                if supervised is None and run.job_id is not None and self._silent(run):
                    supervised = False  # a supervisor on another host that stopped beating
                if supervised is not False:
                    continue
                if run.job_id is not None:
                    self._adopt(session, run)
                    continue
                alive = _ours(run)
                if alive:
                    end_process_group(run.pid or 0)
                status, reason, code = self._lost_ending(run, alive)
                ended += transitions.finish(
                    session, run.id, status=status, reason=reason, exit_code=code
                )
        return ended

    def _silent(self, run: Run) -> bool:
        """Whether the run's supervisor has not beaten for ``owner_timeout_s`` (a run from
        before heartbeats has none: judged silent only by its last change)."""
        seen = run.owner_seen_at or run.updated_at
        if seen is None:
            return False
        since = store.as_utc(seen)
        assert since is not None
        age = (utcnow() - since).total_seconds()
        return age > self.settings.owner_timeout_s

    def _adopt(self, session: Session, run: Run) -> None:
        """Watch the Slurm job of a run whose supervisor is gone (or lost it), if no other
        supervisor took it first; an ending its supervisor kept is recorded at once."""
        if not transitions.adopt(session, run.id, owner=run.owner, by=self.owner):
            return
        assert run.job_id is not None
        try:
            directory: Path | None = run_dir(self.settings, run)
        except ValueError:
            directory = None
        kept = read_ending(directory) if directory is not None else None
        # a job that probes first: its probes are recorded once they end, as by its submitter
        probing = bool(run.plan.get("probe")) and not run.plan.get("probes")
        self.children[run.id] = Child(
            run.id, directory, backend="slurm", job_id=run.job_id, ending=kept, probing=probing
        )
        log.info("run %d: watching slurm job %s, which its supervisor left", run.id, run.job_id)

    def _lost_ending(self, run: Run, alive: bool) -> tuple[str, str, int | None]:
        """How a run whose supervisor is gone (or lost it) ended: the ending its supervisor
        kept, else what its report and the trainer's state say."""
        try:
            kept = read_ending(run_dir(self.settings, run))
        except ValueError:
            kept = None
        if kept is not None:
            return kept.status, kept.reason, kept.exit_code
        if run.owner == self.owner:  # claimed here, then the database failed before it started
            return "failed", "could not start: the database failed while it started", None
        report = report_of(run, self.settings)
        if not alive and report.losses and report.oom is None:
            reason = f"completed {report.completed_steps} step(s) while its service was down"
            return "succeeded", reason, None
        return (
            "failed",
            "orphaned: the service supervising it stopped; the trainer was ended"
            if alive
            else "orphaned: the service supervising it stopped and the trainer is gone; its "
            "exit status was lost",
            None,
        )


def cancel(session: Session, run: Run, end_group: bool = True) -> Run:
    """Cancel a queued or running run; a running one's whole process group is ended (in the
    background; ``end_group=False`` leaves that to a caller that owns the process)."""
    was_running = run.status == "running"
    cancelled = transitions.cancel(session, run)
    if cancelled and was_running and run.job_id is not None:
        # a job is Slurm's to end, whoever submitted it
        threading.Thread(
            target=_scancel, args=(run.job_id,), name="headroom-scancel", daemon=True
        ).start()
    elif cancelled and end_group and was_running and _ours(run):
        threading.Thread(
            target=end_process_group, args=(run.pid,), name="headroom-cancel", daemon=True
        ).start()
    return run


def _scancel(job_id: str) -> None:
    """Cancel a Slurm job; a controller that refuses is logged (the job's end is watched)."""
    try:
        slurm.cancel(job_id)
    except slurm.SlurmError as exc:
        log.warning("scancel of slurm job %s failed: %s", job_id, exc)
