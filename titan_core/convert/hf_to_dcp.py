"""Hugging Face Llama folder -> DCP model-only checkpoint, and HF weights straight into a model.

A folder is ``config.json`` plus either ``model.safetensors.index.json`` with its shards or a
single ``model.safetensors``, on local disk or any fsspec URL. Every shard's header is read and
checked (names, shapes, truncation) before any tensor data is, and before anything is written.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_core import storage
from titan_core.checkpoint.dcp_io import dcp_writer
from titan_core.checkpoint.manager import COMMIT_MARKER
from titan_core.convert import StagedOutput, expected_shapes, format_size, storage_errors
from titan_core.convert.dcp_to_hf import INDEX_FILE
from titan_core.errors import CheckpointError
from titan_core.logging import logger
from titan_core.models import get_model_spec
from titan_core.models.common import ffn_hidden_dim
from titan_core.models.llama3 import RopeScaling

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


# ---------------------------------------------------------------- reading headers
def _read_json(path: str) -> dict[str, Any]:
    with storage_errors(path):
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
    with storage_errors(path):
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
    with storage_errors(hf):
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
def _ffn_sizing(dim: int, intermediate: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) giving ``intermediate``; a known flavor's if one fits."""
    flavors = get_model_spec("llama3").flavors.values()
    candidates = [(f.multiple_of, f.ffn_dim_multiplier) for f in flavors if f.dim == dim]
    candidates += [(2**k, None) for k in range(12, -1, -1)]
    for multiple_of, multiplier in candidates:
        if ffn_hidden_dim(dim, multiple_of, multiplier) == intermediate:
            return multiple_of, multiplier
    # Any size is reachable with multiple_of=1; +0.5 keeps int() from rounding down.
    multiplier = (intermediate + 0.5) / int(2 * (4 * dim) / 3)
    assert ffn_hidden_dim(dim, 1, multiplier) == intermediate
    return 1, multiplier


def _rope_from_config(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"hf: {source}: rope_type {rope_type!r} is not supported (llama3)")
    defaults = RopeScaling()
    return theta, RopeScaling(
        factor=float(rope.get("factor", defaults.factor)),
        low_freq_factor=float(rope.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(rope.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def model_args_from_hf_config(config: dict[str, Any], source: str) -> Any:
    """Llama 3 model args describing the model of an HF ``config.json``."""
    if config.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"hf: {source}: model_type {config['model_type']!r}, expected 'llama'"
        )
    missing = [
        k
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        if k not in config
    ]
    if missing:
        raise CheckpointError(f"hf: {source} lacks {', '.join(missing)}")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // n_heads) != dim // n_heads:
        raise CheckpointError(f"hf: {source}: head_dim != hidden_size / num_attention_heads")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError(f"hf: {source}: attention_bias / mlp_bias are not supported")
    theta, scaling = _rope_from_config(config, source)
    multiple_of, multiplier = _ffn_sizing(dim, config["intermediate_size"])
    return get_model_spec("llama3").args_cls(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        vocab_size=config["vocab_size"],
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(config.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def check_hf_weights(hf: str, weights: dict[str, HFTensor], model_args: Any) -> None:
    """CheckpointError naming the tensor and file for unknown, missing or misshapen tensors."""
    to_hf = get_model_spec("llama3").to_hf
    meta = {k: torch.empty(s, device="meta") for k, s in expected_shapes(model_args).items()}
    expected = {k: tuple(v.shape) for k, v in to_hf(meta, model_args).items()}
    for name, t in weights.items():
        if name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and model_args.tie_word_embeddings
        ):
            continue  # from_hf drops them: recomputed from the args / the tied embedding
        if name not in expected:
            raise CheckpointError(
                f"hf: unknown tensor {name} in {t.file} (not in this Llama model)"
            )
        if t.shape != expected[name]:
            raise CheckpointError(
                f"hf: tensor {name} in {t.file} has shape {t.shape}, expected {expected[name]}"
            )
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(
            f"hf: tensor {missing[0]} missing in {hf} ({len(missing)} missing in all; "
            "does config.json match the weights?)"
        )


# ---------------------------------------------------------------- loading
def _load_file(path: str) -> dict[str, torch.Tensor]:
    try:
        with storage_errors(path):
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
    return get_model_spec("llama3").from_hf(hf_sd, model_args)


def read_hf_model_args(hf: str) -> Any:
    """Model args from ``<hf>/config.json``."""
    path = storage.join(hf, "config.json")
    return model_args_from_hf_config(_read_json(path), path)


def hf_to_dcp(hf: str, output: str, *, model_args: Any | None = None) -> Any:
    """Save an HF Llama folder as a committed model-only DCP checkpoint (step 0) at ``output``.

    Model args come from ``config.json`` unless given; returns the args used.
    """
    hf = hf.rstrip("/")
    model_args = model_args if model_args is not None else read_hf_model_args(hf)
    weights = list_hf_weights(hf)
    check_hf_weights(hf, weights, model_args)
    state_dict = load_hf_state_dict(weights, model_args)
    with StagedOutput(output, last=COMMIT_MARKER) as out:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            writer = dcp_writer(out.staging)
            dcp.save({"model": state_dict}, storage_writer=writer, no_dist=True)
        marker = {"step": 0, "model_only": True, "time": time.time(), "source": hf}
        storage.write_text_atomic(storage.join(out.staging, COMMIT_MARKER), json.dumps(marker))
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    logger.info("Wrote DCP checkpoint %s (%s) from %s", output, format_size(nbytes), hf)
    return model_args


def load_hf_into_model(hf: str, model: nn.Module) -> None:
    """Load an HF folder's weights into ``model`` (plain, or FSDP/TP-sharded across ranks).

    Every rank checks the headers; under torch.distributed only rank 0 reads the tensors and
    broadcasts them, so a node holds one full copy, not one per rank.
    """
    hf = hf.rstrip("/")
    model_args = model.model_args
    weights = list_hf_weights(hf)
    check_hf_weights(hf, weights, model_args)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        state_dict = load_hf_state_dict(weights, model_args) if dist.get_rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state_dict, options=options)
    else:
        set_model_state_dict(model, load_hf_state_dict(weights, model_args))


__all__ = [
    "HFTensor",
    "check_hf_weights",
    "hf_to_dcp",
    "list_hf_weights",
    "load_hf_into_model",
    "load_hf_state_dict",
    "model_args_from_hf_config",
    "read_hf_model_args",
    "read_safetensors_header",
]
