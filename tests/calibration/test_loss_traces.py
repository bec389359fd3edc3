"""The loss implementations that run on a CPU, traced (``calibration.loss_traces``), against the
planner's derived terms (``planner.losses``): to the byte but for the loss's few scalars.

torchtune's chunked loss and torchtitan's chunked loss run as their stacks run them; Megatron's
fused loss runs eagerly (its compiled kernels escape a memory tracker), and what its compiled
backward allocates besides is read from the code inductor generates for it."""

from __future__ import annotations

import random

import pytest
import torch

from headroom.calibration.loss_traces import (
    Buffer,
    compiled_loss_buffers,
    fused_backward_buffers,
    torchtune_chunked_loss_class,
    torchtune_compiled_chunk,
    trace_loss,
)
from headroom.planner.losses import LossShape, loss_bytes

#: what a trace may hold beyond the derivation: the loss's scalars (its value, counts)
SCALARS = 64

#: Llama 3 8B's head at 8k tokens; two sequences of 4k at a 3B's width (strided chunks: label
#: and hidden-state copies); a short sequence under a wide head (the head's backward peaks);
#: an uneven last chunk; fp32 activations (no upcast)
SHAPES = [
    (LossShape(1, 8192, 4096, 128256, 2), torch.bfloat16),
    (LossShape(2, 4096, 3072, 128256, 2), torch.bfloat16),
    (LossShape(1, 1024, 8192, 128256, 2), torch.bfloat16),
    (LossShape(3, 96, 64, 2048, 2), torch.bfloat16),
    (LossShape(2, 512, 256, 8192, 4), torch.float32),
]


def _check(impl: str, shape: LossShape, chunks: int, dtype: torch.dtype) -> None:
    traced = trace_loss(impl, shape, chunks, dtype)
    held, beyond = loss_bytes(impl, chunks, shape)
    assert 0 <= traced.held - held <= SCALARS, (impl, shape, traced, held)
    peak = traced.held + traced.beyond
    assert 0 <= peak - (held + beyond) <= SCALARS, (impl, shape, traced, held + beyond)


@pytest.mark.parametrize(("shape", "dtype"), SHAPES)
def test_torchtunes_chunked_loss_is_its_derivation(shape: LossShape, dtype: torch.dtype) -> None:
    _check("chunked", shape, 8, dtype)


def test_torchtunes_uneven_and_short_chunks_are_its_derivation() -> None:
    """``torch.chunk`` of 100 positions into 8 makes chunks of 13 and a last of 9; of 10 into
    8, five chunks of 2."""
    _check("chunked", LossShape(3, 100, 64, 2048, 2), 8, torch.bfloat16)
    _check("chunked", LossShape(2, 10, 64, 2048, 2), 8, torch.bfloat16)


def test_torchtunes_own_class_holds_what_its_flow_copied_here_holds() -> None:
    """torchtune's own ``CEWithChunkedOutputLoss`` traces as the op-for-op copy the trace
    runs."""
    shape = LossShape(2, 4096, 3072, 128256, 2)
    own = trace_loss("chunked", shape, 8, loss_class=torchtune_chunked_loss_class())
    assert own == trace_loss("chunked", shape, 8)


@pytest.mark.parametrize(("shape", "dtype"), SHAPES[:3] + SHAPES[4:])
@pytest.mark.parametrize("chunks", [8, 1])
def test_torchtitans_chunked_loss_is_its_derivation(
    shape: LossShape, dtype: torch.dtype, chunks: int
) -> None:
    _check("chunked_linear", shape, chunks, dtype)


def test_held_out_shapes_are_their_derivation() -> None:
    """Shapes drawn once (seeded) and never tuned to: 1-3 sequences, uneven and one-row
    chunks, vocabularies from the hidden size to 32 times it, 16- and 32-bit, 1-16 chunks.
    Each chunk's loss leaves a scalar or two, so the allowance grows with the chunks."""
    draw = random.Random(2024)
    for _ in range(24):
        rows, hidden = draw.choice([1, 2, 3]), draw.choice([64, 128, 512])
        chunks = draw.choice([1, 2, 3, 4, 8, 16])
        seq = draw.choice([chunks * draw.randint(1, 48), draw.randint(1, 300)])
        act_bytes, dtype = draw.choice([(2, torch.bfloat16), (4, torch.float32)])
        shape = LossShape(rows, seq, hidden, hidden * draw.choice([1, 2, 16, 32]), act_bytes)
        for impl in ("chunked", "chunked_linear") if seq % chunks == 0 else ("chunked",):
            traced = trace_loss(impl, shape, chunks, dtype)
            held, beyond = loss_bytes(impl, chunks, shape)
            scalars = 16 + 4 * chunks
            assert 0 <= traced.held - held <= scalars, (impl, shape, chunks)
            assert 0 <= traced.held + traced.beyond - held - beyond <= scalars, (impl, shape)


def test_megatrons_fused_loss_eagerly_and_its_compiled_backwards_buffers() -> None:
    """Eagerly the fused loss holds what the unfused one does: the fp32 softmax it saves (and
    per token the target mask and masked target), its largest moment 2 bytes a logit beyond
    (the forward's bf16 logits beside their fp32 copy, or the backward's bf16 gradient beside
    the softmax) and Megatron's index and statistics vectors (20 bytes a token), which the
    derivation leaves out. Compiled, its backward allocates one fp32 buffer of the logits'
    size beside its bf16 gradient: the derivation's 4 more bytes a logit."""
    shape = LossShape(4, 1024, 512, 25216, 2)  # the tiny GPT's last stage: vocabulary / tp 2
    t, v = 4 * 1024, 25216
    traced = trace_loss("fused", shape)
    held, beyond = loss_bytes("fused", 0, shape)
    assert 0 <= traced.held - held <= SCALARS
    compiled = 4 * t * v  # the compiled backward's buffer
    assert 0 <= traced.held + traced.beyond - (held + beyond - compiled) - 20 * t <= SCALARS
    buffers = fused_backward_buffers(tokens=256, vocab=1000)
    logit_sized = sorted(b.dtype for b in buffers if _numel(b.shape) == 256 * 1000)
    assert logit_sized == ["bfloat16", "float32"]


_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}


def _bytes(buffers: list[Buffer]) -> int:
    return sum(_numel(b.shape) * _BYTES[b.dtype] for b in buffers)


@pytest.mark.parametrize(
    ("tokens", "vocab", "dtype"), [(256, 1000, torch.bfloat16), (96, 640, torch.float32)]
)
def test_torchtitans_compiled_loss_keeps_its_logits_and_two_values_a_token(
    tokens: int, vocab: int, dtype: torch.dtype
) -> None:
    """torchtitan's own cross_entropy_loss, compiled and run on a CPU: its forward saves the
    logits in their dtype (no fp32 log-probabilities) and two fp32 values a token, beside the
    labels (the batch's own); its backward allocates the logits' gradient in their dtype and
    one fp32 value a token. The derivation (``loss.impl`` compiled) is exactly that, where the
    eager loss it replaces holds 12 bytes a logit at its backward."""
    found = compiled_loss_buffers(tokens, vocab, dtype)
    labels = Buffer((1, tokens), "int64")
    assert labels in found.saved
    held = _bytes([b for b in found.saved if b != labels])
    e = torch.empty((), dtype=dtype).element_size()
    want_held, want_beyond = loss_bytes("compiled", 0, LossShape(1, tokens, 64, vocab, e))
    assert held == want_held
    assert _bytes(found.backward) == want_beyond
    name = str(dtype).removeprefix("torch.")
    assert sorted(b.dtype for b in found.backward if _numel(b.shape) == tokens * vocab) == [name]


def test_torchtunes_compiled_chunk_keeps_its_logits_and_two_values_a_token() -> None:
    """One chunk of torchtune's own CEWithChunkedOutputLoss, its compute_cross_entropy
    compiled as torchtune's compile_loss compiles it: the same saved set and backward buffers
    as the compiled standard loss, per chunk; ``chunked_compiled`` sums them over the chunks
    (2 bytes a logit held where the eager chunked loss holds 4)."""
    tokens, vocab = 128, 512
    found = torchtune_compiled_chunk(tokens, vocab)
    labels = Buffer((tokens,), "int64")
    assert labels in found.saved
    held = _bytes([b for b in found.saved if b != labels])
    assert held == 2 * tokens * vocab + 8 * tokens
    assert _bytes(found.backward) == 2 * tokens * vocab + 4 * tokens
    shape = LossShape(1, 8192, 3072, 128256, 2)
    eager, _ = loss_bytes("chunked", 8, shape)
    compiled, _ = loss_bytes("chunked_compiled", 8, shape)
    assert eager - compiled == 2 * 8192 * 128256 - 8 * 8192


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out
