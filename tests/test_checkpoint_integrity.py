"""A checkpoint knows its own bytes: every file's checksum is taken while it is written, kept in
the commit marker and checked before a load; changed bytes anywhere (model, optimizer or
data-loader state, the start of a file, ``.metadata``) make the step damaged, and the load falls
back to the previous complete step, with one and two ranks (synchronous and asynchronous saves).

Real DCP saves and loads through ``CheckpointManager`` of small states (a 2-rank world on gloo,
its model and optimizer tensors sharded as DTensors so that each rank writes its own file);
``tests/test_storage_faults.py`` drills the same through ``titan train``, ``eval`` and
``convert``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from storage_faults import flip

from titan_core.checkpoint import integrity
from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.checkpoint.manager import COMMIT_MARKER, CheckpointManager
from titan_core.config.job import Checkpoint
from titan_core.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ROWS = 64  # 64 x 256 fp32 tensors: 64 KiB each, so the middle of an item is tensor payload


class Box:
    """A ``Stateful`` dict: tensors are loaded in place, plain values replaced."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = dict(state_dict)

    @property
    def step(self) -> int:  # read by the manager from its "train_state"
        return int(self.values["step"])


def _states(value: float, rank: int = 0, mesh: Any = None) -> dict[str, Box]:
    """The states of step ``value`` (every tensor element equals it); with ``mesh``, tensors
    are sharded over it (each rank writes its shard to its own file)."""

    def tensor() -> Any:
        full = torch.full((ROWS, 256), value)
        if mesh is None:
            return full
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(full, mesh, [Shard(0)])

    return {
        "model": Box(w=tensor(), b=tensor()),
        "optimizer": Box(exp_avg=tensor(), exp_avg_sq=tensor()),
        "dataloader": Box(**{f"dp_rank_{rank}": {"position": int(value) * 100 + rank}}),
        "train_state": Box(step=int(value)),
    }


def _values(states: dict[str, Box]) -> set[float]:
    """Every distinct tensor element (this rank's shards) and the step, as floats."""
    seen: set[float] = {float(states["train_state"].step)}
    for key in ("model", "optimizer"):
        for t in states[key].values.values():
            local = t.to_local() if hasattr(t, "to_local") else t
            seen |= set(local.unique().tolist())
    return seen


def _damage(step: Path, where: str) -> str:
    """Change bytes of ``step`` at ``where`` and return the file's name: "<fqn>" (the middle of
    that item, a flattened state key; "<fqn> in <file>": its chunk in that file), "start of
    <file>" or ".metadata" (its middle)."""
    if where == ".metadata" or where.startswith("start of "):
        name = where.removeprefix("start of ")
        flip(step / name, (step / name).stat().st_size // 2 if name == ".metadata" else 0)
        return name
    fqn, _, name = where.partition(" in ")
    items = dcp_reader(str(step)).read_metadata().storage_data.items()
    info = next(v for k, v in items if k.fqn == fqn and name in ("", v.relative_path))
    flip(step / info.relative_path, info.offset + info.length // 2)
    return info.relative_path


def _config(**kw: Any) -> Checkpoint:
    return Checkpoint(enable=True, interval=1, keep_latest_k=0, **kw)


def _saved(folder: Path | str, **kw: Any) -> Path | str:
    """Steps 1 and 2 of the one-process states saved in ``folder`` (a path or a URL)."""
    saver = CheckpointManager(_config(**kw), str(folder), _states(1.0), rank=0, world_size=1)
    saver.save(1)
    saver.states = _states(2.0)
    saver.save(2)
    saver.close()
    return folder


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of one rank, saved in the background (``async``); copied by each test."""
    return Path(_saved(tmp_path_factory.mktemp("saved") / "run", async_mode="async"))


def _loaded(folder: Path | str, **kw: Any) -> tuple[int, CheckpointManager]:
    loader = CheckpointManager(_config(**kw), str(folder), _states(0.0), rank=0, world_size=1)
    return loader.load(), loader


ONE_RANK_DAMAGE = [
    "model.w",  # the middle of a model tensor: loaded silently before checksums
    "optimizer.exp_avg_sq",
    "dataloader.dp_rank_0.position",
    "start of __0_0.distcp",  # read as a bad optimizer value before, with no fallback
    ".metadata",
]


@pytest.mark.parametrize("where", ONE_RANK_DAMAGE)
def test_changed_bytes_anywhere_fall_back_to_the_previous_step(
    where: str, two_steps: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(two_steps, tmp_path / "run"))
    marker = json.loads((folder / "checkpoint" / "step-2" / COMMIT_MARKER).read_text())
    assert set(marker["files"]) == {".metadata", "__0_0.distcp"}  # the async commit has them
    name = _damage(folder / "checkpoint" / "step-2", where)
    step, loader = _loaded(folder)
    assert step == 1 and _values(loader.states) == {1.0}
    assert loader.states["dataloader"].values == {"dp_rank_0": {"position": 100}}
    [(skipped, why)] = loader.skipped
    assert skipped == 2 and why.startswith(f"{folder}/checkpoint/step-2/{name}: checksum mismatch")


def test_a_checkpoint_at_a_url_knows_its_bytes_too(tmp_path: Path) -> None:
    """DCP's fsspec writer (any URL: S3, here fsspec's in-memory store) is hashed as it
    uploads; the check reads it back through fsspec."""
    import fsspec

    url, fs = f"memory://{tmp_path.name}", fsspec.filesystem("memory")
    try:
        folder = _saved(url)
        step2 = f"/{tmp_path.name}/checkpoint/step-2"
        files = json.loads(fs.cat(f"{step2}/{COMMIT_MARKER}"))["files"]
        assert set(files) == {".metadata", "__0_0.distcp"}
        data = bytearray(fs.cat(f"{step2}/__0_0.distcp"))
        data[len(data) // 2] ^= 0xFF
        fs.pipe(f"{step2}/__0_0.distcp", bytes(data))
        step, loader = _loaded(folder)
        assert step == 1 and _values(loader.states) == {1.0}
        assert loader.skipped[0][1].startswith(f"{url}/checkpoint/step-2/__0_0.distcp: checksum")
    finally:
        fs.rm(f"/{tmp_path.name}", recursive=True)


def test_verify_size_skips_reading_and_old_markers_get_size_checks(
    two_steps: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(two_steps, tmp_path / "run"))
    step2 = folder / "checkpoint" / "step-2"
    _damage(step2, "model.w")
    step, loader = _loaded(folder, verify="size")  # the data files are only listed
    assert step == 2 and _values(loader.states) - {2.0}  # the changed bytes were loaded
    # A marker written before checksums: sizes (from the metadata) are still checked.
    marker_path = step2 / COMMIT_MARKER
    marker = json.loads(marker_path.read_text())
    del marker["files"]
    marker_path.write_text(json.dumps(marker))
    assert _loaded(folder)[0] == 2  # its changed bytes go unnoticed, as they did
    with open(step2 / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    step, loader = _loaded(folder)
    assert step == 1 and "__0_0.distcp: 1000 bytes, the metadata needs" in loader.skipped[0][1]
    # Bytes added to a file listed in the marker: its size no longer matches.
    folder = Path(shutil.copytree(two_steps, tmp_path / "run2"))
    with open(folder / "checkpoint" / "step-2" / "__0_0.distcp", "ab") as f:
        f.write(b"\0")
    step, loader = _loaded(folder, verify="size")
    assert step == 1 and "bytes, the commit marker says" in loader.skipped[0][1]


def test_crc32_where_xxhash_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without xxhash a process writes and checks CRC-32 (the standard library's); a step
    hashed with a hash this process lacks gets the size checks only, never a false alarm."""
    crc32 = integrity.HASHES["crc32"]
    monkeypatch.setattr(integrity, "HASHES", {"crc32": crc32})
    folder = _saved(tmp_path / "crc")
    marker = json.loads((folder / "checkpoint" / "step-2" / COMMIT_MARKER).read_text())
    assert all(set(entry) == {"bytes", "crc32"} for entry in marker["files"].values())
    flip(folder / "checkpoint" / "step-2" / "__0_0.distcp", 0)
    step, loader = _loaded(folder)
    assert step == 1 and "__0_0.distcp: checksum mismatch (crc32 " in loader.skipped[0][1]
    monkeypatch.setattr(integrity, "HASHES", {"hash_of_2030": crc32})  # one this process lacks
    other = _saved(tmp_path / "other")
    monkeypatch.undo()
    assert _loaded(other)[0] == 2


def test_a_damaged_seed_checkpoint_is_one_line(tmp_path: Path) -> None:
    saver = CheckpointManager(_config(), str(tmp_path), _states(1.0), rank=0, world_size=1)
    seed = Path(saver.save_seed())
    assert set(json.loads((seed / COMMIT_MARKER).read_text())["files"]) == {
        ".metadata",
        "__0_0.distcp",
    }
    assert _loaded(tmp_path)[0] == 0  # whole: it loads
    _damage(seed, "model.b")
    with pytest.raises(CheckpointError, match=r"seed checkpoint is damaged: .*__0_0.distcp: check"):
        _loaded(tmp_path)


# ---------------------------------------------------------------- two ranks (gloo)
TWO_RANK_DAMAGE = [  # each file is read against its checksum by the rank that wrote it
    "model.w in __0_0.distcp",
    "model.w in __1_0.distcp",
    "optimizer.exp_avg in __1_0.distcp",
    "dataloader.dp_rank_1.position",
    "start of __1_0.distcp",
    ".metadata",
]


def _two_rank_worker(rank: int, world: int, port: int, folder: str) -> None:
    """Save steps 1 and 2 in the background on 2 ranks, then for each kind of damage to step 2
    (applied by rank 0), load on both: both fall back to step 1 and say the same."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        cfg = _config(async_mode="async")
        saver = CheckpointManager(cfg, folder, _states(1.0, rank, mesh), rank=rank, world_size=2)
        saver.save(1)
        saver.states = _states(2.0, rank, mesh)
        saver.save(2)
        saver.close()
        dist.barrier()  # rank 0 commits after its own write; the test reads its marker
        step2 = Path(folder) / "checkpoint" / "step-2"
        files = set(json.loads((step2 / COMMIT_MARKER).read_text())["files"])
        assert files == {".metadata", "__0_0.distcp", "__1_0.distcp"}, files
        pristine = Path(folder).parent / "pristine-step-2"
        if rank == 0:
            shutil.copytree(step2, pristine)
        for where in TWO_RANK_DAMAGE:
            if rank == 0:
                shutil.rmtree(step2)
                shutil.copytree(pristine, step2)
                name = _damage(step2, where)
            dist.barrier()
            states = _states(0.0, rank, mesh)
            loader = CheckpointManager(_config(), folder, states, rank=rank, world_size=2)
            assert loader.load() == 1, where
            assert _values(loader.states) == {1.0}, where
            position = loader.states["dataloader"].values[f"dp_rank_{rank}"]["position"]
            assert position == 100 + rank, where
            [(skipped, why)] = loader.skipped
            both: list[Any] = [None, None]
            dist.all_gather_object(both, why)
            assert both[0] == both[1], both  # one verdict, whichever rank read the file
            if rank == 0:
                assert skipped == 2 and why.startswith(f"{step2}/{name}: checksum mismatch"), why
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_fall_back_together_whichever_file_changed(tmp_path: Path) -> None:
    mp.spawn(_two_rank_worker, args=(2, free_port(), str(tmp_path / "ckpt")), nprocs=2)


def test_a_background_save_commits_the_health_mark_it_was_staged_with(tmp_path: Path) -> None:
    """An async save commits when the next save point begins (or at the end), after the
    trainer has set the next point's health mark: each marker still holds its own state's."""
    saver = CheckpointManager(
        _config(async_mode="async"), str(tmp_path / "run"), _states(1.0), rank=0, world_size=1
    )
    saver.health = {"healthy": True, "step": 1}
    saver.save(1)  # staged; written in the background
    saver.health = {"healthy": False, "step": 2}  # the next point's mark, set before it saves
    saver.states = _states(2.0)
    saver.save(2)  # waits for step 1's write and commits it first
    saver.close()
    for step in (1, 2):
        marker = json.loads(
            (tmp_path / "run" / "checkpoint" / f"step-{step}" / COMMIT_MARKER).read_text()
        )
        assert marker["health"] == {"healthy": step == 1, "step": step}, (step, marker)
