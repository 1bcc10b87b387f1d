"""Loss parity of parallel layouts against a single process (see tests/parallel_harness.py).

fp32, deterministic, tiny model, one seed checkpoint, the same data streams everywhere.
Tolerance 1e-5 relative: reductions in a different order change the last bits only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parallel_harness import assert_parity, run_layout, train_layout

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "name, nproc, dp, extra, applied",
    [
        pytest.param(
            *("FSDP 2", 2, 2, [], "Applied FSDP on mesh {'dp_shard': 2}"),
            marks=pytest.mark.torch_range,
        ),
        (
            "HSDP 2x2",
            4,
            4,
            ["--parallelism.data_parallel_replicate_degree", "2"],
            "Applied HSDP on mesh {'dp_replicate': 2, 'dp_shard': 2}",
        ),
    ],
)
def test_data_parallel_parity(
    tmp_path: Path,
    parity_seed: Path,
    parity_reference: dict,
    name: str,
    nproc: int,
    dp: int,
    extra: list[str],
    applied: str,
) -> None:
    run = train_layout(tmp_path, parity_seed, nproc=nproc, dp=dp, extra=extra)
    assert applied in run.output, run.output[-4000:]  # HSDP falling back to FSDP would match too
    assert_parity(run.losses, parity_reference, what=name)


def test_two_torchrun_agents_train_as_one_world(
    tmp_path: Path, parity_seed: Path, parity_reference: dict
) -> None:
    """``local_multinode``: two agents (c10d rendezvous on loopback) equal one agent (``local``)
    of the same world, bitwise."""
    one = run_layout(tmp_path / "one_agent", parity_seed, nproc=2, dp=2, steps=5)
    two = train_layout(
        tmp_path / "two_agents", parity_seed, nproc=2, dp=2, steps=5, nnodes=2
    )  # backend local_multinode
    assert "[rank0]:" in two.output and "[rank1]:" in two.output  # both agents streamed
    assert two.losses == one  # same world, same collectives: bitwise equal
    assert_parity(two.losses, parity_reference, what="2 agents x 1 process")


# Imported by every Python process started with the hook's folder on PYTHONPATH: rank 1 of the
# first torchrun job there frees a block twice, and glibc aborts it (SIGABRT).
_DOUBLE_FREE_ONCE = """
import ctypes, os, pathlib
marker = pathlib.Path(__file__).with_name("crashed")
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RUN_ID") and not marker.exists():
    marker.touch()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(32)
    libc.free(block)
    libc.free(block)
"""


def test_a_layout_is_rerun_once_after_a_native_crash(
    tmp_path: Path, parity_seed: Path, parity_reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness's one rerun (``NativeCrash``): the first launch loses rank 1 to glibc's
    double-free abort; the rerun, from a clean folder, gives the layout's losses, and pytest's
    warning carries the crashed rank's lines."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DOUBLE_FREE_ONCE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    with pytest.warns(UserWarning, match=r"native crash:\n\[rank1\]:free\(\): double free"):
        run = train_layout(tmp_path / "run", parity_seed, nproc=2, dp=2, steps=3)
    assert (hook / "crashed").exists()
    assert_parity(run.losses, parity_reference, what="FSDP 2 after a rerun")


@pytest.mark.slow
def test_4d_pp_dp_cp_tp_world_16(tmp_path: Path, parity_seed: Path, parity_reference: dict) -> None:
    """PP x FSDP x CP x TP = 2 x 2 x 2 x 2: 16 processes, few steps (CI budget)."""
    extra = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    got = run_layout(tmp_path, parity_seed, nproc=16, dp=2, extra=extra, steps=3)
    assert_parity(got, parity_reference, what="4D 2x2x2x2")


TINY_CLI = ["train", "--module", "llama3", "--config", "llama3_debugmodel_tiny"]
P = "--parallelism."


@pytest.mark.parametrize(
    "ngpu, args, expected",
    [
        (4, [f"{P}tensor_parallel_degree", "3"], "not divisible"),
        (4, [f"{P}data_parallel_shard_degree", "3"], "!= world size 4"),
        (4, [f"{P}tensor_parallel_degree", "4"], "must divide n_heads"),
        (4, [f"{P}pipeline_parallel_degree", "4"], "pipeline_parallel_degree"),
        (2, [f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", "Foo"], "Foo"),
        (
            2,
            [
                f"{P}pipeline_parallel_degree",
                "2",
                f"{P}pipeline_parallel_microbatch_size",
                "2",
                "--training.local_batch_size",
                "3",
            ],
            "microbatch",
        ),
        (2, [f"{P}context_parallel_degree", "2", "--training.seq_len", "34"], "seq_len"),
        (2, [f"{P}tensor_parallel_degree", "2", f"{P}enable_async_tensor_parallel"], "async"),
        (2, ["--float8.recipe_name", "tensorwise"], "float8"),
    ],
    ids=[
        "tp-not-dividing-world",
        "product-not-world",
        "tp-not-dividing-kv-heads",
        "pp-more-stages-than-layers",
        "unknown-schedule",
        "microbatch-not-dividing-batch",
        "cp-seq-not-divisible",
        "async-tp-on-cpu",
        "float8-on-cpu",
    ],
)
def test_bad_parallel_config_one_line_before_launch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    assets: Path,
    ngpu: int,
    args: list[str],
    expected: str,
) -> None:
    """`titan train --ngpu N` rejects the config with one line; torchrun never starts."""
    import titan_core.cli as cli
    from titan_core.launch.local import LocalLauncher

    def no_launch(*_: object, **__: object) -> None:
        raise AssertionError("torchrun was launched for a bad config")

    monkeypatch.setattr(LocalLauncher, "run", no_launch)
    dump = tmp_path / "out"
    code = cli.main([*TINY_CLI, "--ngpu", str(ngpu), "--job.dump_folder", str(dump), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert expected.lower() in err.lower(), err
    assert not dump.exists()
