"""Loading specs: model presets, model files (ours or Hugging Face), training and hardware files.

JSON is read with the standard library. YAML needs PyYAML, imported only when a YAML file is
given, so the planner itself stays stdlib + pydantic. Validation errors become SpecError with
the dotted field path and pydantic's statement of what is allowed.
"""

from __future__ import annotations

import importlib
import json
import typing
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from headroom.planner.errors import (
    InputFormatError,
    SpecError,
    UnknownPresetError,
    did_you_mean,
)
from headroom.planner.hardware import MAX_GPUS_PER_NODE, MAX_HOST_MEMORY_BYTES, Hardware, gpu
from headroom.planner.hf import SUPPORTED_MODEL_TYPES, from_hf_config
from headroom.planner.model import ModelSpec
from headroom.planner.stack_configs import StackConfig, recognise
from headroom.planner.train import TrainSpec
from headroom.planner.units import parse_size

M = TypeVar("M", bound=BaseModel)


#: fields whose union type makes pydantic's own message unhelpful
_ALLOWED_HINTS = {
    "recompute": "must be 'none', 'selective', 'selective_op', 'full' or {\"every_k\": K} "
    "with K >= 1",
}


def _is_union_tag(part: str | int) -> bool:
    text = str(part)
    return text.startswith(("function-", "literal[")) or text[:1].isupper()


#: problems one message lists
_MAX_PROBLEMS = 10


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The one pydantic model a field's type holds (``X | None``, ``list[X]``), or None (none,
    or several: a union of models is not guessed at)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = {m for m in map(_model_in, typing.get_args(annotation)) if m is not None}
    return found.pop() if len(found) == 1 else None


def _fields_at(model: type[BaseModel] | None, parts: list[str]) -> list[str] | None:
    """The field names of the model at ``parts`` below ``model`` (as a file spells them), or
    None where the path leaves what can be followed."""
    for part in parts:
        if model is None:
            return None
        if part.isdigit():  # a list's item: the same model
            continue
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        model = None if field is None else _model_in(field.annotation)
    if model is None:
        return None
    return [f.alias or n for n, f in model.model_fields.items()]


def validation_message(
    exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> str:
    """One line per problem: ``field.path: what is wrong (allowed values)``; with ``model``, the
    class validated, an unknown field names the closest known one and the known ones."""
    lines: list[str] = []
    seen: set[str] = set()
    for err in exc.errors():
        parts = [str(p) for p in err["loc"] if not _is_union_tag(p)]
        path = ".".join(parts)
        path = f"{prefix}.{path}" if prefix and path else (prefix or path)
        if path in seen:
            continue
        seen.add(path)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            known = _fields_at(model, parts[:-1]) if parts else None
            msg = "unknown field"
            if known:
                msg += f"{did_you_mean(parts[-1], known)}; allowed: {', '.join(sorted(known))}"
        hint = _ALLOWED_HINTS.get(parts[-1]) if parts else None
        if hint and len(err["loc"]) > len(parts):
            msg = hint
        lines.append(f"{path}: {msg}" if path else msg)
    if len(lines) > _MAX_PROBLEMS:  # one bad list can hold 100k bad items: name a few
        lines[_MAX_PROBLEMS:] = [f"and {len(lines) - _MAX_PROBLEMS} more"]
    return "; ".join(lines)


def build(cls: type[M], data: Any, *, prefix: str = "") -> M:
    """Validate ``data`` into ``cls``, raising SpecError with field paths on failure."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise SpecError(f"{prefix or cls.__name__}: expected an object, got {type(data).__name__}")
    try:
        return cls.model_validate(dict(data))
    except ValidationError as exc:
        # the field as the message names it: prefixed, without pydantic's union member tags
        parts = [str(p) for p in exc.errors()[0]["loc"] if not _is_union_tag(p)]
        field = ".".join([prefix, *parts] if prefix else parts)
        raise SpecError(validation_message(exc, prefix, cls), field=field or None) from None


#: the suffixes of a spec file (a model, training, GPU or cluster file): a name with one is a
#: file, never a preset
SPEC_SUFFIXES = (".json", ".yaml", ".yml")


def is_spec_file_name(name: str | Path) -> bool:
    """Whether ``name`` is spelt as a spec file is (by its suffix; it need not exist)."""
    return Path(name).suffix.lower() in SPEC_SUFFIXES


def read_file(path: str | Path) -> Any:
    """Parse a JSON or YAML file (by suffix; JSON is tried first for other suffixes)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputFormatError(f"{p}: cannot read file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InputFormatError(
            f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the file as UTF-8"
        ) from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            yaml = importlib.import_module("yaml")
        except ImportError:
            raise InputFormatError(f"{p}: reading YAML needs PyYAML (pip install pyyaml)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InputFormatError(f"{p}: not valid YAML ({exc})") from None
        except ValueError as exc:  # PyYAML's int() past the conversion limit
            raise InputFormatError(f"{p}: not usable YAML ({_digits_reason(exc)})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFormatError(f"{p}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except ValueError as exc:  # an integer past Python's int-string conversion limit
        raise InputFormatError(f"{p}: not usable JSON ({_digits_reason(exc)})") from None


def _digits_reason(exc: ValueError) -> str:
    """Why json.loads refused a number: Python converts at most ``sys.get_int_max_str_digits()``
    digits to an int, and the parser raises a bare ValueError past that."""
    return f"an integer with too many digits: {str(exc).partition(':')[0]}"


@cache
def _model_presets() -> dict[str, Any]:
    found: dict[str, Any] = {}
    base = resources.files("headroom.planner") / "data"
    for folder in ("models", "hf"):
        for entry in sorted((base / folder).iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".json"):
                found[entry.name.removesuffix(".json")] = json.loads(entry.read_text())
    return found


#: keys of a Hugging Face config.json that Headroom's model schema does not have
_HF_ONLY_KEYS = frozenset(
    {
        "architectures",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "tie_word_embeddings",
        "torch_dtype",
        "transformers_version",
    }
)


def model_names() -> list[str]:
    """Names of the bundled model presets."""
    return sorted(_model_presets())


def model_from_dict(data: Mapping[str, Any], *, name: str | None = None) -> ModelSpec:
    """Our model schema, or a Hugging Face config.json (recognised by ``model_type``)."""
    if "model_type" in data:
        try:
            return from_hf_config(data, name=name)
        except ValidationError as exc:
            raise SpecError(validation_message(exc, "config.json"), field="model") from None
    hf_keys = sorted(_HF_ONLY_KEYS & set(data))
    if hf_keys:  # a config.json that lost its model_type, not a spec with many wrong keys
        raise SpecError(
            f"model_type: a Hugging Face config.json (it has {', '.join(hf_keys[:3])}) needs its "
            f"model_type, which it lacks; allowed: {', '.join(SUPPORTED_MODEL_TYPES)} (or write "
            "the model in Headroom's schema: docs/MODEL_SCHEMA.md)",
            field="model_type",
        )
    spec = dict(data)
    if name and "name" not in spec:
        spec["name"] = name
    return build(ModelSpec, spec, prefix="model")


@cache
def _preset_model(name: str) -> ModelSpec:
    # One parsed object per preset: ModelSpec is frozen, and the estimator memoises
    # model-derived facts by object identity, so a fresh parse per call would miss them all
    # (milliseconds per estimate instead of microseconds).
    return model_from_dict(_model_presets()[name], name=name)


def load_model(source: str | Path | Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name, a JSON/YAML file, a config.json, or a dict.

    A preset name returns the same (frozen) object on every call."""
    if isinstance(source, ModelSpec):
        return source
    if isinstance(source, Mapping):
        return model_from_dict(source)
    text = str(source)
    if text in _model_presets():
        return _preset_model(text)
    path = Path(text)
    if _is_file(path):
        data = read_file(path)
        if not isinstance(data, Mapping):
            raise InputFormatError(f"{path}: expected a JSON object describing a model")
        return model_from_dict(data, name=path.stem if path.stem != "config" else None)
    named = _lowercase_names(tuple(_model_presets())).get(text.strip().lower())
    if named is not None:  # preset names are case-insensitive, as GPU names are
        return _preset_model(named)
    raise UnknownPresetError(
        f"model: {text!r} is neither a file nor a preset{did_you_mean(text, model_names())}; "
        f"presets: {', '.join(model_names())}",
        field="model",
    )


@cache
def _lowercase_names(names: tuple[str, ...]) -> dict[str, str]:
    return {n.lower(): n for n in names}


class RunPreset(BaseModel):
    """A training run a project ships (torchtitan's train configs, Megatron's example scripts),
    as the training spec that runs it: the model preset, the GPU and how many, and the source
    it was read from. ``notes`` say where the spec differs from the run and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    model: str
    gpu: str
    gpus: int
    source: str
    notes: list[str]
    train: TrainSpec


@cache
def _run_presets() -> dict[str, RunPreset]:
    base = resources.files("headroom.planner") / "data" / "run_presets"
    found = {}
    for entry in sorted(base.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            preset = RunPreset.model_validate_json(entry.read_text())
            found[preset.name] = preset
    return found


def run_names() -> list[str]:
    """Names of the bundled run presets (``--train NAME`` takes one)."""
    return sorted(_run_presets())


def _run_preset(name: str) -> RunPreset | None:
    """The run preset ``name`` names, case aside."""
    named = _lowercase_names(tuple(_run_presets())).get(name.strip().lower())
    return None if named is None else _run_presets()[named]


def load_run(name: str) -> RunPreset:
    """A bundled run preset by name (case-insensitive)."""
    preset = _run_preset(name)
    if preset is None:
        raise UnknownPresetError(
            f"train: unknown run preset {name!r}{did_you_mean(name, run_names())}; allowed: "
            f"{', '.join(run_names())}",
            field="train",
        )
    return preset


def run_preset_named(source: str | Path) -> RunPreset | None:
    """The run preset ``source`` names (case aside), unless a file of that name exists (a file
    wins)."""
    preset = _run_preset(str(source))
    return preset if preset is not None and not Path(source).exists() else None


def load_train(source: str | Path | Mapping[str, Any] | TrainSpec | None) -> TrainSpec:
    """A TrainSpec from a run preset's name, a JSON/YAML file, a dict, or the defaults
    (None)."""
    if source is None:
        return TrainSpec()
    if isinstance(source, TrainSpec):
        return source
    if isinstance(source, Mapping):
        return build(TrainSpec, source, prefix="train")
    preset = run_preset_named(source)
    if preset is not None:
        return preset.train
    data = read_train_file(source)
    return build(TrainSpec, data or {}, prefix="train")


def read_train_file(source: str | Path) -> Any:
    """A training spec file's content (a stack's own config mapped to one, ``stack_config``);
    a name that is no file and no spec file's name (no .json/.yaml suffix) is taken for a
    mistyped run preset and refused with the closest one."""
    return read_train_source(source)[1]


def read_train_source(source: str | Path) -> tuple[StackConfig | None, Any]:
    """:func:`read_train_file`'s content, with the stack's own config it was mapped from (None
    for a Headroom spec), so that a caller can size it by the model and say what it assumed."""
    path = Path(source)
    if not is_spec_file_name(path) and not path.exists():
        raise UnknownPresetError(
            f"train: {str(source)!r} is neither a file nor a run preset"
            f"{did_you_mean(str(source), run_names())}; run presets: {', '.join(run_names())}",
            field="train",
        )
    stack = stack_config(path)
    return (stack, stack.train) if stack is not None else (None, read_file(source))


def stack_config(path: str | Path) -> StackConfig | None:
    """The stack's own training config ``path`` holds (a torchtitan job TOML ...), mapped to a
    training spec's keys; None for a file that is none (a Headroom spec)."""
    p = Path(path)
    if not _is_file(p):
        return None
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFormatError(f"{p}: cannot read file ({exc})") from None
    return recognise(p, text)


def _is_file(path: Path) -> bool:
    """Whether ``path`` names an existing file; a name the OS refuses (too long) does not."""
    try:
        return path.is_file()
    except OSError:
        return False


def _base_hardware(source: str | Path | Mapping[str, Any] | Hardware) -> Hardware:
    if isinstance(source, Hardware):
        return source
    if isinstance(source, Mapping):
        return build(Hardware, source, prefix="gpu")
    path = Path(str(source))
    if is_spec_file_name(path) and _is_file(path):
        return build(Hardware, read_file(path), prefix="gpu")
    return gpu(str(source))


def load_hardware(
    source: str | Path | Mapping[str, Any] | Hardware,
    *,
    host_memory: str | int | None = None,
    gpus_per_node: int | None = None,
    host_memory_field: str = "host_memory",
    gpus_per_node_field: str = "gpus_per_node",
) -> Hardware:
    """A GPU preset name, a hardware JSON/YAML file, or a dict with the Hardware fields;
    ``host_memory`` (e.g. ``"1.5TiB"``) and ``gpus_per_node`` override the host it sits in."""
    hw = _base_hardware(source)
    update: dict[str, Any] = {}
    if host_memory is not None:
        size = parse_size(host_memory, field=host_memory_field)
        # Hardware.host_memory_bytes' bound (``model_copy`` below does not validate)
        if not 1 <= size <= MAX_HOST_MEMORY_BYTES:
            raise SpecError(
                f"{host_memory_field}: must be between 1 byte and 1 PiB, got {size} bytes",
                field=host_memory_field,
            )
        update["host_memory_bytes"] = size
    if gpus_per_node is not None:
        # model_copy does not validate: the override is held to the field's bounds here
        if isinstance(gpus_per_node, bool) or not 1 <= gpus_per_node <= MAX_GPUS_PER_NODE:
            shown = str(gpus_per_node).lower() if abs(gpus_per_node) < 10**20 else "more"
            raise SpecError(
                f"{gpus_per_node_field}: must be an integer between 1 and {MAX_GPUS_PER_NODE}, "
                f"got {shown}",
                field=gpus_per_node_field,
            )
        update["gpus_per_node"] = gpus_per_node
    return hw.model_copy(update=update) if update else hw


def apply_overrides(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as JSON, else kept as strings)."""
    out: dict[str, Any] = json.loads(json.dumps(data))
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--set: expected key=value, got {item!r}", field="--set")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        except ValueError as exc:  # digits past the int-string conversion limit
            raise SpecError(f"--set {key}: {_digits_reason(exc)}", field="--set") from None
        set_key(out, key, value)
    return out


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` (``parallel.dp``) of ``data`` to ``value``, in place."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value
