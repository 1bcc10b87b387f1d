"""HF safetensors weights as a model's state: listed from headers, checked, loaded.

A Hugging Face folder is ``config.json`` plus either ``model.safetensors.index.json`` with its
shards or a single ``model.safetensors``, on local disk or any fsspec URL. Every shard's header
is read and checked (names, shapes, truncation) before any tensor data is. The trainer loads an
initial checkpoint given in HF format with ``load_hf_into_model``
(``checkpoint.initial_load_in_hf``); ``convert.hf_to_dcp`` saves the same state as DCP.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_core import storage
from titan_core.errors import CheckpointError, storage_errors
from titan_core.logging import logger
from titan_core.models import ModelSpec, get_model_spec, spec_for_args, spec_for_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class HFTensor:
    """Where one HF tensor lives and what its header says."""

    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


# ---------------------------------------------------------------- the model's side
def model_spec(model_args: Any, model_name: str | None = None) -> ModelSpec:
    """The spec of ``model_name``, or of the family whose args type ``model_args`` is."""
    return get_model_spec(model_name) if model_name else spec_for_args(model_args)


def expected_shapes(model_args: Any, model_name: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every state-dict tensor of the model described by ``model_args``, with its shape."""
    with torch.device("meta"):
        model = model_spec(model_args, model_name).model_cls(model_args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def initialized_tensors(model_args: Any, names: set[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """The state-dict tensors ``names`` as the model's ``init_weights`` draws them (from
    ``seed``), on the CPU; the rest of the model stays on the meta device, so this costs what
    those tensors do, not the model."""
    with torch.device("meta"):
        model = model_spec(model_args).model_cls(model_args)
    for owner in {name.rpartition(".")[0] for name in names}:
        model.get_submodule(owner).to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model.init_weights(buffer_device=torch.device("meta"))
    state = model.state_dict()
    return {name: state[name] for name in names}


# ---------------------------------------------------------------- reading headers
def _read_json(path: str) -> dict[str, Any]:
    with storage_errors(path, CheckpointError):
        if not storage.exists(path):
            raise CheckpointError(f"hf: {path} not found")
        text = storage.read_text(path)
    try:
        content = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"hf: {path} is not valid JSON ({e})") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"hf: {path}: expected a JSON object")
    return content


def read_safetensors_header(path: str) -> dict[str, HFTensor]:
    """Tensor names, shapes and dtypes from a safetensors header; CheckpointError if truncated."""
    with storage_errors(path, CheckpointError):
        fs, p = storage.filesystem(path)
        if not fs.exists(p):
            raise CheckpointError(f"hf: safetensors file {path} not found")
        size = fs.size(p)
        with fs.open(p, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"hf: {path} is truncated or not a safetensors file")
            raw = f.read(n)
    try:
        header = json.loads(raw)
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in entries.values()), default=0)
        tensors = {
            k: HFTensor(path, tuple(v["shape"]), _ST_DTYPES[v["dtype"]]) for k, v in entries.items()
        }
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise CheckpointError(f"hf: {path} has a corrupt safetensors header") from None
    if 8 + n + end > size:
        raise CheckpointError(
            f"hf: {path} is truncated: needs {8 + n + end} bytes, the file has {size}"
        )
    return tensors


def list_hf_weights(hf: str) -> dict[str, HFTensor]:
    """Every tensor of the HF folder ``hf`` (index + shards, or one file), from headers only."""
    index_path, single_path = storage.join(hf, INDEX_FILE), storage.join(hf, SINGLE_FILE)
    with storage_errors(hf, CheckpointError):
        has_index, has_single = storage.exists(index_path), storage.exists(single_path)
    if not has_index:
        if not has_single:
            raise CheckpointError(f"hf: {hf} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        return read_safetensors_header(single_path)
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"hf: {index_path} has no weight_map")
    headers = {f: read_safetensors_header(storage.join(hf, f)) for f in set(weight_map.values())}
    out = {}
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise CheckpointError(f"hf: {index_path} maps tensor {name} to {file}, which lacks it")
        out[name] = headers[file][name]
    return out


# ---------------------------------------------------------------- config and validation
# Sizes of an HF config.json, where present: each a positive int (a 0 divided, a float or a
# string reached the model as a traceback).
_HF_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def _check_hf_sizes(config: dict[str, Any], source: str) -> None:
    """One CheckpointError line for a size that is not a positive int, heads that do not divide
    into kv groups, or a norm epsilon / rope theta that is not a positive finite number."""
    for key in _HF_SIZES:
        value = config.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise CheckpointError(f"hf: {source}: {key} is {value!r}, expected an int >= 1")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise CheckpointError(
            f"hf: {source}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv}"
        )
    for key in ("rms_norm_eps", "rope_theta"):
        value = config.get(key)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (ok and math.isfinite(value) and value > 0):
            raise CheckpointError(f"hf: {source}: {key} is {value!r}, expected a number > 0")


def model_args_from_hf_config(config: dict[str, Any], source: str) -> Any:
    """Model args (of the family that reads its ``architectures``) of an HF ``config.json``."""
    spec = spec_for_hf_config(config, source)
    _check_hf_sizes(config, source)
    return spec.hf.from_hf_config(config, source)


def read_hf_model_args(hf: str) -> Any:
    """Model args from ``<hf>/config.json``."""
    path = storage.join(hf, "config.json")
    return model_args_from_hf_config(_read_json(path), path)


def check_hf_weights(hf: str, weights: dict[str, HFTensor], model_args: Any) -> list[str]:
    """CheckpointError naming the tensor and file for unknown, missing or misshapen tensors.

    Besides ``to_hf``'s names a folder may hold the family's ``extra_tensors`` (FP8 block
    scales, dropped copies), and lack whole ``optional_part``s: returns the names of those it
    lacks, after one warning line per part (they keep the model's initialization)."""
    spec = spec_for_args(model_args)
    to_hf = spec.hf.to_hf
    shapes = expected_shapes(model_args, spec.name)
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    expected = {k: tuple(v.shape) for k, v in to_hf(meta, model_args).items()}
    found = {name: t.shape for name, t in weights.items()}
    known = {**spec.hf.extra_tensors(found, expected, model_args), **expected}
    for name, t in weights.items():
        if name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and getattr(model_args, "tie_word_embeddings", False)
        ):
            continue  # from_hf drops them: recomputed from the args / the tied embedding
        if name not in known:
            raise CheckpointError(
                f"hf: unknown tensor {name} in {t.file} (not in this {spec.name} model)"
            )
        if t.shape != known[name]:
            raise CheckpointError(
                f"hf: tensor {name} in {t.file} has shape {t.shape}, expected {known[name]}"
            )
    absent = _absent_parts(hf, expected, weights, spec, model_args)
    missing = sorted(set(expected) - set(weights) - set(absent))
    if missing:
        raise CheckpointError(
            f"hf: tensor {missing[0]} missing in {hf} ({len(missing)} missing in all; "
            "does config.json match the weights?)"
        )
    return absent


def _absent_parts(
    hf: str, expected: dict[str, tuple[int, ...]], weights: dict[str, HFTensor], spec: ModelSpec,
    model_args: Any,
) -> list[str]:  # fmt: skip
    """The expected names of the optional parts of which ``weights`` hold no tensor at all."""
    parts: dict[str, list[str]] = {}
    for name in expected:
        if (part := spec.hf.optional_part(name, model_args)) is not None:
            parts.setdefault(part, []).append(name)
    absent = []
    for part, names in parts.items():
        if not any(name in weights for name in names):
            logger.warning(
                "hf: %s has none of the %d tensors of the %s: they start from the model's "
                "initialization",
                hf,
                len(names),
                part,
            )
            absent += names
    return absent


# ---------------------------------------------------------------- loading
def _load_file(path: str) -> dict[str, torch.Tensor]:
    try:
        with storage_errors(path, CheckpointError):
            if storage.is_url(path):
                fs, p = storage.filesystem(path)
                return load_safetensors_bytes(fs.cat_file(p))
            return load_file(path.removeprefix("file://"))
    except SafetensorError as e:
        raise CheckpointError(f"hf: cannot read {path}: {e}") from None


def load_hf_state_dict(weights: dict[str, HFTensor], model_args: Any) -> dict[str, torch.Tensor]:
    """The native (engine-named) state dict of checked ``weights``, file by file."""
    hf_sd: dict[str, torch.Tensor] = {}
    for file in sorted({t.file for t in weights.values()}):
        tensors = _load_file(file)
        hf_sd.update({k: v for k, v in tensors.items() if k in weights})
    return spec_for_args(model_args).hf.from_hf(hf_sd, model_args)


def load_hf_into_model(hf: str, model: nn.Module) -> None:
    """Load an HF folder's weights into ``model`` (plain, or FSDP/TP-sharded across ranks).

    Every rank checks the headers; under torch.distributed only rank 0 reads the tensors and
    broadcasts them, so a node holds one full copy, not one per rank.
    """
    hf = hf.rstrip("/")
    model_args = model.model_args
    weights = list_hf_weights(hf)
    strict = not check_hf_weights(hf, weights, model_args)  # absent parts keep their init
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        state_dict = load_hf_state_dict(weights, model_args) if dist.get_rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        set_model_state_dict(model, state_dict, options=options)
    else:
        options = StateDictOptions(strict=strict)
        set_model_state_dict(model, load_hf_state_dict(weights, model_args), options=options)


__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFTensor",
    "check_hf_weights",
    "expected_shapes",
    "initialized_tensors",
    "list_hf_weights",
    "load_hf_into_model",
    "load_hf_state_dict",
    "model_args_from_hf_config",
    "model_spec",
    "read_hf_model_args",
    "read_safetensors_header",
]
