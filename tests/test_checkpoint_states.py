"""Checkpoints without code: RNG states round-trip exactly through DCP as tensors, a training
checkpoint holds tensors and plain values only, a smaller world's checkpoint still loads, and a
planted pickle (in an entry or in DCP's metadata) is refused without running."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_core.checkpoint.manager import COMMIT_MARKER, CheckpointManager
from titan_core.checkpoint.states import LoadPlanner, TrainState, capture_rng_state
from titan_core.config.job import Checkpoint
from titan_core.errors import CheckpointError
from titan_core.resolve import parse_args
from titan_core.train import run


def _draws() -> tuple[list[float], list[float]]:
    """Draws from torch's and Python's generators (``gauss`` uses Python's cached value)."""
    return torch.rand(4).tolist(), [random.random(), random.gauss(0.0, 1.0), random.gauss(0, 1)]


def _load(path: Path, state: TrainState) -> None:
    dcp.load({"train_state": state}, storage_reader=FileSystemReader(path), planner=LoadPlanner())


def test_rng_states_round_trip_exactly_as_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    random.seed(0)
    random.gauss(0.0, 1.0)  # leaves a cached Gaussian in Python's state: it must survive too
    state = TrainState(rank=0, step=7, ntokens_seen=1234)
    dcp.save({"train_state": state}, checkpoint_id=tmp_path)
    expected = _draws()
    stored = FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    assert sorted(stored) == [
        "train_state.ntokens_seen",
        "train_state.rng_rank_0.python",
        "train_state.rng_rank_0.python_gauss",
        "train_state.rng_rank_0.torch",
        "train_state.step",
    ]
    assert all(isinstance(md, TensorStorageMetadata) for md in stored.values())

    torch.manual_seed(1)
    random.seed(1)
    restored = TrainState(rank=0)
    _load(tmp_path, restored)
    assert (restored.step, restored.ntokens_seen) == (7, 1234)
    assert _draws() == expected


def test_rank_missing_from_a_smaller_world_keeps_its_rng(tmp_path: Path) -> None:
    """Rank 1 resuming from a one-process checkpoint: counters load, its RNG stays seeded."""
    dcp.save({"train_state": TrainState(rank=0, step=3)}, checkpoint_id=tmp_path)
    torch.manual_seed(5)
    random.seed(5)
    expected = _draws()
    torch.manual_seed(5)
    random.seed(5)
    restored = TrainState(rank=1)
    _load(tmp_path, restored)
    assert restored.step == 3
    assert _draws() == expected


def test_training_checkpoint_holds_tensors_and_plain_values(tmp_path: Path, assets: Path) -> None:
    """A full training checkpoint: the train state and the data loader are tensors only; the
    one kind of non-tensor entry is the optimizer's hyper-parameters (floats, tuples, None),
    which the load planner reads with torch's weights-only unpickler."""
    args = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    args += ["--job.dump_folder", str(tmp_path), "--training.steps", "2", "--checkpoint.enable"]
    args += ["--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
    run(parse_args([*args, "--validation.no_enable"]))
    stored = FileSystemReader(tmp_path / "checkpoint" / "step-2").read_metadata()
    entries = stored.state_dict_metadata
    sections = {key.split(".")[0] for key in entries}
    assert sections == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    not_tensors = [k for k, md in entries.items() if not isinstance(md, TensorStorageMetadata)]
    assert not_tensors and all(k.startswith("optimizer.param_groups.") for k in not_tensors)


class _Planted:
    """Unpickling this object creates a file: stands for arbitrary code in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("where", ["entry", "metadata"])
@pytest.mark.parametrize("listed", [True, False], ids=["checksums", "no-checksums"])
def test_planted_pickle_is_refused_without_running(
    tmp_path: Path, where: str, listed: bool
) -> None:
    """A committed checkpoint whose train-state entry, or whose DCP ``.metadata``, is a pickle
    that runs code: the load stops with one line and the code never runs. The files' checksums
    in the commit marker refuse it before anything is unpickled; without them (a marker from
    before checksums, or one the planter rewrote too) the unpickling allow-lists do."""
    cfg = Checkpoint(enable=True, interval=1)
    states = {"train_state": TrainState(step=1)}
    CheckpointManager(cfg, str(tmp_path), states, rank=0, world_size=1).save(1)
    step_dir = tmp_path / cfg.folder / "step-1"
    marker = tmp_path / "code_ran"
    if where == "entry":
        planted = {"step": _Planted(marker), "ntokens_seen": torch.tensor(0)}
        state = {"train_state": {**planted, "rng_rank_0": capture_rng_state()}}
        dcp.save(state, checkpoint_id=step_dir)
        expected = r"train_state\.step is not a tensor or plain value"
    else:
        (step_dir / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
        # DCP reports the refusal inside its own "metadata is None" assertion.
        expected = r"\.metadata is not DCP metadata \(unexpected global pathlib\.Path\.touch\)"
    if listed:
        expected = r"\.(metadata|distcp): \d+ bytes, the commit marker says \d+"
    else:
        commit = step_dir / COMMIT_MARKER
        commit.write_text(json.dumps({**json.loads(commit.read_text()), "files": {}}))
    manager = CheckpointManager(
        cfg, str(tmp_path), {"train_state": TrainState()}, rank=0, world_size=1
    )
    with pytest.raises(CheckpointError, match=expected) as err:
        manager.load()
    assert "\n" not in str(err.value)
    assert not marker.exists()
