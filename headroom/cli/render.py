"""Text rendering of budgets for people (rich tables)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from headroom.planner.budget import GPU_BUCKETS, PHASES, Budget
from headroom.planner.comparison import Comparison
from headroom.planner.estimator import StagePeak
from headroom.planner.explanation import Explanation
from headroom.planner.schedules import V_SHAPED
from headroom.planner.train import TrainSpec
from headroom.planner.units import format_bytes

_GIB = 2**30
_SHORT = {
    "step1_forward": "s1 fwd",
    "step1_backward": "s1 bwd",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "optim",
}


def _fmt(value: int | None) -> str:
    return "—" if value is None else format_bytes(value)


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f}"


def assumptions(train: TrainSpec) -> str:
    """What the estimate assumed, on one line: batch, layout, framework, recompute (and
    compiled layers), precision, optimizer and offload."""
    par, prec = train.parallel, train.precision
    layout = f"DP {par.dp} (ZeRO {par.zero_stage}), TP {par.tp}"
    layout += " with sequence parallel" if par.sequence_parallel else ""
    layout += f", PP {par.pp}" + (f" x {par.vpp} virtual" if par.vpp > 1 else "")
    if par.pp > 1 and par.pp_schedule is not None:
        layout += f" ({par.pp_schedule}"
        if par.pp_schedule in V_SHAPED:
            layout += ", in a V: the first stage holds the embedding and the head"
        layout += ")"
    layout += f", CP {par.cp}, EP {par.ep}"
    recompute = train.recompute if isinstance(train.recompute, str) else "every_k"
    offload: str = train.offload.mode
    if offload == "optimizer":
        offload = f"optimizer {train.offload.fraction:g}"
    return (
        f"assumed: micro-batch {train.micro_batch_size} x {train.seq_len:,} tokens, "
        f"grad accumulation {train.grad_accum_steps}; {layout}; framework {train.framework}; "
        f"recompute {recompute}, attention {train.attention}, loss {train.loss.priced_impl}"
        f"{', compiled layers' if train.compile else ''}; "
        f"precision params {prec.params} / grads {prec.grads} / master {prec.master} / "
        f"optimizer {prec.optimizer_states}; {train.optimizer} ({train.optimizer_impl}); "
        f"offload {offload}; activation profile {train.activation_profile}"
    )


def _host_line(budget: Budget, train: TrainSpec | None) -> str:
    host = budget.host
    n = host.ranks_sharing
    text = f"host RAM {format_bytes(host.peak_bytes)} for {n} rank{'' if n == 1 else 's'} of a node"
    if host.capacity_bytes is None:
        text += " (no host memory given: not checked)"
    else:
        text += f" of {format_bytes(host.capacity_bytes)}"
    if train is not None and n == 1:
        par = train.parallel
        if par.dp * par.tp * par.pp * par.cp > 1:
            text += "; --gpus-per-node counts the ranks a node's host RAM holds"
    return text


def render_budget(
    budget: Budget,
    console: Console,
    stages: Sequence[StagePeak] = (),
    train: TrainSpec | None = None,
) -> None:
    """A per-phase table of GPU buckets, the host buckets, and the verdict; with ``stages``
    (a pipeline's end stages, ``planner.estimator.stage_peaks``) a line per stage, since a
    run's log may be one rank's (Megatron-LM logs the last stage's); with ``train`` a line of
    what the estimate assumed."""
    gpu = budget.gpu
    where = f", pipeline stage {budget.stage} (the heaviest)" if len(stages) > 1 else ""
    table = Table(title=f"{budget.model.name} on {gpu.name}{where}: GiB per phase (* = peak)")
    table.add_column("bucket", no_wrap=True)
    for phase in PHASES:
        mark = "*" if phase == budget.peak_phase else ""
        table.add_column(
            _SHORT[phase] + mark, justify="right", no_wrap=True, style="bold" if mark else ""
        )
    table.add_column("host", justify="right", no_wrap=True)
    for bucket in GPU_BUCKETS:
        cells = [_gib(gpu.phases[p].buckets[bucket]) for p in PHASES]
        host_value = budget.host.buckets.get(bucket)
        table.add_row(bucket, *cells, "" if host_value is None else _gib(host_value))
    table.add_section()
    table.add_row(
        "total", *[_gib(gpu.phases[p].total_bytes) for p in PHASES], _gib(budget.host.peak_bytes)
    )
    console.print(table)
    verdict = "[green]fits[/green]" if budget.fits else "[red]does not fit[/red]"
    console.print(
        f"GPU peak {format_bytes(gpu.peak_bytes)} in {budget.peak_phase}, as nvidia-smi shows "
        f"it (allocated {format_bytes(gpu.allocated_peak_bytes)}, reserved "
        f"{format_bytes(gpu.reserved_peak_bytes)}) "
        f"of {format_bytes(gpu.capacity_bytes)} (headroom {format_bytes(gpu.headroom_bytes)}, "
        f"margin {format_bytes(budget.margin_bytes)}); {_host_line(budget, train)}: {verdict}"
    )
    if train is not None:
        console.print(assumptions(train), markup=False, highlight=False)
    for peak in stages if len(stages) > 1 else ():
        console.print(
            f"pipeline stage {peak.stage}: {format_bytes(peak.peak_bytes)} in {peak.phase} "
            f"(allocated {format_bytes(peak.allocated_bytes)}, reserved "
            f"{format_bytes(peak.reserved_bytes)})"
        )
    coeffs = budget.coefficients
    state = "calibrated" if coeffs.calibrated else "uncalibrated"
    console.print(f"coefficients: {coeffs.profile} ({state}; {coeffs.source})")
    for warning in budget.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")


def render_explanations(explanations: dict[str, Explanation], console: Console) -> None:
    """One block per bucket: bytes, formula, inputs, source."""
    table = Table(title="How each bucket was computed (at the peak phase)", show_lines=True)
    for column in ("bucket", "bytes", "formula", "inputs", "source"):
        table.add_column(column, overflow="fold")
    for name, e in explanations.items():
        inputs = ", ".join(f"{k}={v}" for k, v in e.inputs.items())
        table.add_row(name, format_bytes(e.bytes), e.formula, inputs, e.source)
    console.print(table)


def render_comparison(comparisons: list[Comparison], console: Console) -> None:
    """One row per (framework, activation profile): the peak, its phase, the verdict, and the
    keys the framework fixed (or why the pair cannot run the configuration)."""
    table = Table(title="The same configuration under each framework and model code")
    for column in ("framework", "model code", "GPU peak", "phase", "fits", "note"):
        table.add_column(column, overflow="fold")
    for c in comparisons:
        if c.error is not None:
            table.add_row(c.framework, c.activation_profile, "—", "—", "—", c.error)
            continue
        note = ", ".join(f"{k}={v}" for k, v in c.changed.items())
        fits = "yes" if c.fits else "[red]no[/red]"
        table.add_row(
            c.framework, c.activation_profile, _fmt(c.gpu_peak_bytes), c.peak_phase, fits, note
        )
    console.print(table)


def recompute_text(recompute: object) -> str:
    """A recompute policy as a person reads it: its name, or "every K layers"."""
    if isinstance(recompute, dict):
        k = recompute.get("every_k")
        return f"every {k} layers" if k else "blocks"
    return str(recompute)


def offload_text(offload: dict[str, Any] | str) -> str:
    """An offload placement (its mode, or the spec's offload object) as a person reads it,
    not a dict's repr."""
    if isinstance(offload, str):
        return offload
    mode = offload.get("mode", "none")
    if mode == "optimizer":
        return f"optimizer ({offload.get('fraction', 1.0):g} of its state in host RAM)"
    if mode == "streaming":
        every = offload.get("checkpoint_every") or 1
        buffers = offload.get("num_buffers")
        return f"streaming (checkpoint every {every}" + (
            f", {buffers} buffers)" if buffers else ")"
        )
    return str(mode)


def changes_text(changes: dict[str, Any]) -> str:
    """The keys a candidate changed, ``key=value`` each, or "none"."""
    if not changes:
        return "none"
    shown = []
    for key, value in changes.items():
        if key == "offload" and isinstance(value, dict):
            value = offload_text(value)
        elif key == "recompute":
            value = recompute_text(value)
        shown.append(f"{key}={value}")
    return ", ".join(shown)
