"""The loss's bytes under each implementation a stack runs (``TrainSpec.loss.impl``).

With a large vocabulary the logits and the loss's temporaries are a first-class memory term,
and the stacks differ most in how they avoid materialising them. ``standard`` is the loss of
the profile's own model code over the whole logits (the profile's fitted or derived
``logits_bytes_per_element`` and ``logits_backward_bytes_per_element``); every other
implementation is derived here from its source, op by op, with ``t`` tokens of the micro-batch
on the rank, ``v`` local vocabulary, ``h`` hidden width and ``e`` bytes per activation (and per
head weight) element:

- ``chunked``: torchtune 0.6.1's ``CEWithChunkedOutputLoss`` with the model's
  ``chunked_output`` (``torchtune/modules/loss/ce_chunked_output_loss.py``,
  ``torchtune/modules/transformer.py``, ``recipes/full_finetune_single_device.py``): the model
  returns every chunk's logits in the activation dtype (``torch.chunk`` of the sequence), the
  loss upcasts one chunk at a time and ``log_softmax`` saves each chunk's fp32 log-probs;
  the recipe frees the logits after the loss. Autograd runs every chunk's cross entropy
  backward (created last) before any chunk's head backward, and sums the head weight's
  gradient over the chunks in one input buffer, out of place.
- ``chunked_linear``: torchtitan 0.3.0's ``ChunkedLossWrapper``
  (``torchtitan/components/loss.py``): the head and the loss run a chunk at a time on the
  detached hidden states, each chunk's backward inside the loss's forward, the input's
  gradient gathered in an fp32 buffer and handed to the decoder's backward in the activation
  dtype; the head weight's gradient accumulates in place over the chunks.
- ``fused``: Megatron-Core 0.16.1's ``fused_vocab_parallel_cross_entropy``
  (``megatron/core/fusions/fused_cross_entropy.py``, ``--cross-entropy-loss-fusion`` with
  ``cross_entropy_fusion_impl`` ``native``): the fp32 logits are updated in place into the
  softmax it saves, as the unfused loss does; its four functions run through ``torch.compile``
  (``jit_fuser``), and the compiled backward (``calculate_gradients``) writes the functional
  form of its in-place ``index_put`` into a new fp32 buffer of the logits' size beside the
  saved softmax and its bf16 output (read from inductor's generated code).
- ``compiled`` (``loss.compiled`` with ``standard``): torchtitan's ``cross_entropy_loss``
  (``F.cross_entropy`` of the logits upcast to fp32, summed) under ``torch.compile``, as
  torchtitan runs it with ``training.compile`` since April 2025
  (``torchtitan/components/loss.py``: ``loss_fn = torch.compile(loss_fn)``), the trainer
  dropping its own reference to the logits (``del pred``). Inductor fuses the upcast, the
  log-softmax and the sum: the compiled forward saves the 16-bit logits and two fp32 values a
  token (the row's max and log-sum-exp), where the eager loss saves fp32 log-probabilities;
  the compiled backward writes the logits' gradient in their own dtype beside one fp32 value
  a token (read from the code inductor generates for it).
- ``chunked_compiled`` (``loss.compiled`` with ``chunked``): torchtune's
  ``CEWithChunkedOutputLoss`` with ``compile: true``, whose ``compile_loss`` compiles its
  ``compute_cross_entropy`` (the upcast and the cross entropy of one chunk;
  ``torchtune/training/_compile.py``): each chunk's cross entropy is the graph above, so each
  chunk keeps its 16-bit logits and two fp32 values a token, and its backward writes the
  chunk's gradient in the logits' dtype. torchtune's non-chunked losses are compiled into a
  module the recipes drop: they run eagerly (``standard``).
- ``fused_linear``: Liger Kernel 0.8.5's ``LigerFusedLinearCrossEntropyFunction``
  (``liger_kernel/ops/fused_linear_cross_entropy.py``): the head and the loss fused, a chunk of
  ``next_pow2(ceil(t / ceil(v / h)))`` tokens at a time in one reused logits buffer; the
  input's and the weight's gradients are made in the forward and saved for the backward, which
  only scales them in place.
- ``cut``: Apple's Cut Cross-Entropy 25.1.1 (``cut_cross_entropy/cce.py``,
  ``cce_lse_forward.py``, ``cce_backward.py``): blockwise kernels that never hold a logit;
  the forward keeps an fp32 log-sum-exp per token (and per-vocabulary logit averages for its
  gradient filter), the backward makes the input's and the weight's gradients.

What the standard head keeps is the profile's (``head_hidden_tensors``: the head's saved input
among it). Where an implementation hands the decoder a gradient it made early in place of that
saved input (``chunked_linear``, ``fused_linear``), the two are the same size and the head term
stands for either. Parameter gradients an implementation makes inside the loss (the head
weight's, made or summed chunk by chunk) are counted with the loss: they exist before the
loss's backward is done.

Each function returns (``held``: bytes kept from the loss's forward into its backward,
``beyond``: the loss's largest moment beyond them, in its forward or its backward). The phase
arithmetic adds ``held`` to the forward and ``held + beyond`` at the loss's point: the other
terms are the same at both moments. ``tests/calibration/test_loss_traces.py`` holds the
implementations that run on a CPU (torchtune's and torchtitan's losses, Megatron's eagerly and
its compiled backward's buffers) to traces; Liger's and Cut Cross-Entropy's Triton kernels need
a GPU, and their terms are the source's allocations (``tests/planner/test_loss_impl.py``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

#: the loss implementations the estimate prices (``TrainSpec.loss.impl``)
LossImpl = Literal["standard", "chunked", "chunked_linear", "fused", "fused_linear", "cut"]
LOSS_IMPLS: tuple[str, ...] = get_args(LossImpl)
#: the implementations ``loss.compiled`` applies to, and what each is priced as compiled
COMPILED_IMPLS = {"standard": "compiled", "chunked": "chunked_compiled"}
#: the implementations that split the tokens into ``loss.chunks`` chunks
CHUNKED_IMPLS = ("chunked", "chunked_linear")
#: torchtune's ``num_output_chunks`` and torchtitan's ``num_chunks`` default
DEFAULT_LOSS_CHUNKS = 8
#: the implementations computed on the rank's whole vocabulary only (no tensor parallelism)
WHOLE_VOCAB_IMPLS = (
    "chunked",
    "chunked_linear",
    "fused_linear",
    "cut",
    "compiled",
    "chunked_compiled",
)

#: bytes of an fp32 element, and of an int64 label
_FP32 = 4
_INT64 = 8


class LossShape(NamedTuple):
    """What a loss's bytes depend on, for one micro-batch on one rank."""

    rows: int  # sequences in the micro-batch
    seq: int  # tokens of each on the rank (the sequence over context parallelism)
    hidden: int
    vocab: int  # the rank's vocabulary (over tensor parallelism)
    act_bytes: int  # bytes per activation element, and per head weight element


def loss_bytes(impl: str, chunks: int, shape: LossShape) -> tuple[int, int]:
    """(held from the loss's forward into its backward, its largest moment beyond that) of a
    derived implementation (any but ``standard``, which is the profile's)."""
    if impl == "chunked":
        return chunked_bytes(shape, chunks)
    if impl == "chunked_compiled":
        return chunked_compiled_bytes(shape, chunks)
    if impl == "chunked_linear":
        return chunked_linear_bytes(shape, chunks)
    if impl == "fused":
        return fused_bytes(shape)
    if impl == "compiled":
        return compiled_bytes(shape)
    if impl == "fused_linear":
        return fused_linear_bytes(shape)
    if impl == "cut":
        return cut_bytes(shape)
    raise ValueError(f"loss.impl: {impl!r} is the profile's, not derived here")


def torch_chunks(seq: int, chunks: int) -> tuple[int, int, int]:
    """(chunks made, rows of a full one, rows of the last) when ``torch.chunk`` splits ``seq``
    positions into ``chunks``: chunks of ``ceil(seq / chunks)``, fewer than asked when that
    leaves none for the last."""
    size = -(-seq // chunks)
    made = -(-seq // size)
    return made, size, seq - (made - 1) * size


class _Chunks(NamedTuple):
    """How torchtune's loss splits one micro-batch (``torch.chunk`` of the sequence)."""

    made: int  # chunks made
    full: int  # tokens of each chunk but the last
    tail: int  # tokens of the last
    copy_full: bool  # a full chunk's input and labels are copies: a strided view does not
    # flatten to two dimensions (more than one sequence, more than one position a chunk)
    copy_tail: bool  # the same for the last chunk


def _torchtune_chunks(shape: LossShape, chunks: int) -> _Chunks:
    rows, seq = shape.rows, shape.seq
    made, size, last = torch_chunks(seq, chunks)
    strided = rows > 1 and made > 1
    return _Chunks(made, rows * size, rows * last, strided and size > 1, strided and last > 1)


def _copied(ch: _Chunks, k: int) -> int:
    """Tokens of chunks 1..k whose input and labels are copies."""
    fulls = min(k, ch.made - 1)
    return (fulls * ch.full if ch.copy_full else 0) + (
        ch.tail if k == ch.made and ch.copy_tail else 0
    )


def _kept_input(shape: LossShape, ch: _Chunks, k: int) -> int:
    """The head's saved input while chunks 1..k keep theirs, beyond the hidden states the head
    term counts: each copy, and the hidden states themselves while a chunk keeps a view."""
    rows, seq, h, _, e = shape
    fulls = min(k, ch.made - 1)
    view = (fulls > 0 and not ch.copy_full) or (k == ch.made and not ch.copy_tail)
    return h * e * _copied(ch, k) + (0 if view else -h * e * rows * seq)


def chunked_bytes(shape: LossShape, chunks: int) -> tuple[int, int]:
    """torchtune's ``CEWithChunkedOutputLoss`` (module docstring). Held: every chunk's fp32
    log-probs, and the chunks' labels and inputs where they are copies (``nll_loss`` saves
    the labels, each chunk's head its input). The largest moment is one of:

    - the forward's last upcast: every chunk's logits, the log-probs so far, the chunk's fp32
      copy (16-bit logits only: ``.float()`` returns fp32 ones as they are);
    - a chunk's ``log_softmax`` backward, from the last chunk down: the log-probs of the chunks
      not yet done, the logits' gradients of those done, and the chunk's two fp32 gradients;
    - a chunk's head backward, from the last (``_chunked_head_moments``).

    Within the run of equal chunks each moment is linear in the chunk's place, so the first,
    the last but one and the last chunk are the only candidates."""
    rows, seq, _, v, e = shape
    ch = _torchtune_chunks(shape, chunks)
    made, full, tail = ch.made, ch.full, ch.tail
    t = rows * seq
    upcast = _FP32 if e < _FP32 else 0
    kept = _kept_input(shape, ch, made)
    saved = _INT64 * _copied(ch, made) + kept  # the labels and inputs copied
    held = _FP32 * t * v + saved
    moments = [e * t * v + _FP32 * t * v + upcast * tail * v + saved]
    if made > 1:
        moments.append(e * t * v + _FP32 * (t - tail) * v + upcast * full * v + saved)
    for k in sorted({made, made - 1, 1} - {0}):
        upto = t if k == made else full * k  # tokens of chunks 1..k
        c = tail if k == made else full
        labels = _INT64 * _copied(ch, k - 1)  # the chunk's own went with its nll_loss's node
        moments.append(_FP32 * upto * v + e * (t - upto) * v + 2 * _FP32 * c * v + labels + kept)
        moments += _chunked_head_moments(shape, ch, k)
    return held, max(moments) - held


def chunked_compiled_bytes(shape: LossShape, chunks: int) -> tuple[int, int]:
    """torchtune's chunked loss with each chunk's cross entropy compiled (module docstring).
    Held: every chunk's 16-bit logits (each compiled chunk saves its own; the recipe's ``del
    logits`` drops only its list), two fp32 values a token, and the chunks' labels and inputs
    where they are copies (``chunked_bytes``). The largest moment is one of:

    - a chunk's compiled backward, from the last chunk down: the logits saved by the chunks
      not yet done, the gradients of those done, the chunk's new gradient in the logits'
      dtype and one fp32 value a token, the two fp32 values a token of the chunks not yet
      done, and their labels (the chunk's own with them: one compiled node saves the chunk's
      labels until its backward ends);
    - a chunk's head backward (``_chunked_head_moments``, as eagerly: the saved logits are
      gone by then)."""
    rows, seq, _, v, e = shape
    ch = _torchtune_chunks(shape, chunks)
    made, full, tail = ch.made, ch.full, ch.tail
    t = rows * seq
    kept = _kept_input(shape, ch, made)
    saved = _INT64 * _copied(ch, made) + kept
    held = e * t * v + 2 * _FP32 * t + saved
    moments = [held]
    for k in sorted({made, made - 1, 1} - {0}):
        upto = t if k == made else full * k  # tokens of chunks 1..k
        c = tail if k == made else full
        labels = _INT64 * _copied(ch, k)
        moments.append(e * t * v + e * c * v + _FP32 * c + 2 * _FP32 * upto + labels + kept)
        moments += _chunked_head_moments(shape, ch, k)
    return held, max(moments) - held


def _chunked_head_moments(shape: LossShape, ch: _Chunks, k: int) -> list[int]:
    """The chunked loss's moments in chunk ``k``'s head backward (1-based; run from the last
    chunk down, after every chunk's cross entropy backward): during its matmul, and as
    autograd sums the weight's gradient after it. The logits' gradients of chunks 1..k are
    alive (k's until its matmul is done), the input's gradients of chunks k..last are buffered
    for ``torch.chunk``'s backward, and the head's saved inputs of the chunks done are gone;
    the weight's gradient is the first alone, then the running sum and the new one, and for a
    moment their sum."""
    rows, seq, h, v, e = shape
    t = rows * seq
    before = ch.full * (k - 1)  # tokens of the chunks before k
    upto = t if k == ch.made else before + ch.full
    weight = v * h * e
    buffered = h * e * (t - before)
    moments = [
        e * upto * v
        + buffered
        + _kept_input(shape, ch, k)
        + (weight if k == ch.made else 2 * weight)
    ]
    if k < ch.made:
        moments.append(e * before * v + buffered + _kept_input(shape, ch, k - 1) + 3 * weight)
    return moments


def chunked_linear_bytes(shape: LossShape, chunks: int) -> tuple[int, int]:
    """torchtitan's ``ChunkedLossWrapper`` (module docstring; ``chunks`` divides the rank's
    sequence, as it requires). Held: the head weight's gradient, summed over the chunks (the
    fp32 buffer's copy in the activation dtype, saved for the decoder's backward, takes the
    place of the head's saved input). Throughout the chunks: the fp32 gradient buffer of the
    hidden states, and with more than one sequence each chunk's contiguous copy of its hidden
    states and labels. The largest moment is one of, for the first chunk and any later one
    (which holds the weight's gradient summed so far):

    - its cross entropy's backward: the chunk's logits (kept by the loop's variable), its fp32
      log-probs and two fp32 gradients (``nll_loss``'s and ``log_softmax``'s);
    - its head's backward: its logits, their gradient, its input's gradient and the weight's
      new gradient (the first chunk's becomes the weight's; later ones are added in place);
    - its input's gradient added into the buffer, through an fp32 copy (larger than the head's
      backward only where the vocabulary is under twice the hidden size);
    - the end: the buffer's copy in the activation dtype beside the buffer, and the last
      chunk's logits."""
    rows, seq, h, v, e = shape
    t = rows * seq
    c = rows * (seq // chunks)
    weight = v * h * e
    base = _FP32 * t * h
    if rows > 1 and chunks > 1:  # the chunks of a strided view, made contiguous up front
        base += t * h * e + _INT64 * t
    logits = e * c * v
    upcast = _FP32 if e < _FP32 else 0  # ``.to(fp32)`` returns fp32 tensors as they are
    moments = [
        base + logits + 3 * _FP32 * c * v,
        base + 2 * logits + c * h * e + weight,
        # the chunk's input gradient added into the buffer through an fp32 copy
        base + weight + logits + c * h * e + upcast * c * h,
        # the end: the buffer's copy in the activation dtype
        base + weight + (t * h * e if upcast else 0) + logits,
    ]
    if chunks > 1:
        moments += [
            base + weight + logits + 3 * _FP32 * c * v,
            base + weight + 2 * logits + c * h * e + weight,
        ]
    return weight, max(moments) - weight


def fused_bytes(shape: LossShape) -> tuple[int, int]:
    """Megatron-Core's fused vocab-parallel cross entropy, compiled (module docstring). Held:
    the fp32 softmax (the logits' fp32 copy, updated in place) and per token the target mask
    (bool) and the masked target (int64). The largest moment: the forward's 16-bit logits
    beside their fp32 copy, or the compiled backward's new fp32 buffer and bf16 gradient
    beside the softmax."""
    rows, seq, _, v, e = shape
    t = rows * seq
    per_token = 1 + _INT64
    held = _FP32 * t * v + per_token * t
    forward = e * t * v + _FP32 * t * v
    backward = _FP32 * t * v + _FP32 * t * v + 2 * t * v
    return held, max(forward, backward) + per_token * t - held


def compiled_bytes(shape: LossShape) -> tuple[int, int]:
    """The standard cross entropy compiled (module docstring). Held: the logits in their own
    dtype and two fp32 values a token. The largest moment, in the backward: the logits'
    gradient, in their dtype, and one fp32 value a token."""
    rows, seq, _, v, e = shape
    t = rows * seq
    return e * t * v + 2 * _FP32 * t, e * t * v + _FP32 * t


def liger_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's tokens per chunk: ``next_pow2(ceil(tokens / ceil(vocab / hidden)))``, at most
    ``tokens`` (``chunk_mem_const`` 1: about ``tokens x hidden`` logits at a time)."""
    per = -(-tokens // -(-vocab // hidden))
    return min(1 << (per - 1).bit_length(), tokens)


def fused_linear_bytes(shape: LossShape) -> tuple[int, int]:
    """Liger's fused linear cross entropy (module docstring; ``accum_dtype`` None, the
    CUDA path that reuses one logits buffer). Held: the weight's gradient (``zeros_like``
    the weight; the input's gradient, saved beside it, takes the place of the head's saved
    input). Its largest moment is in its forward: the input's gradient beside the input, one
    chunk's logits, the fp32 per-token losses and the bool mask of counted targets."""
    rows, seq, h, v, e = shape
    t = rows * seq
    weight = v * h * e
    chunk = liger_chunk_tokens(t, h, v)
    return weight, t * h * e + chunk * v * e + (_FP32 + 1) * t


def cut_bytes(shape: LossShape) -> tuple[int, int]:
    """Cut Cross-Entropy's ``linear_cross_entropy`` (``impl`` cce, its default gradient filter,
    targets shifted or some ignored: module docstring). Held: the fp32 log-sum-exp and the
    int32 index of each counted target per token, and an fp32 logit average per vocabulary
    entry (the filter's). Its largest moment is in its backward: the input's and the weight's
    gradients (``zeros_like``, in the input's dtype), the vocabulary's int32 order and the
    kernel's int32 locks (about one per token and one per vocabulary entry)."""
    rows, seq, h, v, e = shape
    t = rows * seq
    held = 2 * _FP32 * t + _FP32 * v
    return held, t * h * e + v * h * e + _FP32 * t + 2 * _FP32 * v
