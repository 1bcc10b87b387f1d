"""Process-group set-up, device choice, seeding and determinism."""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_core.distributed import flight_recorder
from titan_core.logging import logger


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        """True on the global rank 0."""
        return self.rank == 0


def device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(init_timeout_seconds: int, trace_buf_size: int, dump_folder: str) -> DistInfo:
    """Initialize the default process group from torchrun's environment (no-op for one process)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev_type = device_type()
    if dev_type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        # The flight recorder is configured through env vars read at process-group creation.
        flight_recorder.configure(trace_buf_size, dump_folder)
        backend = "cuda:nccl,cpu:gloo" if dev_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=init_timeout_seconds)
        store = _restart_store(rank, world_size, timeout)
        dist.init_process_group(
            backend=backend, timeout=timeout, store=store, rank=rank, world_size=world_size
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def _restart_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """After a torchrun restart on torchrun's shared store: that store under a prefix of its
    own (else None, and init_process_group builds its store as usual).

    torchrun (>= 2.4) keeps one TCPStore for all restarts of a job and hands it to the workers
    without a per-attempt prefix, so the new workers' process groups would read the killed
    attempt's keys (gloo: dead peers' addresses) and hang until the init timeout. The prefix
    helps where every agent counts the same restarts (one node); across nodes an agent whose
    workers were healthy restarts without counting, so titan's launchers switch the sharing off
    instead (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a fresh store per rendezvous round).
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    return dist.PrefixStore(f"titan/restart_{restart}", store)


def set_determinism(seed: int, deterministic: bool, warn_only: bool, rank_offset: int = 0) -> None:
    """Seed every RNG (offset per pipeline stage when asked) and optionally force determinism."""
    seed = seed + rank_offset
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for the engine
        pass
    if deterministic:
        logger.info("Deterministic algorithms enabled (slower; warn_only=%s)", warn_only)
        # MKL picks sgemm kernels by memory alignment, which differs between processes, so a
        # resumed run (a new process) would drift in the last bits. Conditional Numerical
        # Reproducibility fixes the code path; MKL reads it at its first call, which has not
        # happened yet when the trainer gets here.
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def barrier() -> None:
    """Barrier over the default group when one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    """Tear the default group down if it was created."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global gradient norm over all ranks' shards (and over the pipeline stages of
    ``pp_group``); clips in place when ``max_norm > 0``.

    Gradients may be DTensors on different meshes (expert-parallel experts live on the
    (efsdp, ep[, tp]) mesh, dense parameters on (dp_shard[, tp])): DTensor ops cannot mix
    meshes, so each mesh's gradients get their own norm, reduced over that mesh, and the
    squared norms add up (torchtitan's EP-aware clipping)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = {}  # parameters by their gradient's mesh
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        # The local norm is a partial over sharded dims; full_tensor() reduces it across ranks.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total_norm = norms[0]
    elif norms:
        total_norm = torch.stack([n.float() for n in norms]).pow(2).sum().sqrt()
    else:
        total_norm = torch.zeros((), device=parameters[0].device if parameters else "cpu")
    if pp_group is not None:
        # Each stage holds different parameters: the squared norms add up across stages.
        total_norm = total_norm**2
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_group)
        total_norm = total_norm**0.5
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)
    return total_norm
