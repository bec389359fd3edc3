"""The loss implementations that run on a CPU, traced to the byte (``TrainSpec.loss.impl``).

``planner.losses`` derives each implementation's bytes from its source. Three of them are
plain torch and run here, under ``FakeTensorMode`` (no memory is allocated, so a Llama 3
vocabulary and sequence trace in a second) and PyTorch's ``MemTracker``, as the calibration's
step traces run (``calibration.tracing``):

- ``chunked``: torchtune 0.6.1's flow, op for op (torchtune is not a dependency): the model's
  ``chunked_output`` (the head on each ``torch.chunk`` of the sequence), the recipe's loss
  call and ``del logits``, and ``CEWithChunkedOutputLoss.forward``
  (``torchtune/modules/loss/ce_chunked_output_loss.py``: ``F.cross_entropy(chunk.float(),
  labels, reduction="sum")`` a chunk at a time); ``tests/calibration/test_loss_traces.py`` runs
  torchtune's own class too where torchtune is installed;
- ``chunked_linear``: torchtitan's own ``ChunkedLossWrapper`` with its ``CrossEntropyLoss``,
  and the trainer's ``del pred``;
- ``fused``: Megatron-Core's own ``fused_vocab_parallel_cross_entropy`` on a fake process
  group, run eagerly (``torch.compile``'s kernels escape a memory tracker); what the compiled
  backward allocates besides is read from inductor's code (``fused_backward_buffers``).

``compiled`` (torchtitan's ``cross_entropy_loss`` under ``torch.compile``) runs compiled on a
CPU for real, small: what its forward saves is seen by a saved-tensor hook, what its backward
allocates is read from inductor's code (``compiled_loss_buffers``).

A trace stands the head's input in for the final norm's output (a product of the layers' output,
saved by nothing but the head), the head as ``F.linear`` on a weight (the tracker's module
hooks would hold a module's input gradients, which a real run does not), and reports what the
planner's two loss terms price: the bytes held once the loss's forward is done, beyond the
head's input, and the largest moment beyond those (its forward's or its backward's). Each
tensor counts its bytes, not the allocator's 512-byte blocks, so that a derivation is checked to
the byte: the few scalars a loss makes (its value, a count) are all it leaves out.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools import mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker

from headroom.planner.losses import LossShape

#: the implementations this module runs
TRACED = ("chunked", "chunked_linear", "fused")


class LossTrace(NamedTuple):
    """What a traced loss held, beyond the head's input and weight (bytes)."""

    held: int  # once the loss's forward is done (and the stack dropped what it drops)
    beyond: int  # its largest moment, less ``held``


@contextlib.contextmanager
def _exact_sizes() -> Iterator[None]:
    """The tracker counts each storage's bytes rather than rounding it up to the CUDA
    allocator's 512-byte block (``mem_tracker._PYTORCH_MIN_ALLOCATE``)."""
    saved = mem_tracker._PYTORCH_MIN_ALLOCATE
    mem_tracker._PYTORCH_MIN_ALLOCATE = 1
    try:
        yield
    finally:
        mem_tracker._PYTORCH_MIN_ALLOCATE = saved


def _total(tracker: MemTracker, kind: str) -> int:
    snapshot = tracker.get_tracker_snapshot(kind)
    return sum(v for per in snapshot.values() for k, v in per.items() if k != "Total")


def torchtune_chunked_loss(
    logits: list[torch.Tensor], labels: torch.Tensor, chunks: int
) -> torch.Tensor:
    """torchtune 0.6.1's ``CEWithChunkedOutputLoss.forward`` (``ignore_index`` -100), op for
    op."""
    total_elements = (labels != -100).sum()
    label_chunks = [c.reshape(-1) for c in labels.chunk(chunks, dim=1)]
    logit_chunks = [c.reshape(-1, c.size(-1)) for c in logits]
    total_loss: Any = 0.0
    for logit_chunk, label_chunk in zip(logit_chunks, label_chunks, strict=True):
        total_loss += F.cross_entropy(
            logit_chunk.float(), label_chunk, ignore_index=-100, reduction="sum"
        )
    out: torch.Tensor = total_loss / total_elements
    return out


def trace_loss(
    impl: str,
    shape: LossShape,
    chunks: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    loss_class: Any = None,
) -> LossTrace:
    """One micro-batch's head and loss of ``impl`` (one of ``TRACED``), forward and backward.
    ``loss_class``: for ``chunked``, torchtune's own ``CEWithChunkedOutputLoss`` in place of
    ``torchtune_chunked_loss``. Needs torchtitan for ``chunked_linear`` and Megatron-Core for
    ``fused``."""
    if impl not in TRACED:
        raise ValueError(f"impl: {impl!r} does not run on a CPU; traced: {', '.join(TRACED)}")
    rows, seq, hidden, vocab, _ = shape
    group: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if impl == "fused":
        from headroom.calibration import megatron

        megatron.require_megatron()
        group = megatron.one_rank(1)
    with _exact_sizes(), group, torch.compiler.set_stance("force_eager"), FakeTensorMode():
        weight = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=dtype))
        tracker = MemTracker()
        tracker.track_external(weight)
        with tracker:
            # Megatron's layout is [sequence, batch, hidden]
            layout = (seq, rows, hidden) if impl == "fused" else (rows, seq, hidden)
            base = torch.empty(layout, dtype=dtype, requires_grad=True)
            labels = torch.randint(0, vocab, layout[:2])
            start = _total(tracker, "current")
            input_bytes = base.numel() * base.element_size()
            loss = _loss(impl, base, weight, labels, chunks, loss_class)
            held = _total(tracker, "current") - start - input_bytes
            torch.autograd.backward(loss)
            peak = _total(tracker, "peak") - start - input_bytes
    return LossTrace(held, peak - held)


def _loss(
    impl: str,
    base: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunks: int,
    loss_class: Any,
) -> torch.Tensor:
    """The stack's head and loss on the head's input, a product of ``base`` that lives as long
    as the stack keeps it: torchtune's model returns its logits and drops its hidden states
    (each chunk's head keeps its input: views of them, or with more than one sequence
    contiguous copies), torchtitan's trainer drops ``pred`` once the loss returns, Megatron's
    output layer keeps its input."""
    head_input = base * 1.0
    if impl == "chunked":
        logits = [F.linear(c, weight) for c in head_input.chunk(chunks, dim=1)]
        del head_input  # the model's forward returns
        if loss_class is None:
            loss = torchtune_chunked_loss(logits, labels, chunks)
        else:  # the module's forward: the tracker's module hooks would hold its inputs' grads
            loss = loss_class(chunks).forward(logits, labels)
        del logits  # the recipe's: "free logits otherwise it peaks backward memory"
        return loss
    if impl == "chunked_linear":
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

        config = ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=CrossEntropyLoss.Config())
        wrapper = ChunkedLossWrapper(config)
        wrapper.set_lm_head(lambda x: F.linear(x, weight))
        tokens = torch.tensor(float(labels.numel()))
        chunked, _ = wrapper(head_input, labels, tokens)
        del head_input  # the trainer's ``del pred``
        out: torch.Tensor = chunked
        return out
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group()
    output = F.linear(head_input, weight)
    del head_input  # saved by the output layer
    per_token = fused_vocab_parallel_cross_entropy(output, labels, group)
    del output
    fused: torch.Tensor = per_token.sum()
    return fused


class Buffer(NamedTuple):
    """A buffer compiled code allocates: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


def fused_backward_buffers(tokens: int = 256, vocab: int = 1000) -> list[Buffer]:
    """The buffers Megatron-Core's compiled ``calculate_gradients`` (the fused loss's backward)
    allocates, read from the code inductor generates for it on a CPU with ``tokens`` x
    ``vocab`` logits. The graph passes that decide them (functionalization of its in-place
    ``index_put`` and ``mul_``, reinplacing) run before any device's code is generated."""
    from megatron.core.fusions import fused_cross_entropy
    from torch._inductor.utils import run_and_get_code

    softmax = torch.rand(tokens, 1, vocab)
    mask = torch.zeros(tokens, 1, dtype=torch.bool)
    target = torch.randint(0, vocab, (tokens,))
    grad = torch.ones(tokens, 1)
    torch._dynamo.reset()
    _, codes = run_and_get_code(
        fused_cross_entropy.calculate_gradients, softmax, grad, mask, target
    )
    return _allocations(codes[0])


class CompiledLoss(NamedTuple):
    """What the compiled standard loss keeps and makes, read from a run of it on a CPU."""

    saved: list[Buffer]  # the tensors its forward saves for its backward
    backward: list[Buffer]  # the buffers its compiled backward allocates


def compiled_loss_buffers(
    tokens: int = 256,
    vocab: int = 1000,
    dtype: torch.dtype = torch.bfloat16,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    rows: bool = True,
) -> CompiledLoss:
    """A cross entropy under ``torch.compile``, run forward and backward on a CPU with
    ``tokens`` x ``vocab`` logits in ``dtype``: the tensors its compiled forward saves (a
    saved-tensor hook sees them as autograd saves them) and the buffers its compiled backward
    allocates (read from the code inductor generates). ``loss`` takes the logits (one
    sequence of ``tokens``, or with ``rows`` false the tokens' 2-D logits and 1-D labels) and
    the labels; by default torchtitan's own ``cross_entropy_loss``,
    as its trainer compiles it with ``training.compile``. Which tensors a graph saves is
    decided by AOTAutograd's partitioner, and which buffers its backward makes by the graph
    passes before any device's code is generated."""
    from torch._inductor.utils import run_and_get_code

    if loss is None:
        from torchtitan.components.loss import cross_entropy_loss

        loss = cross_entropy_loss
    lead = (1, tokens) if rows else (tokens,)
    pred = torch.randn(*lead, vocab, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, lead)
    saved: list[Buffer] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(Buffer(tuple(t.shape), str(t.dtype).removeprefix("torch.")))
        return t

    compiled = cast("Callable[..., torch.Tensor]", torch.compile(loss))

    def step() -> None:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = compiled(pred, labels)
        torch.autograd.backward(out)

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    backward = _allocations(codes[-1])
    return CompiledLoss(saved, backward)


def torchtune_chunked_loss_class() -> type:
    """torchtune's own ``CEWithChunkedOutputLoss`` (0.6.1, ``make install`` installs it without
    its dependencies), loaded from its own file: the module imports only torch, while
    importing the torchtune package needs torchao, which no trace does."""
    from headroom.calibration.torchtune import load_file

    module = load_file("torchtune_ce_chunked_output_loss", "modules/loss/ce_chunked_output_loss.py")
    found: type = module.CEWithChunkedOutputLoss
    return found


def torchtune_compiled_chunk(
    tokens: int = 256, vocab: int = 1000, dtype: torch.dtype = torch.bfloat16
) -> CompiledLoss:
    """One chunk of torchtune's ``CEWithChunkedOutputLoss`` compiled as its ``compile_loss``
    compiles it (``loss.compute_cross_entropy = torch.compile(loss.compute_cross_entropy)``),
    on the chunk's 2-D logits and labels: what its forward saves and its backward makes."""
    instance = torchtune_chunked_loss_class()()
    return compiled_loss_buffers(tokens, vocab, dtype, instance.compute_cross_entropy, rows=False)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _allocations(code: str) -> list[Buffer]:
    """The buffers a piece of inductor's generated code allocates."""
    found = re.findall(r"empty_strided_\w+\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)", code)
    return [
        Buffer(tuple(int(d) for d in dims.split(",") if d.strip()), dtype) for dims, dtype in found
    ]
