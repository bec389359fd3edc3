"""torchtune's own model code for CPU traces (the ``torchtune`` activation profile).

``torchtune`` is an optional install (``make install`` adds ``torchtune==0.6.1`` and the
``torchao`` its ``modules`` package imports, both without dependencies). The package's own
``__init__`` imports its data stack (``datasets``, tokenizers), which no trace uses, so the
model code is loaded under a package entry of its own files (``require_torchtune``): every
module a trace runs is torchtune's, unchanged.

A model is what ``torchtune.models.llama3_2.llama3_2`` builds (its ``_component_builders``,
the builder of Llama 3.2 1B/3B and the shape of Llama 3.1's): ``TransformerDecoder`` of
``TransformerSelfAttentionLayer`` blocks, each a ``MultiHeadAttention`` with separate Q, K and V
projections and Llama 3.1's scaled RoPE (``Llama3ScaledRoPE``), a SwiGLU ``FeedForward``
(``llama3_mlp``) and two ``RMSNorm``s, which normalize in fp32. It differs from transformers'
Llama in what it saves: the norms keep their fp32 input and output, grouped keys and values are
expanded to every query head before attention (``expand(...).flatten(1, 2)``: copies), and the
decoder returns fp32 logits (``self.output(h).float()``). Attention is scaled-dot-product
attention, as torchtune runs it without a packed block mask (``_sdpa_or_flex_attention``).

The loss is the recipes' with a plain ``torch.nn.CrossEntropyLoss`` (``loss:
torchtune.modules.loss.CEWithChunkedOutputLoss`` is ``loss.impl: chunked``, priced from its own
code by ``planner.losses``), over the fp32 logits flattened, and ``recompute: full`` is the
recipes' ``enable_activation_checkpointing``: ``set_activation_checkpointing(model,
auto_wrap_policy={TransformerSelfAttentionLayer})``, torch's non-reentrant checkpoint wrapper
on every block.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import torch

from headroom import planner
from headroom.planner.errors import SpecError


def _package_root() -> str:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return str(distribution("torchtune").locate_file("torchtune"))
    except PackageNotFoundError:
        raise SpecError(
            "impl: torchtune needs the torchtune package (and torchao, which its modules "
            "import); make install adds both, or use --impl hf",
            field="impl",
        ) from None


def require_torchtune() -> Any:
    """``torchtune.modules``, loaded under a package entry of torchtune's own folder where the
    package itself cannot be imported (module docstring), or a SpecError naming ``impl``."""
    if "torchtune" not in sys.modules:
        root = _package_root()
        package = types.ModuleType("torchtune")
        package.__path__ = [root]
        package.__version__ = _version()  # type: ignore[attr-defined]
        sys.modules["torchtune"] = package
    try:
        import torchtune.modules as modules
    except ImportError as exc:
        raise SpecError(
            f"impl: torchtune's modules need torchao; make install adds it ({exc})", field="impl"
        ) from None
    return modules


def _version() -> str:
    from importlib.metadata import version

    return version("torchtune")


def load_file(name: str, relative: str) -> Any:
    """The module of torchtune's file ``relative`` (to its package folder), loaded on its own
    under ``name`` and registered as an import would register it (torch.compile looks a class's
    module up by name): the package's ``__init__``, which imports its data stack, never runs."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, f"{_package_root()}/{relative}")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def scaled_rope_class() -> type:
    """torchtune's ``Llama3ScaledRoPE``, loaded from its own file (its package's ``__init__``
    imports the model builders, and they the data stack)."""
    module = load_file(
        "torchtune.models.llama3_1._position_embeddings",
        "models/llama3_1/_position_embeddings.py",
    )
    found: type = module.Llama3ScaledRoPE
    return found


def _refuse(field: str, why: str) -> SpecError:
    return SpecError(
        f"model.{field}: a torchtune trace builds torchtune's Llama 3.2 decoder; {why}",
        field=f"model.{field}",
    )


def check_model(spec: planner.ModelSpec) -> None:
    """A SpecError naming the first field torchtune's Llama 3.2 builder cannot express."""
    from headroom.calibration.torchtitan import llama_refusal

    refusal = llama_refusal(spec)
    if refusal is not None:
        raise _refuse(*refusal)


def build(spec: planner.ModelSpec, seq_len: int) -> torch.nn.Module:
    """torchtune's decoder of ``spec``'s shape as ``llama3_2`` builds it (RoPE caches
    ``seq_len`` positions), in the current default dtype and device mode (call it under
    ``FakeTensorMode`` to allocate nothing), in train mode."""
    check_model(spec)
    modules = require_torchtune()
    from torch import nn

    dim, heads = spec.hidden_size, spec.num_heads
    kv_heads = spec.num_kv_heads or heads
    head_dim = dim // heads
    rope = _scaled_rope(head_dim, seq_len)
    layers = nn.ModuleList()
    for _ in range(spec.num_layers):
        attention = modules.MultiHeadAttention(
            embed_dim=dim,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(dim, heads * head_dim, bias=False),
            k_proj=nn.Linear(dim, kv_heads * head_dim, bias=False),
            v_proj=nn.Linear(dim, kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(dim, dim, bias=False),
            pos_embeddings=rope,
            max_seq_len=seq_len,
            attn_dropout=0.0,
        )
        ffn = spec.ffn_hidden_size
        mlp = modules.FeedForward(
            gate_proj=nn.Linear(dim, ffn, bias=False),
            down_proj=nn.Linear(ffn, dim, bias=False),
            up_proj=nn.Linear(dim, ffn, bias=False),
        )
        layers.append(
            modules.TransformerSelfAttentionLayer(
                attn=attention,
                mlp=mlp,
                sa_norm=modules.RMSNorm(dim=dim, eps=1e-5),
                mlp_norm=modules.RMSNorm(dim=dim, eps=1e-5),
            )
        )
    embeddings = nn.Embedding(spec.vocab_size, dim)
    if spec.tied_embeddings:
        output: nn.Module = modules.TiedLinear(embeddings)
    else:
        output = nn.Linear(dim, spec.vocab_size, bias=False)
    net: torch.nn.Module = modules.TransformerDecoder(
        tok_embeddings=embeddings,
        layers=layers,
        max_seq_len=seq_len,
        num_heads=heads,
        head_dim=head_dim,
        norm=modules.RMSNorm(dim, eps=1e-5),
        output=output,
    )
    return net.train()


def _scaled_rope(head_dim: int, seq_len: int) -> torch.nn.Module:
    """``Llama3ScaledRoPE`` as the builder makes it (one for every layer). Its scaling reads
    the frequencies' values (``apply_scaling``), which fake tensors do not have: it is built on
    real tensors and its cache made fake, as a fake tensor mode makes any real tensor."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    mode = detect_fake_mode()
    with unset_fake_temporarily():
        rope: torch.nn.Module = scaled_rope_class()(
            dim=head_dim, max_seq_len=seq_len, base=500_000, scale_factor=32
        )
    if mode is not None:
        for name, buffer in list(rope.named_buffers(recurse=False)):
            rope.register_buffer(name, mode.from_tensor(buffer), persistent=False)
    return rope


def apply_full_ac(net: torch.nn.Module) -> None:
    """The recipes' ``enable_activation_checkpointing``: ``set_activation_checkpointing(model,
    auto_wrap_policy={TransformerSelfAttentionLayer})`` (torchtune ``training/memory.py``),
    which is torch's ``apply_activation_checkpointing`` with a ``ModuleWrapPolicy`` of that
    class: the non-reentrant checkpoint wrapper on every block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    modules = require_torchtune()
    policy = ModuleWrapPolicy({modules.TransformerSelfAttentionLayer})
    apply_activation_checkpointing(net, auto_wrap_policy=policy)


def loss(net: Any, ids: torch.Tensor) -> torch.Tensor:
    """The recipes' ``_loss_step`` (``recipes/full_finetune_single_device.py``): the decoder's
    fp32 logits, the labels shifted by one with an ignored last position
    (``torch.hstack``), both flattened into a ``CrossEntropyLoss`` (``ignore_index`` -100,
    mean over the tokens), and the logits dropped before the backward."""
    logits = net(ids)
    ignored = torch.full((ids.shape[0], 1), -100, dtype=ids.dtype)
    labels = torch.hstack((ids[..., 1:], ignored)).reshape(-1)
    logits = logits.reshape(-1, logits.size(-1))
    out: torch.Tensor = torch.nn.CrossEntropyLoss(ignore_index=-100)(logits, labels)
    del logits
    return out


def layer_saved_bytes(
    spec: planner.ModelSpec, tokens: int, compiled: bool, dtype: torch.dtype = torch.bfloat16
) -> int:
    """What one of torchtune's decoder layers of ``spec``'s shape saves for its backward, on a
    CPU with real tensors: the bytes of every distinct storage autograd saves during its
    forward over one sequence of ``tokens`` (a saved-tensor hook sees each as autograd saves
    it), less the layer's weights and its input (the previous layer's output, counted there).
    ``compiled``: the layer runs as torchtune's ``compile_model`` runs it
    (``TransformerSelfAttentionLayer.compile()``, inductor): AOTAutograd's partitioner decides
    what the compiled forward returns for its backward, and those are the tensors counted. The
    second call is counted (the first compiles)."""
    modules = require_torchtune()
    one = spec.model_copy(update={"num_layers": 1})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        net = build(one, tokens)
    finally:
        torch.set_default_dtype(previous)
    layer = next(m for m in net.modules() if isinstance(m, modules.TransformerSelfAttentionLayer))
    if compiled:
        torch._dynamo.reset()
        layer.compile()
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
    x = torch.randn(1, tokens, spec.hidden_size, dtype=dtype, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    for _ in range(2):
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = layer(x)
        out.float().sum().backward()
    skip = weights | {x.untyped_storage().data_ptr()}
    return sum(n for ptr, n in seen.items() if ptr not in skip)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


#: the shapes the ``compiled_layer_*_tensors`` terms are solved from (width, heads, KV heads,
#: FFN width, tokens): two FFN-to-width ratios, grouped heads
COMPILE_SHAPES = ((512, 8, 4, 1536, 1024), (768, 12, 4, 2048, 512))


def compile_shape(hidden: int, heads: int, kv_heads: int, ffn: int) -> planner.ModelSpec:
    """A one-layer planner spec of torchtune's decoder at these widths (vocabulary 1,000)."""
    return planner.load_model("tiny-dense").model_copy(
        update={
            "name": f"torchtune-compile-{hidden}",
            "hidden_size": hidden,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "ffn_hidden_size": ffn,
            "vocab_size": 1000,
            "num_layers": 1,
            "tied_embeddings": False,
        }
    )


def compiled_fewer_bytes(hidden: int, heads: int, kv_heads: int, ffn: int, tokens: int) -> int:
    """Bytes per token one of torchtune's layers saves fewer compiled than eager (bf16)."""
    spec = compile_shape(hidden, heads, kv_heads, ffn)
    eager = layer_saved_bytes(spec, tokens, compiled=False)
    compiled = layer_saved_bytes(spec, tokens, compiled=True)
    return (eager - compiled) // tokens


def compiled_layer_tensors() -> tuple[float, float]:
    """(hidden-width, FFN-width) bf16 tensors per token a compiled layer saves fewer: solved
    from ``COMPILE_SHAPES``' measured differences (``fewer = 2 (a h + b f)``)."""
    (h1, *_, f1, _), (h2, *_, f2, _) = COMPILE_SHAPES
    d1, d2 = (compiled_fewer_bytes(*shape) / 2 for shape in COMPILE_SHAPES)
    det = h1 * f2 - h2 * f1
    a = (d1 * f2 - d2 * f1) / det
    b = (h1 * d2 - h2 * d1) / det
    return round(a, 6), round(b, 6)
