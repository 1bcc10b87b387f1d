"""DCP checkpoint -> Hugging Face folder, streamed one safetensors shard at a time.

Shards are planned from the checkpoint's metadata (sizes only), so every tensor is checked
against the model's expected shapes before anything is written. Each shard file is then written
front to back, tensor by tensor. For a local checkpoint the tensors' bytes are found in place in
the ``.distcp`` files (``dcp_direct``) and copied, cast or row-reordered (the q/k RoPE
permutation, derived from the state-dict adapter) straight into the file (``shard_writer``):
memory stays at a few small buffers. Tensors that cannot be found that way (remote URLs, TP
column chunks, anything unexpected) are read with one ``dcp.load`` of a partial state dict per
shard (DCP reshards FSDP/TP saves to this process) and converted through the adapter: then at
most one shard of tensors (in the checkpoint's dtype) plus one tensor is alive at once.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_core import storage
from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.checkpoint.hf_weights import INDEX_FILE, expected_shapes, model_spec
from titan_core.checkpoint.manager import (
    COMMIT_MARKER,
    check_healthy,
    data_file_damage,
    read_marker,
)
from titan_core.convert import (
    StagedOutput,
    format_size,
    one_intra_op_thread,
    progress_bar,
    storage_errors,
)
from titan_core.convert.dcp_direct import DataFiles, StoredTensor, locate
from titan_core.convert.hf_tokenizer import TOKENIZER_FILES, export_hf_tokenizer
from titan_core.convert.shard_writer import ShardWriter
from titan_core.data.tokenizer import Tokenizer
from titan_core.errors import CheckpointError, ConfigError
from titan_core.logging import logger

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MODEL_PREFIX = "model."  # DCP flattens {"model": state_dict} to model.<fqn>
_DCP_SINGLE_PROCESS_WARNING = ".*torch.distributed is disabled.*"


# ---------------------------------------------------------------- planning
@dataclass(frozen=True)
class PlannedTensor:
    """One model tensor as the checkpoint stores it and as the HF folder will name it."""

    name: str  # native FQN, e.g. layers.0.attention.wq.weight
    hf_name: str  # the first of ``parts`` when there are several
    shape: tuple[int, ...]
    dtype: torch.dtype  # as saved in the checkpoint
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(HF name, shape) of each HF tensor when the family splits this one into several (MoE
    experts: stacked natively, one tensor per expert in HF); empty for a one-to-one tensor."""

    def hf_tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(HF name, shape) of every HF tensor this one becomes, in the adapter's order."""
        return self.parts or ((self.hf_name, self.shape),)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Size in bytes in ``dtype`` (default: as saved)."""
        return torch.Size(self.shape).numel() * (dtype or self.dtype).itemsize


def _check_checkpoint_dir(checkpoint: str) -> Any:
    """DCP metadata of a committed checkpoint directory."""
    with storage_errors(checkpoint):
        if not storage.exists(checkpoint):
            raise CheckpointError(f"checkpoint: {checkpoint} does not exist")
        if not storage.exists(storage.join(checkpoint, COMMIT_MARKER)):
            raise CheckpointError(
                f"checkpoint: {checkpoint} has no commit marker {COMMIT_MARKER} "
                "(an interrupted save, or not a titan checkpoint)"
            )
        check_healthy(checkpoint, read_marker(checkpoint), "checkpoint")
        if not storage.exists(storage.join(checkpoint, ".metadata")):
            raise CheckpointError(f"checkpoint: {checkpoint} has no DCP .metadata file")
        metadata = dcp_reader(checkpoint).read_metadata()
        _check_data_files(checkpoint, metadata)
    return metadata


def _check_data_files(checkpoint: str, metadata: Any) -> None:
    """Every data file holding model tensors exists and is long enough (no truncation)."""
    if (why := data_file_damage(checkpoint, metadata, MODEL_PREFIX)) is not None:
        raise CheckpointError(f"checkpoint: {why}")


def read_checkpoint_tensors(
    checkpoint: str, model_args: Any, model_name: str | None = None
) -> list[PlannedTensor]:
    """The model tensors of a committed DCP checkpoint, validated against ``model_args``.

    CheckpointError naming the directory or tensor when it is missing or uncommitted, or a
    tensor is unknown, missing or of the wrong shape.
    """
    return _read_plan(checkpoint, model_args, model_name)[1]


def _read_plan(
    checkpoint: str, model_args: Any, model_name: str | None
) -> tuple[Any, list[PlannedTensor]]:
    """(DCP metadata, validated model tensors) of a committed checkpoint."""
    metadata = _check_checkpoint_dir(checkpoint)
    saved = {
        key.removeprefix(MODEL_PREFIX): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX)
    }
    expected = expected_shapes(model_args, model_name)
    for name in saved:
        if name not in expected:
            raise CheckpointError(
                f"checkpoint: unknown tensor {MODEL_PREFIX}{name} in {checkpoint} "
                "(not a parameter of this model: check --module/--config and the flavor)"
            )
    to_hf = model_spec(model_args, model_name).hf.to_hf
    planned = []
    for name, shape in expected.items():
        hf = to_hf({name: torch.empty(shape, device="meta")}, model_args)
        if not hf:
            continue  # dropped by the family (a tied output: transformers ties it on load)
        md = saved.get(name)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint: tensor {MODEL_PREFIX}{name} missing in {checkpoint}"
            )
        if tuple(md.size) != shape:
            raise CheckpointError(
                f"checkpoint: tensor {MODEL_PREFIX}{name} has shape {tuple(md.size)}, expected "
                f"{shape} for this model (check the flavor, vocab_size and n_layers)"
            )
        parts = tuple((k, tuple(v.shape)) for k, v in hf.items()) if len(hf) > 1 else ()
        planned.append(PlannedTensor(name, next(iter(hf)), shape, md.properties.dtype, parts))
    return metadata, planned


def plan_shards(
    tensors: list[PlannedTensor], dtype: torch.dtype, max_shard_size: int
) -> list[list[PlannedTensor]]:
    """Order-keeping greedy split into shards of at most ``max_shard_size`` bytes in ``dtype``.

    A single tensor larger than the limit gets a shard of its own, as transformers does.
    """
    shards: list[list[PlannedTensor]] = []
    size = 0
    for t in tensors:
        if not shards or (shards[-1] and size + t.nbytes(dtype) > max_shard_size):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes(dtype)
    return shards


# ---------------------------------------------------------------- streaming
def load_tensors(checkpoint: str, group: list[PlannedTensor]) -> dict[str, torch.Tensor]:
    """Read ``group``'s full (unsharded) tensors from the checkpoint with one ``dcp.load``."""
    state = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in group}
    try:
        with warnings.catch_warnings(), storage_errors(checkpoint):
            warnings.filterwarnings("ignore", message=_DCP_SINGLE_PROCESS_WARNING)
            reader = dcp_reader(checkpoint)
            dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    except dcp.CheckpointException as e:  # a BaseException: `except Exception` misses it
        others = f" (or one of the {len(group) - 1} tensors after it)" if len(group) > 1 else ""
        raise CheckpointError(
            f"checkpoint: cannot read {MODEL_PREFIX}{group[0].name}{others} from {checkpoint}: "
            f"{_root_cause(e)}"
        ) from None
    return state


def _root_cause(e: BaseException) -> str:
    """One line for the first per-rank failure inside a DCP CheckpointException."""
    failures = list(getattr(e, "failures", {}).values())
    cause = failures[0] if failures else e
    cause = cause[0] if isinstance(cause, tuple) else cause  # DCP keeps (exception, stack)
    if isinstance(cause, pickle.UnpicklingError | EOFError):
        return f"corrupt or truncated tensor data ({type(cause).__name__})"
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else 'no detail'}"


def convert_shard(
    state: dict[str, torch.Tensor],
    group: list[PlannedTensor],
    dtype: torch.dtype,
    model_args: Any,
    model_name: str | None = None,
) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
    """HF tensors of one shard, converted one at a time (popping ``state`` as it goes); a
    tensor the family splits yields one item per part, in ``hf_tensors`` order."""
    to_hf = model_spec(model_args, model_name).hf.to_hf
    for t in group:
        converted = to_hf({t.name: state.pop(t.name)}, model_args)
        planned = t.hf_tensors()
        assert list(converted) == [n for n, _ in planned], (t.name, list(converted))
        for (hf_name, shape), value in zip(planned, converted.values()):
            value = value.to(dtype).contiguous()
            assert tuple(value.shape) == shape, (hf_name, value.shape)
            yield t, value
            del value
        del converted


def row_order(
    t: PlannedTensor, model_args: Any, model_name: str | None = None
) -> torch.Tensor | None:
    """The dim-0 row order the adapter's ``to_hf`` gives ``t`` (None when rows stay in place).

    Found by converting a small tensor of element ids of ``t``'s rank (two elements per trailing
    dimension); ValueError when the conversion is anything but a reordering of whole rows. A
    tensor split into ``parts`` streams as stored (None) when the parts, back to back as the
    shard lays them out, are its bytes in order (stacked experts split on dim 0).
    """
    if not t.shape:
        raise ValueError("0-d tensor")
    probe_shape = (t.shape[0],) + (2,) * (len(t.shape) - 1)
    per_row = 2 ** (len(t.shape) - 1)
    ids = torch.arange(t.shape[0] * per_row).view(probe_shape)
    try:
        converted = model_spec(model_args, model_name).hf.to_hf({t.name: ids}, model_args)
    except Exception as e:  # e.g. a conversion that needs the real trailing sizes
        raise ValueError(f"the conversion fails on a probe: {e}") from e
    if t.parts:
        if list(converted) != [name for name, _ in t.parts] or not torch.equal(
            torch.cat([v.reshape(-1) for v in converted.values()]), ids.reshape(-1)
        ):
            raise ValueError("the parts are not the tensor's bytes in order")
        return None
    if len(converted) != 1:
        raise ValueError("the conversion gives several tensors")
    ((hf_name, out),) = converted.items()
    if out is ids and hf_name == t.hf_name:
        return None  # passed through untouched
    if hf_name != t.hf_name or tuple(out.shape) != probe_shape or out.dtype != ids.dtype:
        raise ValueError("the conversion renames differently or reshapes")
    flat = out.reshape(t.shape[0], per_row)  # (rows, per_row)
    order = flat[:, 0] // per_row
    if not torch.equal(flat, order[:, None] * per_row + torch.arange(per_row)):
        raise ValueError("the conversion is not a reordering of whole rows")
    if not torch.equal(order.sort().values, torch.arange(t.shape[0])):
        raise ValueError("the conversion repeats or drops rows")
    return None if torch.equal(order, torch.arange(t.shape[0])) else order


# ---------------------------------------------------------------- output files
def hf_config(model_args: Any, dtype: str, tok: Tokenizer | None, model_name: str | None) -> dict:
    """``config.json`` contents; for RoPE models the 4.x rope keys are added for readers that
    predate v5."""
    config = {**model_spec(model_args, model_name).hf.to_hf_config(model_args)}
    rope = config.get("rope_parameters")
    if rope is not None:
        config["rope_theta"] = rope["rope_theta"]
        scaled = rope["rope_type"] != "default"
        config["rope_scaling"] = (
            {k: v for k, v in rope.items() if k != "rope_theta"} if scaled else None
        )
    config["torch_dtype"] = dtype
    if tok is not None:
        config.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return config


def _write_json(path: str, content: dict[str, Any]) -> None:
    storage.write_text(path, json.dumps(content, indent=2) + "\n")


def _write_metadata_files(
    out: StagedOutput, model_args: Any, dtype: str, tok: Tokenizer | None, model_name: str | None
) -> None:
    _write_json(out.local_path("config.json"), hf_config(model_args, dtype, tok, model_name))
    generation = {} if tok is None else {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    _write_json(out.local_path("generation_config.json"), generation)
    names = ["config.json", "generation_config.json"]
    if tok is not None:
        export_hf_tokenizer(tok.path, out.local_dir, model_max_length=model_args.max_seq_len)
        names += TOKENIZER_FILES
    for name in names:
        out.commit(name)


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


Direct = dict[str, tuple[StoredTensor, torch.Tensor | None]]  # name -> (bytes, row order)


def locate_direct(
    checkpoint: str, metadata: Any, tensors: list[PlannedTensor], model_args: Any,
    model_name: str | None, files: DataFiles,
) -> Direct:  # fmt: skip
    """The tensors to stream straight from the checkpoint's files, with their HF row order."""
    stored = locate(checkpoint, metadata, [MODEL_PREFIX + t.name for t in tensors], files)
    direct: Direct = {}
    for t in tensors:
        if MODEL_PREFIX + t.name in stored:
            with contextlib.suppress(ValueError):  # not a row reordering: converted in memory
                direct[t.name] = (
                    stored[MODEL_PREFIX + t.name],
                    row_order(t, model_args, model_name),
                )
    return direct


def write_shard(
    path: str, group: list[PlannedTensor], direct: Direct, checkpoint: str, dtype: torch.dtype,
    model_args: Any, model_name: str | None, files: DataFiles, scratch: dict[str, torch.Tensor],
) -> None:  # fmt: skip
    """One safetensors file: ``direct`` tensors streamed from the checkpoint's files (through
    the reused ``scratch`` buffers), the rest read with one ``dcp.load`` and converted in memory,
    all in ``group`` order."""
    rest = [t for t in group if t.name not in direct]
    state = load_tensors(checkpoint, rest) if rest else {}
    converted = convert_shard(state, rest, dtype, model_args, model_name)
    entries = [(name, dtype, shape) for t in group for name, shape in t.hf_tensors()]
    with ShardWriter(path, entries, files, scratch) as writer:
        for t in group:
            if t.name in direct:
                writer.write_stored(direct[t.name][0], dtype, direct[t.name][1])
                continue
            for _ in t.hf_tensors():
                done, value = next(converted)
                assert done is t
                writer.write_tensor(value)
                del value  # freed before the next tensor is converted


def dcp_to_hf(
    checkpoint: str,
    output: str,
    *,
    model_args: Any,
    tokenizer_path: str | None,
    dtype: str = "bfloat16",
    max_shard_size: int = 5 * 10**9,
    progress: bool = False,
    model_name: str | None = None,
) -> list[str]:
    """Export a DCP checkpoint (any sharding, local path or fsspec URL) as an HF folder.

    Publishes ``output`` atomically once complete; returns the shard file names.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    if max_shard_size <= 0:
        raise ConfigError(f"max_shard_size: expected a number of bytes > 0, got {max_shard_size}")
    metadata, tensors = _read_plan(checkpoint, model_args, model_name)
    tok = Tokenizer(tokenizer_path) if tokenizer_path else None
    if tok is not None and tok.n_words > model_args.vocab_size:
        raise CheckpointError(
            f"tokenizer {tokenizer_path}: {tok.n_words} tokens, expected at most the model's "
            f"vocab_size {model_args.vocab_size}"
        )
    out_dtype = DTYPES[dtype]
    shards = plan_shards(tensors, out_dtype, max_shard_size)
    names = [_shard_name(i, len(shards)) for i in range(len(shards))]
    total = sum(t.nbytes(out_dtype) for t in tensors)
    staged = StagedOutput(output, last=INDEX_FILE)
    files = DataFiles(checkpoint)
    scratch: dict[str, torch.Tensor] = {}  # the direct path's buffers, reused by every shard
    with contextlib.closing(files), staged as out, one_intra_op_thread():
        direct = locate_direct(checkpoint, metadata, tensors, model_args, model_name, files)
        with progress_bar("dcp-to-hf", total, progress) as advance:
            for name, group in zip(names, shards):
                with storage_errors(output):
                    write_shard(out.local_path(name), group, direct, checkpoint, out_dtype,
                                model_args, model_name, files, scratch)  # fmt: skip
                out.commit(name)
                advance(sum(t.nbytes(out_dtype) for t in group))
        _write_metadata_files(out, model_args, dtype, tok, model_name)
        weight_map = {
            hf_name: name
            for name, group in zip(names, shards)
            for t in group
            for hf_name, _ in t.hf_tensors()
        }
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out.local_path(INDEX_FILE), index)
        out.commit(INDEX_FILE)
    logger.info(
        "Wrote %d shard(s), %s of %s weights, to %s", len(names), format_size(total), dtype, output
    )
    return names
