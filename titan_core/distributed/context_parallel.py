"""Context parallelism (CP): ring attention along the sequence, on CUDA and on CPU.

torch's ``context_parallel`` shards the batch, labels and RoPE table along the sequence, turns
the q/k/v of every ``F.scaled_dot_product_attention`` call into sequence-sharded DTensors and
routes the attention op to a ring implementation that rotates K/V between the CP ranks and
merges the partial results by their logsumexp. torch ships ring handlers for the CUDA attention
ops only; on CPU the op is ``aten._scaled_dot_product_flash_attention_for_cpu``, which also
returns the logsumexp the merge needs, so this module registers handlers for it (forward and
backward) that reuse torch's own templated ring attention. torch's private CP module is reached
only through ``_torch_cp_internals``, which checks that what is used still exists.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.utils._pytree import tree_map

from titan_core.config.job import JobConfig
from titan_core.errors import ConfigError
from titan_core.logging import logger

__all__ = [
    "check_context_parallel",
    "context_parallel_context",
    "enable_cpu_ring_attention",
    "model_cp_buffers",
    "pad_values_to_query_head_size",
]

aten = torch.ops.aten
_SEQ_DIM = 2  # q/k/v are (bs, heads, seq, head_dim) at the attention op
# The torch release the CPU handlers were written against and verified with; other releases are
# accepted only while the internals below keep the names and parameters checked here.
TESTED_TORCH = "2.13"
_ROTATE_METHODS = ("allgather", "alltoall")


def check_context_parallel(cfg: JobConfig) -> None:
    """Reject CP settings the ring cannot run, before any process group exists."""
    cp = cfg.parallelism.context_parallel_degree
    seq_len = cfg.training.seq_len
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len: expected a multiple of 2 * parallelism.context_parallel_degree "
            f"({2 * cp}; each CP rank holds a head and a tail chunk), got {seq_len}"
        )


@functools.cache
def _torch_cp_internals() -> ModuleType:
    """torch's private CP module, checked to still have what the CPU handlers use."""
    try:  # newer releases keep CP in a package; older ones in a single module
        from torch.distributed.tensor.experimental._context_parallel import _attention as mod
    except ImportError:  # pragma: no cover - depends on the torch release
        from torch.distributed.tensor.experimental import _attention as mod
    expected = {
        "custom_ops": None,
        "set_rotate_method": ("rotate_method",),
        "_templated_ring_attention": ("group", "seq_dim", "op", "query", "key", "value"),
        "_templated_ring_attention_backward": (
            "group",
            "seq_dim",
            "op",
            "grad_out",
            "grad_out_name",
            "query",
            "key",
            "value",
            "out",
            "logsumexp",
            "is_causal",
        ),
    }
    for name, params in expected.items():
        obj = getattr(mod, name, None)
        found = obj is not None and (
            isinstance(obj, dict)
            if params is None
            else set(params) <= set(inspect.signature(obj).parameters)
        )
        if not found:
            raise RuntimeError(
                f"context parallel on CPU: torch {torch.__version__} no longer provides "
                f"{mod.__name__}.{name} as the CPU ring-attention handlers expect (written "
                f"for torch {TESTED_TORCH}); use context_parallel_degree 1 or torch {TESTED_TORCH}"
            )
    if not torch.__version__.startswith(TESTED_TORCH + "."):
        logger.warning(
            "Context parallel on CPU reuses torch internals verified on torch %s only; this is "
            "torch %s: compare a CP run against a single process before trusting it",
            TESTED_TORCH,
            torch.__version__,
        )
    return mod


def _cpu_ring_forward(
    group: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Ring attention forward on local shards: returns (out, logsumexp)."""
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("CPU ring attention supports neither attn_mask nor dropout")
    return _torch_cp_internals()._templated_ring_attention(
        group,
        _SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _cpu_ring_backward(
    group: Any,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Ring attention backward on local shards: returns (grad_q, grad_k, grad_v)."""
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("CPU ring attention supports neither attn_mask nor dropout")
    return _torch_cp_internals()._templated_ring_attention_backward(
        group,
        _SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _dtensor_handler(ring: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., object]:
    """Wrap a local ring function as a DTensor custom-op handler: every tensor argument is
    sequence-sharded on one CP mesh, and so is every result."""

    def handler(op_call: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        meshes: list[DeviceMesh] = []

        def unwrap(x: object) -> object:
            if not isinstance(x, DTensor):
                return x
            if tuple(x.placements) != (Shard(_SEQ_DIM),):
                raise NotImplementedError(
                    f"{op_call}: context parallel expects inputs sharded on the sequence "
                    f"(Shard({_SEQ_DIM})), got {x.placements}"
                )
            meshes.append(x.device_mesh)
            return x.to_local()

        local_args, local_kwargs = tree_map(unwrap, (args, kwargs))
        mesh = meshes[0]
        results = ring(mesh.get_group(), *local_args, **local_kwargs)
        return tuple(
            DTensor.from_local(r, mesh, [Shard(_SEQ_DIM)], run_check=False) for r in results
        )

    return handler


def enable_cpu_ring_attention() -> None:
    """Add the CPU attention op's ring handlers to the table torch's CP dispatcher installs on
    entering ``context_parallel`` (and removes on exit); idempotent."""
    table = _torch_cp_internals().custom_ops
    table.setdefault(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        _dtensor_handler(_cpu_ring_forward),
    )
    table.setdefault(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        _dtensor_handler(_cpu_ring_backward),
    )


def _equal_head_sizes(sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``sdpa`` with values zero-padded to the query/key head size and the output sliced back.

    The CPU's one fused attention kernel needs a single head size, and only fused kernels run
    as a ring: with values narrower than the queries (multi-head latent attention: qk 192, v
    128) SDPA on CPU falls back to its decomposed math path, which context parallel cannot
    shard. Zero value channels leave the real ones unchanged. (CUDA's memory-efficient kernel
    takes the two sizes as they are.)"""

    @functools.wraps(sdpa)
    def padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        v_head_dim = value.shape[-1]
        if query.shape[-1] <= v_head_dim:
            return sdpa(query, key, value, *args, **kwargs)
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - v_head_dim))
        return sdpa(query, key, value, *args, **kwargs)[..., :v_head_dim]

    return padded


@contextlib.contextmanager
def pad_values_to_query_head_size() -> Iterator[None]:
    """Within the body, ``F.scaled_dot_product_attention`` (whatever it is now: inside
    ``context_parallel``, its ring wrapper) pads narrower values (``_equal_head_sizes``), so
    that CPU runs a fused kernel: CP on CPU, and ``titan estimate``'s fake-tensor profiles
    (GPU kernels do not materialize the score matrix either)."""
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = _equal_head_sizes(sdpa)
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = sdpa


@contextlib.contextmanager
def context_parallel_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore: Sequence[torch.Tensor] = (),
    rotate_method: str = "allgather",
) -> Iterator[None]:
    """Run the body with SDPA as ring attention over ``cp_mesh``.

    ``buffers`` are resharded in place along ``seq_dims``, head-tail load balanced (each rank
    holds chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``), and restored on exit unless listed
    in ``no_restore``. ``rotate_method`` is how K/V move between ranks: "allgather" or "alltoall".
    """
    if rotate_method not in _ROTATE_METHODS:
        raise ConfigError(
            f"parallelism.context_parallel_rotate_method: expected one of {_ROTATE_METHODS}, "
            f"got {rotate_method!r}"
        )
    if cp_mesh.device_type == "cpu":
        enable_cpu_ring_attention()
    _torch_cp_internals().set_rotate_method(rotate_method)
    seq_len = buffers[0].shape[seq_dims[0]]
    pad = pad_values_to_query_head_size if cp_mesh.device_type == "cpu" else contextlib.nullcontext
    with (
        context_parallel(
            cp_mesh,
            buffers=list(buffers),
            buffer_seq_dims=list(seq_dims),
            no_restore_buffers=set(no_restore),
        ),
        pad(),
    ):
        _log_once(
            "Context parallel: ring attention over %d ranks (%s rotation), %d of %d tokens "
            "per sequence on this rank",
            cp_mesh.size(),
            rotate_method,
            buffers[0].shape[seq_dims[0]],
            seq_len,
        )
        yield


@functools.cache
def _log_once(msg: str, *args: object) -> None:
    logger.info(msg, *args)


def model_cp_buffers(
    model_parts: Sequence[nn.Module],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    more: Sequence[torch.Tensor] = (),
) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """(buffers, seq_dims, no_restore) for one micro-batch: the inputs and labels (bs, seq) and
    ``more`` (bs, seq, ...) tensors, consumed by the step, and each model part's RoPE table
    (seq, head_dim // 2), restored after.

    The table must have exactly ``seq`` rows so that its shards line up with the tokens'.
    """
    tables = [part.freqs_cis for part in model_parts if hasattr(part, "freqs_cis")]
    for table in tables:
        if table.shape[0] != inputs.shape[1]:
            raise ValueError(
                f"context parallel: the RoPE table has {table.shape[0]} rows but the batch has "
                f"{inputs.shape[1]} tokens per sequence; build the model with "
                "max_seq_len == training.seq_len"
            )
    # The buffers are resharded in place: views of one storage would overwrite each other.
    # Storage identity, not data_ptr: fake tensors (COMM_MODE dry runs) all report address 0.
    if inputs.untyped_storage()._cdata == labels.untyped_storage()._cdata:
        raise ValueError("context parallel: inputs and labels must not share storage")
    buffers = [inputs, labels, *more, *tables]
    return buffers, [1] * (2 + len(more)) + [0] * len(tables), [inputs, labels, *more]
