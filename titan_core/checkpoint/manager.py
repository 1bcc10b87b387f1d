"""DCP checkpointing: interval/async saves, commit markers, keep-latest-k, seed and resume.

Layout under ``<dump_folder>/<checkpoint.folder>/``: ``step-<N>/`` per save and ``seed/`` for the
seed checkpoint. A directory counts only once rank 0 has written its commit marker (after DCP's
own metadata), so a process killed mid-save leaves the previous step as the one that loads. The
marker lists every file's size and checksum (``checkpoint.integrity``), checked before a load.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from titan_core import storage
from titan_core.checkpoint.dcp_io import DcpWriter, dcp_reader, dcp_writer
from titan_core.checkpoint.integrity import COMMIT_MARKER, FileEntry, file_damage, marker_files
from titan_core.checkpoint.states import LoadPlanner
from titan_core.config.dtypes import TORCH_DTYPES
from titan_core.config.job import Checkpoint as CheckpointConfig
from titan_core.errors import CheckpointError, first_line, os_error_words, storage_errors
from titan_core.logging import logger
from titan_core.models import model_from_description

STAGER_SINGLE_USE = torch.__version__ < (2, 13)
"""torch 2.11-2.12: ``DefaultStager`` closes its state-dict stager after its first staging, which
empties the stager's copy table, so a second save with it fails (``KeyError: <class 'type'>``,
seen on an H100 with torch 2.11). There every pinned-memory save gets a fresh stager (its pinned
buffers are allocated again); torch 2.13 keeps one stager and its buffers for the whole run."""

SEED_DIR = "seed"
_STEP_RE = re.compile(r"^step-(\d+)$")
# Test hook: SIGKILL this process after DCP wrote step N but before its commit marker.
FAULT_ENV = "TITAN_FAULT_KILL_BEFORE_COMMIT_STEP"


def complete_steps(folder: str) -> list[int]:
    """Steps under ``folder`` whose commit marker exists, ascending."""
    steps = []
    for name in storage.list_dirs(folder):
        match = _STEP_RE.match(name)
        if match and storage.exists(storage.join(folder, name, COMMIT_MARKER)):
            steps.append(int(match.group(1)))
    return sorted(steps)


NO_SPACE = "no space left on device"


def save_failure_words(error: BaseException, folder: str) -> str:
    """Why a checkpoint save failed, in words: the OSError in its chain (``no space left on
    device``, ``read-only file system``, ...); torch's zip writer turns a full disk into
    "unexpected pos", so a local folder with less than 1% or 64 MiB free counts as full."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno is not None:
            return os_error_words(e)
        failures = getattr(e, "failures", None) or {}
        todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    if not storage.is_url(folder):
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(os.path.expanduser(folder))
            if usage.free < max(usage.total // 100, 64 << 20):
                return f"{NO_SPACE} ({usage.free >> 20} MiB free in {folder})"
    return f"{type(error).__name__}: {first_line(error)}"


def read_marker(step_dir: str) -> dict[str, Any] | None:
    """The commit marker of a checkpoint directory, or None when it is incomplete;
    ``CheckpointError`` naming the file when it does not parse (a damaged marker)."""
    path = storage.join(step_dir, COMMIT_MARKER)
    if not storage.exists(path):
        return None
    try:
        marker = json.loads(storage.read_text(path))
    except (ValueError, UnicodeDecodeError):
        marker = None
    if not isinstance(marker, dict) or not {"step", "model_only"} <= set(marker):
        raise CheckpointError(f"checkpoint: {path}: commit marker does not parse (damaged)")
    return marker


def damage(step_dir: str, *, verify: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint in ``step_dir`` cannot be loaded, in one line (its commit marker does
    not parse, its metadata does not read or match its checksum, a data file is missing, shorter
    than the metadata says or not as the marker lists it), or None when it looks whole. Reads the
    marker and the metadata, lists the data files and, with ``verify``, reads this rank's
    ``share`` of them against their checksums (``data_file_damage``)."""
    try:
        with storage_errors(step_dir, CheckpointError):
            if read_marker(step_dir) is None:
                return f"{step_dir}: no commit marker (incomplete)"
            metadata = dcp_reader(step_dir).read_metadata()
    except CheckpointError as e:
        return str(e).removeprefix("checkpoint: ")
    except Exception as e:  # EOFError and the like from a cut-short .metadata
        return f"{storage.join(step_dir, '.metadata')}: unreadable ({type(e).__name__})"
    return data_file_damage(step_dir, metadata, verify=verify, share=share)


def data_file_damage(
    step_dir: str,
    metadata: Any,
    prefix: str = "",
    *,
    verify: bool = True,
    share: tuple[int, int] = (0, 1),
) -> str | None:
    """The first data file of a DCP checkpoint holding tensors under ``prefix`` that is missing
    or shorter than its ``metadata`` says, or (where the commit marker lists checksums) of
    another size or, with ``verify``, other bytes than the marker says, in one line; None when
    all are whole. One listing; ``share`` = (rank, world size): which files this rank reads
    (``integrity.file_damage``)."""
    needed: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn.startswith(prefix):
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    fs, root = storage.filesystem(step_dir)
    with storage_errors(step_dir, CheckpointError):
        sizes = {posixpath.basename(e["name"]): e.get("size") for e in fs.ls(root, detail=True)}
    for name, size in sorted(needed.items()):
        where = storage.join(step_dir, name)
        if name not in sizes:
            return f"{where}: data file missing"
        if (sizes[name] or 0) < size:
            return f"{where}: {sizes[name]} bytes, the metadata needs {size} (truncated)"
    listed = marker_files(step_dir)
    files = {name: listed[name] for name in needed if name in listed}
    return file_damage(step_dir, files, sizes, verify=verify, share=share)


def is_unhealthy(marker: dict[str, Any] | None) -> bool:
    """Whether a commit marker says the checkpoint's weights are not finite (saved with the
    step guard off: ``health.enable``; with it on, no such checkpoint is ever saved)."""
    return ((marker or {}).get("health") or {}).get("healthy") is False


def newest_healthy(folder: str, steps: list[int]) -> int | None:
    """The newest of the complete ``steps`` in ``folder`` whose commit marker does not mark it
    unhealthy (a marker that does not parse is no healthy one either), or None. Reads markers
    newest first, so usually one."""
    for step in sorted(steps, reverse=True):
        try:
            marker = read_marker(storage.join(folder, f"step-{step}"))
        except CheckpointError:
            continue
        if marker is not None and not is_unhealthy(marker):
            return step
    return None


def check_healthy(step_dir: str, marker: dict[str, Any] | None, key: str) -> None:
    """Refuse (``CheckpointError``) a checkpoint marked unhealthy; ``key`` names the input."""
    if is_unhealthy(marker):
        raise CheckpointError(
            f"{key}: {step_dir} holds non-finite weights (its commit marker says healthy: "
            "false; it was saved with health.enable off); use an earlier checkpoint"
        )


def checkpoint_model(step_dir: str) -> tuple[str, Any] | None:
    """(family, model args) that a checkpoint's commit marker describes; None when there is no
    marker or it describes no model (checkpoints written before markers did)."""
    with storage_errors(step_dir, CheckpointError):
        marker = read_marker(step_dir)
    if marker is None or "model" not in marker:
        return None
    return model_from_description(marker["model"], storage.join(step_dir, COMMIT_MARKER))


class CheckpointManager:
    """Saves and restores the named ``Stateful`` states of a training job with DCP."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        dump_folder: str,
        states: dict[str, Stateful],
        *,
        rank: int,
        world_size: int,
    ) -> None:
        self.cfg = cfg
        self.folder = storage.resolve(dump_folder, cfg.folder)
        self.states = states
        self.rank = rank
        self._pending: tuple[Future, int, bool, DcpWriter, dict[str, Any] | None] | None = None
        self._staging: Future | None = None
        self.skipped: list[tuple[int, str]] = []
        """Damaged steps ``load`` passed over, newest first, with why."""
        self._stager: DefaultStager | None = None
        self._stager_spent = False
        self._staging_options: StagingOptions | None = None
        self.reader: Callable[[dict[str, Any], str], None] | None = None
        """Replaces DCP's load (COMM_MODE=local_tensor reads without collectives)."""
        self.hf_loader: Callable[[str, torch.nn.Module], None] | None = None
        """Loads a Hugging Face folder into the model (``checkpoint.initial_load_in_hf``); set
        by the trainer, so that checkpointing does not depend on conversion."""
        self.model_description: dict[str, Any] | None = None
        """``models.describe_model`` of the trained model, written into every commit marker
        (key ``model``) so that a checkpoint names its own model; set by the trainer."""
        self.health: dict[str, Any] | None = None
        """The step guard's mark for the next save (``{"healthy": true, ...}``, key ``health``
        of the commit marker); set by the trainer after each read of the guard; None: no guard."""
        self._pg = None
        if cfg.enable and cfg.async_mode != "disabled" and world_size > 1:
            # Background saves must not share a process group with training collectives.
            self._pg = dist.new_group(backend="gloo")
        if cfg.enable and cfg.async_mode == "async_with_pinned_mem":
            if torch.cuda.is_available():
                # Copy GPU -> pinned CPU memory on a side stream while the next step computes.
                self._staging_options = StagingOptions(
                    use_pinned_memory=True,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=True,
                )
                self._stager = DefaultStager(self._staging_options)
            else:
                logger.info(
                    "checkpoint.async_mode=async_with_pinned_mem: no CUDA, so no pinned "
                    "memory; staging to ordinary CPU memory (same as 'async')"
                )

    # ------------------------------------------------------------------ paths
    def step_dir(self, step: int) -> str:
        """Directory of the checkpoint for ``step``."""
        return storage.join(self.folder, f"step-{step}")

    @property
    def seed_dir(self) -> str:
        """Directory of the seed checkpoint."""
        return storage.join(self.folder, SEED_DIR)

    # ------------------------------------------------------------------ load
    def load(self) -> int:
        """Restore the newest complete checkpoint (or load_step / seed / initial_load_path).

        Returns the training step to continue from (0 when starting fresh).
        """
        if not self.cfg.enable:
            return 0
        steps = complete_steps(self.folder)
        if self.cfg.load_step != -1:
            if self.cfg.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step: no complete checkpoint for step {self.cfg.load_step} "
                    f"in {self.folder} (complete: {steps or 'none'})"
                )
            path = self.step_dir(self.cfg.load_step)
            if (why := self._damage(path)) is not None:
                raise CheckpointError(f"checkpoint.load_step: {why}")
            check_healthy(path, read_marker(path), "checkpoint.load_step")
            return self._load_dir(path)
        # The newest whole, healthy step: a damaged one (cut short by a full disk, a bad copy)
        # is said and passed over, never loaded halfway; so is one whose marker says its
        # weights were not finite (saved with health.enable off): training on from it would
        # only carry the NaNs on.
        for step in reversed(steps):
            what, why = "damaged", self._damage(self.step_dir(step))
            if why is None and is_unhealthy(read_marker(self.step_dir(step))):
                what, why = "unhealthy", "its commit marker says its weights are not finite"
            if why is None:
                return self._load_dir(self.step_dir(step))
            self.skipped.append((step, why))
            logger.warning("Checkpoint step-%d is %s, not loaded: %s", step, what, why)
        if steps:
            raise CheckpointError(
                f"checkpoint: every complete step in {self.folder} is damaged or unhealthy "
                f"(newest: {self.skipped[0][1]}); restore one, or set checkpoint.folder to "
                "start over"
            )
        if read_marker(self.seed_dir) is not None:
            if (why := self._damage(self.seed_dir)) is not None:
                raise CheckpointError(f"checkpoint: the seed checkpoint is damaged: {why}")
            logger.info("No step checkpoint yet: loading the seed checkpoint %s", self.seed_dir)
            return self._load_dir(self.seed_dir)
        if self.cfg.initial_load_path:
            return self._load_initial(self.cfg.initial_load_path)
        logger.info("No checkpoint in %s: starting from freshly initialized weights", self.folder)
        return 0

    def _damage(self, path: str) -> str | None:
        """``damage`` of ``path`` as all ranks see it: each rank reads its share of the files
        against their checksums (``checkpoint.verify``) and the first complaint, in rank order,
        is every rank's verdict. Without collectives (one process, a simulated world: ``reader``
        set) this process reads every file."""
        together = self.reader is None and dist.is_initialized() and dist.get_world_size() > 1
        share = (dist.get_rank(), dist.get_world_size()) if together else (0, 1)
        why = damage(path, verify=self.cfg.verify == "checksum", share=share)
        if together:
            verdicts: list[str | None] = [None] * share[1]
            dist.all_gather_object(verdicts, why)
            why = next((v for v in verdicts if v is not None), None)
        return why

    def load_step(self, step: int) -> tuple[int, bool]:
        """Restore the complete checkpoint of ``step`` (0: the seed checkpoint), as a health
        rollback does; returns (its step, whether it held the model only)."""
        path = self.seed_dir if step == 0 else self.step_dir(step)
        marker = read_marker(path)
        if marker is None:
            raise CheckpointError(f"{path}: not a complete checkpoint")
        return self._load_dir(path), bool(marker["model_only"])

    def _load_initial(self, path: str) -> int:
        if self.cfg.initial_load_in_hf:
            if self.hf_loader is None:
                raise CheckpointError(
                    "checkpoint.initial_load_in_hf: this job cannot read Hugging Face folders"
                )
            logger.info("Loading Hugging Face weights from initial_load_path %s", path)
            self.hf_loader(path, self.states["model"].model)
            return 0
        if not storage.exists(storage.join(path, ".metadata")):
            raise CheckpointError(
                f"checkpoint.initial_load_path: {path} is not a DCP checkpoint (no .metadata)"
            )
        if read_marker(path) is not None and (why := self._damage(path)) is not None:
            raise CheckpointError(f"checkpoint.initial_load_path: {why}")
        keys = ["model"] if self.cfg.initial_load_model_only else self._loadable_keys()
        logger.info("Loading %s from initial_load_path %s", keys, path)
        self._dcp_load(path, keys)
        return 0 if self.cfg.initial_load_model_only else self._restored_step()

    def _load_dir(self, path: str) -> int:
        marker = read_marker(path)
        assert marker is not None, f"{path} has no commit marker"
        keys = ["model"] if marker["model_only"] else self._loadable_keys()
        start = time.perf_counter()
        self._dcp_load(path, keys)
        step = marker["step"] if marker["model_only"] else self._restored_step()
        if marker["model_only"] and step > 0:
            logger.warning(
                "step-%d holds model weights only: optimizer, dataloader and RNG "
                "state start fresh from here",
                step,
            )
        logger.info(
            "Loaded %s from %s (step %d) in %.2fs",
            keys,
            path,
            marker["step"],
            time.perf_counter() - start,
        )
        return step

    def _loadable_keys(self) -> list[str]:
        return [k for k in self.states if k not in self.cfg.exclude_from_loading]

    def _restored_step(self) -> int:
        train_state = self.states.get("train_state")
        return int(getattr(train_state, "step", 0))

    def _dcp_load(self, path: str, keys: list[str]) -> None:
        state = {k: self.states[k] for k in keys}
        if self.reader is not None:
            self.reader(state, path)
            return
        try:
            dcp.load(
                state,
                storage_reader=dcp_reader(path),
                planner=LoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
        except dcp.CheckpointException as e:  # a BaseException: `except Exception` misses it
            # The first rank's own error says what went wrong; DCP's wrapper only lists ranks.
            cause = next(iter(e.failures.values()))[0] if e.failures else e
            if isinstance(cause, CheckpointError):  # already one clear line
                raise cause from None
            detail = (str(cause).strip().splitlines() or ["no detail"])[0]
            raise CheckpointError(
                f"checkpoint: cannot load {keys} from {path}: {type(cause).__name__}: {detail}"
            ) from e

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, last: bool) -> bool:
        """Whether ``step`` is a save point (interval, or the last step)."""
        if not self.cfg.enable or self.cfg.load_only:
            return False
        return last or step % self.cfg.interval == 0

    def save(self, step: int, *, last: bool = False, stop: bool = False) -> None:
        """Save ``step`` if it is a save point (``should_save``; ``stop``: the job stops here on
        request, see ``titan_core.stop_request``); async modes return once state is staged.
        The last step's save is model-only with ``last_save_model_only``; a stop's is the full
        state (optimizer, schedule, data, RNG), which a later run resumes from."""
        if not self.should_save(step, last or stop):
            return
        self.wait()
        model_only = self.cfg.model_weights_only or (last and self.cfg.last_save_model_only)
        self._write(self.step_dir(step), step, model_only)

    def save_seed(self) -> str:
        """Write the model as the seed checkpoint (model only, export dtype) and return its dir."""
        self._write(self.seed_dir, 0, model_only=True, blocking=True)
        return self.seed_dir

    def _write(self, path: str, step: int, model_only: bool, blocking: bool = False) -> None:
        if self.rank == 0 and storage.exists(path):
            storage.remove_tree(path)  # debris of an earlier, interrupted save of this step
        if dist.is_initialized():
            dist.barrier()
        state = self._model_only_state() if model_only else dict(self.states)
        writer = dcp_writer(path)
        start = time.perf_counter()
        if self.cfg.async_mode == "disabled" or blocking:
            try:
                self._save_now(state, writer)
            except (Exception, dcp.CheckpointException) as e:
                why = self._failed_save(path, e)
                # A full disk: free what keep_latest_k would free after this save, then once more.
                if not (why.startswith(NO_SPACE) and self._free_before_save(step)):
                    raise CheckpointError(f"checkpoint: saving {path} failed: {why}") from None
                logger.warning("Saving %s failed (%s): freed older steps, saving again", path, why)
                try:
                    self._save_now(state, writer := dcp_writer(path))
                except (Exception, dcp.CheckpointException) as again:
                    why = self._failed_save(path, again)
                    raise CheckpointError(f"checkpoint: saving {path} failed: {why}") from None
            self._commit(path, step, model_only, writer.files)
            logger.info("Saved checkpoint %s in %.2fs", path, time.perf_counter() - start)
        else:
            if self._stager is not None and self._stager_spent:
                self._stager.close()
                self._stager = DefaultStager(self._staging_options or StagingOptions())
            result = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self._pg,
                async_stager=self._stager,
                no_dist=not dist.is_initialized(),
            )
            if self._stager is not None:  # an AsyncSaveResponse: staging runs in background too
                self._stager_spent = STAGER_SINGLE_USE
                self._staging = result.staging_completion
                result = result.upload_completion
            # The mark of the state staged now: the next save point may set another before this
            # save commits.
            self._pending = (result, step, model_only, writer, self.health)
            logger.info(
                "Staged checkpoint %s in %.2fs (writing in background)",
                path,
                time.perf_counter() - start,
            )

    def _model_only_state(self) -> dict[str, Any]:
        dtype = TORCH_DTYPES[self.cfg.export_dtype]
        model_sd = self.states["model"].state_dict()
        return {
            "model": {k: v.to(dtype) if v.is_floating_point() else v for k, v in model_sd.items()}
        }

    def _commit(
        self,
        path: str,
        step: int,
        model_only: bool,
        files: dict[str, FileEntry],
        health: dict[str, Any] | None = None,
    ) -> None:
        """Rank 0: write the commit marker of ``path``, with ``files`` (each file's size and
        checksum, from the coordinator's writer: no collective, so that an async save commits
        on rank 0 alone) and ``health``, the step guard's mark of the state saved (default:
        the current one, for a save that commits as it is written)."""
        health = self.health if health is None else health
        if os.environ.get(FAULT_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.rank == 0:
            marker: dict[str, Any] = {"step": step, "model_only": model_only, "time": time.time()}
            marker["files"] = files
            if self.model_description is not None:
                marker["model"] = self.model_description
            if health is not None and path != self.seed_dir:
                marker["health"] = health
            storage.write_text(storage.join(path, COMMIT_MARKER), json.dumps(marker))
            if path != self.seed_dir:
                self._purge(step)

    def _save_now(self, state: dict[str, Any], writer: DcpWriter) -> None:
        # One process without a process group (a seed, a single-rank run): say so to DCP.
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())

    def _failed_save(self, path: str, error: BaseException) -> str:
        """After a failed save of ``path``: remove what it wrote (rank 0; the folder is this
        save's own, emptied before it began) and say why in words."""
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            with contextlib.suppress(Exception):
                storage.remove_tree(path)
        if dist.is_initialized():
            dist.barrier()
        return save_failure_words(error, self.folder)

    def _free_before_save(self, step: int) -> bool:
        """Remove the complete steps that keep_latest_k removes once ``step`` is saved, never
        the newest complete one nor the newest healthy one; whether any was removed (all ranks
        agree: one listing)."""
        keep = self.cfg.keep_latest_k
        complete = [s for s in complete_steps(self.folder) if s < step]
        doomed = complete[: -max(keep - 1, 1)] if keep else []
        healthy = newest_healthy(self.folder, complete) if doomed else None
        doomed = [s for s in doomed if s != healthy]  # the state a stopped run goes back to
        if self.rank == 0:
            for old in doomed:
                storage.remove_tree(self.step_dir(old))
                logger.warning("Removed checkpoint step-%d early to make room", old)
        if dist.is_initialized():
            dist.barrier()
        return bool(doomed)

    def _purge(self, newest: int) -> None:
        """Drop complete steps beyond keep_latest_k (never the newest healthy one, when newer
        ones are marked unhealthy) and incomplete debris older than ``newest``."""
        keep = self.cfg.keep_latest_k
        complete = complete_steps(self.folder)
        doomed = complete[:-keep] if keep else []
        healthy = newest_healthy(self.folder, complete) if doomed else None
        doomed = [s for s in doomed if s != healthy]  # the state a stopped run goes back to
        for name in storage.list_dirs(self.folder):
            match = _STEP_RE.match(name)
            if match and int(match.group(1)) < newest and int(match.group(1)) not in complete:
                doomed.append(int(match.group(1)))
        for step in doomed:
            storage.remove_tree(self.step_dir(step))
            logger.info("Removed old checkpoint step-%d", step)

    def wait_for_staging(self) -> None:
        """Block until a background copy of the weights is done (call before they change)."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def poll(self) -> None:
        """Commit a finished background save without blocking (call once per step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until a pending background save is written, then commit it."""
        if self._pending is None:
            return
        future, step, model_only, writer, health = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as e:  # the write failed: no half-written step
            path = self.step_dir(step)
            why = self._failed_save(path, e)
            if why.startswith(NO_SPACE):
                self._free_before_save(step)  # room for the next save, after a restart
            raise CheckpointError(f"checkpoint: saving {path} failed: {why}") from None
        self._commit(self.step_dir(step), step, model_only, writer.files, health)
        logger.info("Background checkpoint step-%d committed", step)

    def close(self) -> None:
        """Finish pending work."""
        self.wait_for_staging()
        self.wait()
        if self._stager is not None:
            self._stager.close()
