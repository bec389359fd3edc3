"""``loss.impl``: each loss implementation's bytes held to its derivation from the source
(``planner.losses``), the default holding today's estimates, how the terms enter the phases,
and the configurations each implementation refuses. The implementations that run on a CPU
are held to traces in ``tests/calibration/test_loss_traces.py``."""

from __future__ import annotations

from typing import Any

import pytest

from headroom import planner
from headroom.planner.activations import head_terms
from headroom.planner.estimator import activation_inputs, knobs, stage_terms_from_knobs
from headroom.planner.losses import (
    DEFAULT_LOSS_CHUNKS,
    LOSS_IMPLS,
    LossShape,
    chunked_bytes,
    liger_chunk_tokens,
    loss_bytes,
    torch_chunks,
)
from headroom.planner.trainable import check_loss

H100 = planner.gpu("H100-80GB")
LLAMA = planner.load_model("llama-3-8b")
#: Llama 3 8B's head at 8192 tokens: t tokens, hidden h, vocabulary v, bf16
T, H, V, E = 8192, 4096, 128256, 2
SHAPE = LossShape(1, T, H, V, E)


def _spec(**over: Any) -> planner.TrainSpec:
    return planner.TrainSpec.model_validate({"seq_len": T, **over})


def test_the_default_is_the_profiles_loss_and_keeps_every_estimate() -> None:
    """``loss`` defaults to ``standard``: the profile's coefficients, byte for byte."""
    assert planner.TrainSpec().loss == planner.Loss(impl="standard", chunks=None)
    for profile in ("textbook", "hf", "torchtitan", "megatron"):
        plain = planner.estimate(LLAMA, _spec(activation_profile=profile), H100)
        named = planner.estimate(
            LLAMA, _spec(activation_profile=profile, loss={"impl": "standard"}), H100
        )
        assert named.model_dump() == plain.model_dump()
        coeffs = planner.default_coefficients(profile)
        _, forward, backward = head_terms(LLAMA, coeffs, activation_inputs(knobs(_spec())))
        assert forward == int(T * V * coeffs.logits_bytes_per_element)
        assert backward == int(T * V * coeffs.logits_backward_bytes_per_element)


def test_torchtunes_chunked_loss_keeps_the_log_probs_and_peaks_in_its_last_upcast() -> None:
    """CEWithChunkedOutputLoss, 8 chunks of 1024 tokens: every chunk's fp32 log-probs are
    saved (4 bytes a logit); the loss's forward peaks at the last chunk's upcast, with every
    chunk's bf16 logits (2), all log-probs (4) and that chunk's fp32 copy (4 x 1/8): 6.5 bytes
    a logit, 2.5 beyond the held 4. Its backward's largest, the last chunk's log_softmax
    backward (4 + 8 x 1/8 = 5), stays below it."""
    c = T // DEFAULT_LOSS_CHUNKS
    held, beyond = loss_bytes("chunked", DEFAULT_LOSS_CHUNKS, SHAPE)
    assert held == 4 * T * V
    assert beyond == 2 * T * V + 4 * c * V
    # the standard loss of transformers' and torchtune's model code: 4 + 8 bytes a logit
    hf = planner.default_coefficients("hf")
    assert (hf.logits_bytes_per_element, hf.logits_backward_bytes_per_element) == (4.03912, 8.0)


def test_the_chunked_heads_backward_peaks_where_the_hidden_size_outweighs_the_tokens() -> None:
    """At 1024 tokens and a 8192-wide head, the head's backward is the chunked loss's largest
    moment: autograd sums the weight's gradient over the chunks out of place, so three
    weight-sized tensors (the sum so far, the new one, their sum) sit beside the logits'
    gradients of the chunks not yet done and the input's gradients buffered so far."""
    t, h = 1024, 8192
    c = t // 8
    held, beyond = chunked_bytes(LossShape(1, t, h, V, E), 8)
    weight = V * h * E
    moment = E * (t - 2 * c) * V + 2 * c * h * E + 3 * weight
    assert held + beyond == moment
    assert moment > E * t * V + 4 * t * V + 4 * c * V  # the forward's last upcast


def test_torch_chunk_makes_ceil_sized_chunks_and_fewer_when_short() -> None:
    assert torch_chunks(8192, 8) == (8, 1024, 1024)
    assert torch_chunks(100, 8) == (8, 13, 9)
    assert torch_chunks(10, 8) == (5, 2, 2)  # chunks of 2: five of them
    # an uneven last chunk: its upcast is smaller than a full one's
    shape = LossShape(3, 100, 64, 2048, 2)
    held, beyond = chunked_bytes(shape, 8)
    t, v = 300, 2048
    assert held == 4 * t * v + 8 * t  # each chunk's labels: copies, saved by nll_loss
    assert held + beyond == max(
        2 * t * v + 4 * t * v + 4 * 27 * v + 8 * t,  # the last chunk (27 tokens)
        2 * t * v + 4 * (t - 27) * v + 4 * 39 * v + 8 * t,  # the one before (39 tokens)
    )


def test_torchtitans_chunked_linear_loss_holds_the_heads_gradient_and_one_chunk() -> None:
    """ChunkedLossWrapper: the head weight's gradient is made inside the loss's forward and
    held into its backward; the largest moment is a later chunk's cross entropy backward: the
    fp32 gradient buffer of the hidden states (4 bytes an element), the weight's gradient so
    far, and the chunk's bf16 logits, fp32 log-probs and two fp32 gradients (14 bytes a
    logit)."""
    c = T // 8
    held, beyond = loss_bytes("chunked_linear", 8, SHAPE)
    assert held == V * H * E
    assert held + beyond == 4 * T * H + V * H * E + 14 * c * V


def test_megatrons_fused_loss_adds_the_compiled_backwards_fp32_buffer() -> None:
    """--cross-entropy-loss-fusion: the saved fp32 softmax (and per token the target mask and
    the masked target), and in the compiled backward a new fp32 buffer and the bf16 gradient
    beside it: 10 bytes a logit, 6 beyond the held 4, where the unfused loss the megatron
    profile was traced on holds 2 beyond."""
    held, beyond = loss_bytes("fused", 0, SHAPE)
    assert held == 4 * T * V + 9 * T
    assert beyond == 6 * T * V
    megatron = planner.default_coefficients("megatron")
    assert megatron.logits_backward_bytes_per_element == 2.0


def test_ligers_fused_linear_loss_makes_the_gradients_in_its_forward() -> None:
    """LigerFusedLinearCrossEntropyFunction: chunks of next_pow2(ceil(t / ceil(v / h)))
    tokens (Liger's own example: 16,384 tokens, v 32,000, h 4,096: 2,048); held: the weight's
    gradient; its forward's peak: the input's gradient beside the input, one chunk's bf16
    logits, the fp32 losses and the bool target mask per token."""
    assert liger_chunk_tokens(4096 * 4, 4096, 32000) == 2048
    assert liger_chunk_tokens(T, H, V) == 256
    assert liger_chunk_tokens(100, 4096, 4096) == 100  # one chunk: at most the tokens
    held, beyond = loss_bytes("fused_linear", 0, SHAPE)
    assert held == V * H * E
    assert beyond == T * H * E + 256 * V * E + 5 * T


def test_cut_cross_entropy_holds_no_logit() -> None:
    """linear_cross_entropy (cce): held, an fp32 log-sum-exp and an int32 target index per
    token and an fp32 logit average per vocabulary entry; its backward, the input's and the
    weight's gradients, the vocabulary's order and the kernel's locks. Beside the gradients
    it makes, a hundredth of a byte a logit."""
    held, beyond = loss_bytes("cut", 0, SHAPE)
    assert held == 8 * T + 4 * V
    assert beyond == T * H * E + V * H * E + 4 * T + 8 * V
    assert held + beyond - T * H * E - V * H * E < T * V // 100


def test_the_compiled_loss_holds_a_third_of_the_eager_ones_logits() -> None:
    """torchtitan's cross entropy compiled keeps the 16-bit logits and two fp32 values a token,
    and its backward writes a 16-bit gradient beside one fp32 value a token: 4 bytes a logit
    at the loss's point, where the torchtitan profile's eager loss holds 12 (fp32
    log-probabilities through forward, 8 more bytes a logit in its backward)."""
    held, beyond = loss_bytes("compiled", 0, SHAPE)
    assert held == T * V * E + 8 * T
    assert beyond == T * V * E + 4 * T
    titan = planner.default_coefficients("torchtitan")
    eager = titan.logits_bytes_per_element + titan.logits_backward_bytes_per_element
    assert round(eager) == 12 and held + beyond == 4 * T * V + 12 * T
    compiled = _spec(activation_profile="torchtitan", loss={"compiled": True})
    standard = _spec(activation_profile="torchtitan")
    assert _at_loss(compiled) == (held, beyond)
    assert sum(_at_loss(standard)) - sum(_at_loss(compiled)) > 7.9 * T * V


def test_the_compiled_chunked_loss_keeps_its_chunks_logits_instead_of_log_probs() -> None:
    """torchtune's chunked loss compiled (``loss.compiled`` with ``chunked``) holds each
    chunk's 16-bit logits and two fp32 values a token where the eager one holds fp32
    log-probs: 2 bytes a logit less through forward, and less at the loss's point."""
    eager = _spec(activation_profile="hf", loss={"impl": "chunked"})
    compiled = _spec(activation_profile="hf", loss={"impl": "chunked", "compiled": True})
    assert compiled.loss.priced_impl == "chunked_compiled"
    held_eager, _ = _at_loss(eager)
    held, beyond = _at_loss(compiled)
    assert held_eager - held == 2 * T * V - 8 * T
    assert held + beyond < sum(_at_loss(eager))
    # the backward of a chunk: its new gradient beside all the logits (saved or gradients)
    assert beyond >= T * V * E // 8


@pytest.mark.parametrize(
    ("loss", "over", "field", "needle"),
    [
        (
            {"impl": "fused", "compiled": True},
            {},
            "train.loss.compiled",
            "loss.compiled: priced for standard and chunked",
        ),
        (
            {"compiled": True},
            {"parallel": {"tp": 2}},
            "loss.compiled",
            "loss.compiled: the compiled cross entropy is priced on a whole vocabulary",
        ),
    ],
)
def test_compiled_where_it_is_not_priced_is_refused(
    loss: dict[str, object], over: dict[str, object], field: str, needle: str
) -> None:
    with pytest.raises((planner.SpecError, ValueError)) as raised:
        planner.estimate(LLAMA, _spec(loss=loss, **over), H100)
    assert needle in str(raised.value)
    if isinstance(raised.value, planner.SpecError):
        assert raised.value.field == field


def _at_loss(train: planner.TrainSpec) -> tuple[int, int]:
    """(held, beyond) of the head stage's terms under ``train``."""
    coeffs = planner.default_coefficients(train.activation_profile)
    acts = stage_terms_from_knobs(LLAMA, knobs(train), coeffs, 0).activations
    return acts.logits_forward, acts.logits_backward


def test_the_loss_terms_enter_the_forward_and_the_losss_point() -> None:
    """The held bytes are the logits bucket through forward; the loss's point adds the largest
    moment. Where the loss's point is the backward's largest (at 8192 tokens: chunked,
    chunked_linear, fused, compiled), the backward row's logits are held + beyond; where a layer's
    backward is larger (fused_linear, cut), the row is that point's and holds no logits."""
    for impl in LOSS_IMPLS[1:]:
        train = _spec(activation_profile="hf", loss={"impl": impl})
        held, beyond = loss_bytes(impl, train.loss.num_chunks, SHAPE)
        assert _at_loss(train) == (held, beyond), impl
        rows = planner.estimate(LLAMA, train, H100).gpu.phases
        assert rows["forward"].buckets["logits"] == held, impl
        at_loss = impl in ("chunked", "chunked_linear", "fused", "compiled")
        assert rows["backward"].buckets["logits"] == (held + beyond if at_loss else 0), impl


def test_chunked_losses_save_at_the_llama_3_8b_peak() -> None:
    """At 8192 tokens the standard loss is the hf profile's peak; each other implementation
    holds less at the loss's point, the ones that never hold the logits least, and with the
    last two the peak moves to the layers' backward."""
    impls = ("standard", "chunked", "chunked_linear", "fused_linear", "cut")
    trains = [_spec(activation_profile="hf", loss={"impl": impl}) for impl in impls]
    at_loss = [sum(_at_loss(train)) for train in trains]
    assert at_loss == sorted(at_loss, reverse=True) and len(set(at_loss)) == len(at_loss)
    peaks = [planner.estimate(LLAMA, train, H100).gpu.allocated_peak_bytes for train in trains]
    assert peaks[0] > peaks[1] > peaks[2] >= peaks[3] == peaks[4]


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        (
            {"loss": {"impl": "chunked"}, "parallel": {"tp": 2}},
            "loss.impl: chunked is priced on a whole vocabulary",
        ),
        (
            {"loss": {"impl": "fused_linear"}, "parallel": {"tp": 8}},
            "allowed with parallel.tp 8: standard, fused",
        ),
        (
            {"loss": {"impl": "fused"}, "precision": {"params": "fp16"}},
            "loss.impl: Megatron's fused cross entropy casts its gradient to bf16",
        ),
        (
            {"loss": {"impl": "cut"}, "precision": {"params": "fp32", "master": "none"}},
            "loss.impl: Cut Cross-Entropy's backward takes 16-bit inputs only",
        ),
        (
            {"loss": {"impl": "chunked_linear", "chunks": 3}},
            "loss.chunks: torchtitan's ChunkedLossWrapper needs the rank's sequence (8192 "
            "tokens) to divide into its chunks, got 3",
        ),
    ],
)
def test_an_implementation_refuses_what_it_does_not_run(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(planner.SpecError) as err:
        planner.estimate(LLAMA, _spec(**over), H100)
    assert needle in str(err.value)
    assert err.value.field in ("loss.impl", "loss.chunks")


def test_chunks_belong_to_the_chunked_implementations() -> None:
    assert planner.Loss(impl="chunked").num_chunks == 8
    assert planner.Loss(impl="chunked_linear", chunks=16).num_chunks == 16
    assert planner.Loss(impl="cut").num_chunks == 0
    with pytest.raises(ValueError, match=r"loss\.chunks: only chunked and chunked_linear"):
        planner.Loss(impl="fused_linear", chunks=4)
    with pytest.raises(ValueError, match="Input should be 'standard', 'chunked'"):
        planner.Loss.model_validate({"impl": "liger"})
    # a fused loss runs vocab-parallel: under tensor parallelism it prices the local shard
    tp = _spec(loss={"impl": "fused"}, parallel={"tp": 4, "dp": 2})
    held, _ = loss_bytes("fused", 0, LossShape(1, T, H, V // 4, E))
    assert _at_loss(tp)[0] == held


def test_the_bundled_trainer_runs_its_own_loss_only() -> None:
    """A launch of the bundled trainer refuses another stack's loss, naming the field, rather
    than run the standard loss under an estimate of a chunked one."""
    check_loss(_spec())
    with pytest.raises(planner.SpecError, match=r"loss\.impl: chunked is another stack's loss"):
        check_loss(_spec(loss={"impl": "chunked"}))
