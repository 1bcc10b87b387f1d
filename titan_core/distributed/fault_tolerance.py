"""Fault-tolerant replica groups on torchft (``fault_tolerance.enable``).

The job is ``parallelism.data_parallel_replicate_degree`` replica groups, each its own torchrun
job whose ranks shard the model as a single replica would (FSDP, TP, PP, CP, EP inside it). A
torchft lighthouse forms a quorum of the live groups before every step; gradients (and the
loss, for the log) are averaged across them through torchft's managed process group, and a
step is committed only when every member of the quorum got through its collectives. A group
that dies is left out of the next quorum, and the others step on; when it is restarted, its
first quorum finds it behind and it receives the weights, optimizer, schedule, data position
and step from a live group's same rank, not from storage. Only the lowest live group saves DCP
checkpoints; when every group died, the restarted job resumes from them as any job does.

Data: the groups read one global order, group ``g`` the slice of data-parallel rank
``g * dp_shard + d``; the cursor is global (every group holds the same one), so a dead group's
samples of the steps it missed are skipped, and a healed group reads on in lockstep.

Healing never unpickles: the state crosses as tensors (DTensors as their local shards, rebuilt
on the receiving rank from its own layout) plus a JSON description, sent by torchft's HTTP
transport and loaded with ``weights_only``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import signal
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from titan_core.config.job import FaultTolerance, JobConfig
from titan_core.errors import CommError, ConfigError, TitanError, first_line
from titan_core.logging import logger

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# host:port of a store the launcher hosts: the groups of a new job meet there before their first
# quorum, so that none trains alone while the others are still starting.
START_STORE_ENV = "TITAN_FT_START_STORE"
# Fault hooks for drills and tests: every rank of groups G,H.. (without fault tolerance: ranks
# G,H..) kills itself (SIGKILL) before step S of its first run ("G,H:S"); while a group is
# missing, each step waits this many seconds more (a short job lasts until the restarted group
# is back).
KILL_ENV = "TITAN_FAULT_FT_KILL"
SLOW_ENV = "TITAN_FAULT_FT_SLOW_S"
DIGEST_ENV = "TITAN_FT_DIGEST"  # set: each rank logs a digest of its state at the end
FR_DUMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # where torch's flight recorder dumps


def quiet_torchft() -> None:
    """torchft's per-step info logs (Rust and Python) down to warnings, unless asked for.

    Call it before the first ``import torchft`` of a process: torchft's Rust extension reads
    ``RUST_LOG`` once, when it is imported (its lighthouse, in the launcher's process, would
    otherwise log every quorum at INFO)."""
    import logging

    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # A peer's death is expected here: said in one line by ReplicaGroup.commit, without the
    # traceback torchft logs with it.
    logging.getLogger("torchft.manager").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _env_hidden(name: str) -> Iterator[None]:
    """``name`` is not in the environment inside the block (restored after)."""
    value = os.environ.pop(name, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[name] = value


def group_config(cfg: JobConfig) -> JobConfig:
    """The config one replica group runs: the replicate dimension is torchft's, so inside the
    group it is 1; everything else as given."""
    if not cfg.fault_tolerance.enable:
        return cfg
    group = copy.copy(cfg)  # not replace(): the job's checks would see a replicate degree of 1
    group.parallelism = dataclasses.replace(cfg.parallelism, data_parallel_replicate_degree=1)
    return group


def lighthouse_address(ft: FaultTolerance) -> str:
    """The lighthouse this group reports to: the config's, else what the launcher exported."""
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            "fault_tolerance.lighthouse: no lighthouse address (titan launch starts one and "
            "sets it; a group started by hand needs --fault_tolerance.lighthouse or "
            f"${LIGHTHOUSE_ENV})"
        )
    return address


class LighthouseLost(TitanError):
    """The replica groups' lighthouse does not answer: no quorum, so no step (exit code 5)."""

    exit_code = 5


def lighthouse_unreachable(address: str, timeout_s: float = 3.0) -> str | None:
    """Why nothing answers at the lighthouse ``address`` (``connection refused``), or None when
    something listens there. The one check of the launchers (before they start anything) and of
    the ranks (when they start, and when a quorum failed)."""
    parsed = urllib.parse.urlsplit(address)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=timeout_s):
            return None
    except OSError as e:
        return (e.strerror or str(e) or type(e).__name__).lower()


def maybe_kill(step: int, who: int) -> None:
    """The drill of ``KILL_ENV`` ("G,H:S"): this process kills itself (SIGKILL) before step S
    of its first run when ``who`` (its replica group under fault tolerance, else its rank) is
    one of G, H.. (tests and bench/fault_tolerance.py only)."""
    if not (kill := os.environ.get(KILL_ENV)):
        return
    victims, at = kill.split(":")
    first_run = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if str(who) in victims.split(",") and int(at) == step and first_run:
        logger.warning("%s=%s: %d dies before step %d", KILL_ENV, kill, who, step)
        os.kill(os.getpid(), signal.SIGKILL)


def _safe_form(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as plain tensors and one JSON string: what ``weights_only`` loads."""
    leaves, spec = tree_flatten(state)
    tensors: dict[str, torch.Tensor] = {}
    values: list[Any] = []
    kinds: list[str] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DTensor):
            tensors[str(i)], kind = leaf.to_local().detach(), "dtensor"
        elif isinstance(leaf, torch.Tensor):
            tensors[str(i)], kind = leaf.detach(), "tensor"
        elif leaf is None or isinstance(leaf, bool | int | float | str):
            values.append(leaf)
            kind = "value"
        else:
            raise TypeError(f"fault_tolerance: cannot send a {type(leaf).__name__} to a peer")
        kinds.append(kind)
    meta = {"spec": treespec_dumps(spec), "kinds": kinds, "values": values}
    return {"tensors": tensors, "meta": json.dumps(meta)}


def _from_safe_form(received: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """The state ``_safe_form`` sent, with DTensors rebuilt on this rank's layout
    (``template``: this rank's own state of the same structure)."""
    meta = json.loads(received["meta"])
    mine, my_spec = tree_flatten(template)
    if treespec_dumps(my_spec) != meta["spec"]:
        raise CommError(
            "fault_tolerance: the live group's state does not have this group's structure "
            "(do all groups run the same config?)"
        )
    values = iter(meta["values"])
    leaves: list[Any] = []
    for i, (kind, here) in enumerate(zip(meta["kinds"], mine, strict=True)):
        if kind == "value":
            leaves.append(next(values))
            continue
        local = received["tensors"][str(i)]
        if isinstance(here, DTensor):
            local = local.to(here.device)
            leaves.append(
                DTensor.from_local(
                    local,
                    here.device_mesh,
                    here.placements,
                    run_check=False,
                    shape=here.shape,
                    stride=here.stride(),
                )
            )
        elif isinstance(here, torch.Tensor):
            leaves.append(local.to(here.device))
        else:
            leaves.append(local)
    return tree_unflatten(leaves, treespec_loads(meta["spec"]))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (its local shard under FSDP/TP), a view to write."""
    return t.to_local() if isinstance(t, DTensor) else t


class SemiSync(Stateful):
    """Semi-synchronous replica groups (``fault_tolerance.semi_sync``): each group steps on
    its own; every ``sync_every`` steps (and after the last) the groups average their weights
    (``local_sgd``) or their drift since the last sync, which an outer Nesterov SGD applies to
    the weights of that sync (``diloco``). Works on each rank's local shards: the layouts are
    the same in every group. Its state (the last sync's weights, the outer momentum) heals with
    the rest."""

    def __init__(self, cfg: FaultTolerance, params: list[torch.nn.Parameter]) -> None:
        self.mode, self.every = cfg.semi_sync, cfg.sync_every
        self.params = params
        self.syncs = 0
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.SGD | None = None
        if self.mode == "diloco":
            self.anchor = [_local(p).detach().clone() for p in params]
            self.outer = torch.optim.SGD(
                self.anchor,
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                nesterov=cfg.outer_momentum > 0,
            )

    def due(self, step: int, last: bool) -> bool:
        """Whether ``step`` ends with a sync (the same answer in every group: by global step)."""
        return last or step % self.every == 0

    def reset(self) -> None:
        """The current weights are the last sync's (after a load from storage)."""
        if self.outer is None:
            return
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(_local(p))

    def payload(self) -> list[torch.Tensor]:
        """What the groups average at a sync: the weights, or the drift since the last sync."""
        with torch.no_grad():
            if self.mode == "local_sgd":
                return [_local(p).detach().clone() for p in self.params]
            return [a - _local(p) for a, p in zip(self.anchor, self.params, strict=True)]

    def apply(self, averaged: list[torch.Tensor]) -> None:
        """Set every group's weights from the average (the outer step first, for diloco)."""
        with torch.no_grad():
            if self.outer is not None:
                for a, g in zip(self.anchor, averaged, strict=True):
                    a.grad = g
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
                averaged = self.anchor
            for p, new in zip(self.params, averaged, strict=True):
                _local(p).copy_(new)
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        if self.outer is None:
            return {"syncs": self.syncs}
        momentum = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchor]
        return {
            "syncs": self.syncs,
            "anchor": self.anchor,
            "momentum": [torch.zeros_like(a) if m is None else m for m, a in
                         zip(momentum, self.anchor, strict=True)],
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.syncs = int(state["syncs"])
        if self.outer is None:
            return
        with torch.no_grad():
            for a, new, m in zip(self.anchor, state["anchor"], state["momentum"], strict=True):
                a.copy_(new)
                self.outer.state[a]["momentum_buffer"] = m.clone()


class ReplicaGroup:
    """This replica group's part in the fault-tolerant job: quorum, averaging, commit, heal.

    ``states`` are what a healing group receives (the checkpoint's stateful parts);
    ``on_heal`` runs after they were loaded from a peer.
    """

    def __init__(
        self,
        cfg: FaultTolerance,
        groups: int,
        device: torch.device,
        states: dict[str, Stateful],
        on_heal: Callable[[], None],
    ) -> None:
        quiet_torchft()
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        if cfg.group_id < 0:
            raise ConfigError(
                "fault_tolerance.group_id: not set (titan launch sets it for each group; a "
                "group started by hand needs --fault_tolerance.group_id)"
            )
        self.group_id, self.groups = cfg.group_id, groups
        self.states, self.on_heal = states, on_heal
        # Before torchft's Manager, which would wait out its connect timeout and fail with a
        # traceback (a group restarted after the lighthouse was lost fails here, in seconds).
        self.lighthouse, self.external = lighthouse_address(cfg), bool(cfg.lighthouse)
        if why := lighthouse_unreachable(self.lighthouse):
            raise LighthouseLost(
                f"the replica groups' lighthouse {self.lighthouse} does not answer ({why})"
                + self._relaunch_hint()
            )
        timeout = timedelta(seconds=cfg.timeout_seconds)

        class SafeHTTPTransport(HTTPTransport):
            """torchft's HTTP transport, loading what it receives with ``weights_only``; its
            server logs errors, not every request."""

            def __init__(self, timeout: timedelta, num_chunks: int) -> None:
                super().__init__(timeout=timeout, num_chunks=num_chunks)
                handler = self._server.RequestHandlerClass
                self._server.RequestHandlerClass = type(
                    "QuietHandler", (handler,), {"log_request": lambda *args, **kwargs: None}
                )

            @classmethod
            def _load_from_address(cls, address: str, timeout: timedelta) -> object:
                import urllib.request
                import warnings

                from torchft.checkpointing._serialization import _streaming_load

                with (
                    urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f,
                    warnings.catch_warnings(),
                ):
                    # The tensors are built on the received bytes, then copied into the states.
                    warnings.filterwarnings("ignore", "The given buffer is not writable")
                    return _streaming_load(f, weights_only=True)

        pg = (
            ProcessGroupGloo(timeout=timeout)
            if device.type == "cpu"
            else ProcessGroupNCCL(timeout=timeout)
        )
        store_addr, store_port = self._incarnation_store()
        # Hidden from torchft's Manager, which would make a folder <TORCH_FR_DUMP_TEMP_FILE>
        # _quorum_<id>/ at every quorum (empty unless a rank dumps) and point the variable into
        # it: titan's ranks dump to <dump_folder>/comm_traces/rank_<rank> (flight_recorder),
        # one folder that torch's fr_trace reads, however many quorums there were.
        with _env_hidden(FR_DUMP_FILE_ENV):
            self.manager = Manager(
                pg=pg,
                load_state_dict=self._load,
                state_dict=self._state,
                min_replica_size=cfg.min_replicas,
                use_async_quorum=False,  # a healed group takes part in the very step it healed at
                init_sync=False,  # every group starts from the same seed (or checkpoint)
                replica_id=f"titan_group_{cfg.group_id}",
                lighthouse_addr=self.lighthouse,
                store_addr=store_addr,
                store_port=store_port,
                rank=dist.get_rank() if dist.is_initialized() else 0,
                world_size=dist.get_world_size() if dist.is_initialized() else 1,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
                connect_timeout=timeout,
                checkpoint_transport=SafeHTTPTransport(timeout=timeout, num_chunks=0),
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        logger.info(
            "fault tolerance: group %d of %d, rank %d, pid %d, restart %s",
            cfg.group_id, groups, rank, os.getpid(), restarts,
        )  # fmt: skip
        self.events: list[tuple[str, int, str]] = []  # (what, live groups, line): health.jsonl
        self.live = 0  # groups in the current quorum
        self.quorum_changes = 0
        self.failed_steps = 0  # steps whose collectives failed: not committed, redone
        self.heals = 0
        self.heal_seconds = 0.0
        self._healed = False

    def _incarnation_store(self) -> tuple[str, int]:
        """A TCPStore of this incarnation of the group (torchft keeps addresses in it): torchrun's
        own store outlives restarts and would hand restarted ranks the dead ones' addresses."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        rank = dist.get_rank() if dist.is_initialized() else 0
        store = None
        if rank == 0:
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = torch.tensor([store.port if store is not None else 0], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            port = port.to(backend_device)
            dist.broadcast(port, src=0)
        self._store = store  # rank 0 hosts it for the group's lifetime
        return host, int(port.item())

    def wait_for_groups(self, timeout_s: float) -> None:
        """At a new job's start (not a group's restart), wait up to ``timeout_s`` for every
        group to arrive, so the first quorum has them all."""
        address = os.environ.get(START_STORE_ENV)
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if not address or restarted:
            return
        if not dist.is_initialized() or dist.get_rank() == 0:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
            store.add("arrived", 1)
            deadline = time.monotonic() + timeout_s
            while store.add("arrived", 0) < self.groups and time.monotonic() < deadline:
                time.sleep(0.05)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    # -------------------------------------------------------------- heal
    def _state(self) -> dict[str, Any]:
        return _safe_form({name: s.state_dict() for name, s in self.states.items()})

    def _load(self, received: dict[str, Any]) -> None:
        template = {name: s.state_dict() for name, s in self.states.items()}
        state = _from_safe_form(received, template)
        for name, s in self.states.items():
            s.load_state_dict(state[name])
        self._healed = True
        self.on_heal()

    # -------------------------------------------------------------- stepping
    def start_step(self) -> bool:
        """The quorum of this step (healing this group from a peer if it is behind); True
        when it healed."""
        self._healed = False
        start = time.perf_counter()
        try:
            self.manager.start_quorum()
        except Exception:
            self._raise_if_lighthouse_lost()
            raise
        live = self.manager.num_participants()
        if live != self.live:
            if self.live:
                self.quorum_changes += 1
                line = f"{live} of {self.groups} replica groups live (was {self.live})"
                logger.warning("fault tolerance: %s", line)
                self.events.append(("left" if live < self.live else "joined", live, line))
            else:
                logger.info("fault tolerance: %d of %d replica groups live", live, self.groups)
            self.live = live
        if self._healed:
            seconds = time.perf_counter() - start
            self.heals += 1
            self.heal_seconds += seconds
            line = f"group {self.group_id} healed from a live group in {seconds:.2f}s"
            logger.info("fault tolerance: %s (quorum included)", line)
            self.events.append(("healed", live, line))
        return self._healed

    def _raise_if_lighthouse_lost(self) -> None:
        """After a failed quorum: ``LighthouseLost`` (one line, naming the lighthouse and the
        step) when the lighthouse does not answer, whatever torchft raised for it."""
        if not (why := lighthouse_unreachable(self.lighthouse)):
            return
        train_state = self.states.get("train_state")
        step = getattr(train_state, "step", None)
        at = f" at step {step + 1}" if self.live and step is not None else " before its first step"
        raise LighthouseLost(
            f"lost the replica groups' lighthouse {self.lighthouse}{at} (no quorum, and it does "
            f"not answer: {why})" + self._relaunch_hint()
        ) from None

    def _relaunch_hint(self) -> str:
        """What to do: a lighthouse of the user's own must be running again before a relaunch
        (the launchers do not relaunch then); a launcher's own is started anew by a relaunch."""
        return "; start it again, then relaunch" if self.external else ""

    def maybe_slow(self) -> None:
        """The drill of ``SLOW_ENV``: while a group is missing, each step waits (tests only)."""
        if (slow := float(os.environ.get(SLOW_ENV, "0"))) and self.live < self.groups:
            time.sleep(slow)

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` (local shards of gradients, the loss) over the live groups, in
        place: one managed all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat).wait()
            parts = flat.split([t.numel() for t in group])
            torch._foreach_copy_(group, [p.view_as(t) for p, t in zip(parts, group, strict=True)])

    def commit(self, what: str = "the step", then: str = "redone") -> bool:
        """Whether this step's update may be applied: every live group got through it. When not,
        the log says that ``what`` did not commit, and ``then`` what happens."""
        ok = self.manager.should_commit()
        if not ok:
            self.failed_steps += 1
            error = self.manager.errored()
            why = first_line(error.original_exception) if error is not None else "a peer's vote"
            if "Connection closed by peer" in why or "Connection reset" in why:
                why = "a peer's connection closed: a replica group died"
            logger.warning("fault tolerance: %s did not commit (%s): %s", what, why, then)
            self.events.append(("redone", self.live, f"{what} did not commit ({why}): {then}"))
        return ok

    def saves(self) -> bool:
        """Whether this group writes checkpoints: the lowest live group does."""
        return self.manager.participating_rank() == 0

    def metrics(self) -> dict[str, float]:
        """What the log and MLflow show of the replica groups."""
        return {
            "ft/live_groups": float(self.live),
            "ft/quorum_changes": float(self.quorum_changes),
            "ft/steps_redone": float(self.failed_steps),
            "ft/heals": float(self.heals),
            "ft/heal_seconds": self.heal_seconds,
        }

    def digest(self, parts: tuple[str, ...] = ("model", "optimizer")) -> str:
        """A sha256 of this rank's state ``parts`` (local shards), to compare groups."""
        h = hashlib.sha256()
        leaves, _ = tree_flatten({k: self.states[k].state_dict() for k in parts})
        for leaf in leaves:
            if isinstance(leaf, DTensor):
                leaf = leaf.to_local()
            if isinstance(leaf, torch.Tensor):
                h.update(leaf.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(leaf).encode())
        return h.hexdigest()[:16]

    def close(self) -> None:
        if os.environ.get(DIGEST_ENV):
            rank = dist.get_rank() if dist.is_initialized() else 0
            logger.info(
                "fault tolerance: group %d rank %d state digest %s, model digest %s",
                self.group_id, rank, self.digest(), self.digest(("model",)),
            )  # fmt: skip
        self.manager.shutdown(wait=False)
