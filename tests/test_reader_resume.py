"""Resume at another data-parallel degree from prepared data (tests/parallel_harness.py).

2 ranks train to step K with a checkpoint and go on to STEPS; the step-K checkpoint is resumed
on 1 rank and on 4 ranks with the same global batch. Every rank dumps the batches it receives
(``TITAN_DATA_DUMP_DIR``): the global batches after K must be token-identical to the
uninterrupted run's, and the losses within the harness's parity tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from parallel_harness import GLOBAL_BATCH, assert_parity, train_layout
from prepared_helpers import prepare_corpus

from titan_core.data import Tokenizer, bundled_corpus_dir, default_tokenizer_path
from titan_core.data.reader import DUMP_ENV

pytestmark = pytest.mark.multiprocess

K, STEPS = 3, 6


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> str:
    url = str(tmp_path_factory.mktemp("prepared") / "corpus")
    return prepare_corpus(url, Tokenizer(str(default_tokenizer_path())), bundled_corpus_dir(), 2)


def _global_batches(dump_dir: Path) -> dict[int, torch.Tensor]:
    """Global batch (G, seq) by its first global sample, assembled from every rank's dump."""
    parts: dict[int, dict[int, list]] = {}
    for path in dump_dir.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            parts.setdefault(row["start"], {})[row["dp_rank"]] = row["inputs"]
    return {
        start: torch.tensor([row for r in sorted(ranks) for row in ranks[r]])
        for start, ranks in parts.items()
    }


def test_resume_on_1_and_4_ranks_continues_the_2_rank_run(
    tmp_path: Path, parity_seed: Path, prepared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = ["--dataloader.dataset", prepared, "--checkpoint.no_load_only"]
    extra += ["--checkpoint.interval", str(K), "--checkpoint.keep_latest_k", "0"]
    extra += ["--checkpoint.no_last_save_model_only"]

    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "batches-2"))
    full = train_layout(tmp_path / "two", parity_seed, nproc=2, dp=2, extra=extra, steps=STEPS)
    reference = _global_batches(tmp_path / "batches-2")
    assert sorted(reference) == [m * GLOBAL_BATCH for m in range(STEPS)]
    checkpoint = tmp_path / "two" / "checkpoint" / f"step-{K}"

    for nproc in (1, 4):
        dump = tmp_path / f"resumed-{nproc}"
        shutil.copytree(checkpoint, dump / "checkpoint" / f"step-{K}")
        monkeypatch.setenv(DUMP_ENV, str(tmp_path / f"batches-{nproc}"))
        run = train_layout(
            dump, parity_seed, nproc=nproc, dp=nproc, extra=extra, steps=STEPS, start=K + 1
        )
        got = _global_batches(tmp_path / f"batches-{nproc}")
        assert sorted(got) == [m * GLOBAL_BATCH for m in range(K, STEPS)], nproc
        for start, batch in got.items():
            assert batch.shape == (GLOBAL_BATCH, 32)
            assert torch.equal(batch, reference[start]), (nproc, start)
        assert_parity(
            run.losses,
            {s: full.losses[s] for s in range(K + 1, STEPS + 1)},
            what=f"resumed on {nproc} ranks",
        )
