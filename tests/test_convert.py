"""Checkpoint conversion DCP <-> Hugging Face: bitwise round trip, transformers parity, FSDP
resharding, S3, sharded streaming with bounded memory, training from HF weights, bad input."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib
import json
import math
import mmap
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import weakref
import zipfile
from pathlib import Path
from pydoc_data.topics import topics
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import TINY
from hf_helpers import assert_bitwise, convert_cli, dcp_model, hf_tensors
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from storage_faults import Disk, files_under, one_line, titan

from titan_core import storage
from titan_core.build import build_model_args
from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.checkpoint.hf_weights import model_args_from_hf_config
from titan_core.checkpoint.manager import COMMIT_MARKER, damage
from titan_core.cli import convert as cli
from titan_core.config.job import JobConfig
from titan_core.config.schema import apply_values
from titan_core.config.toml import load_toml
from titan_core.convert.dcp_direct import DataFiles, _payload_offset, locate
from titan_core.convert.dcp_to_hf import dcp_to_hf, hf_config
from titan_core.convert.hf_to_dcp import hf_to_dcp
from titan_core.convert.shard_writer import ShardWriter
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.errors import ConfigError
from titan_core.models.common.hf import to_rotate_half
from titan_core.models.llama3 import Transformer, llama3_flavors
from titan_core.resolve import parse_args
from titan_core.train import run

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
TRAIN += ["--checkpoint.no_last_save_model_only", "--validation.no_enable"]
TRAIN += ["--metrics.log_freq", "1"]
SHARD = 400_000  # bytes: the tiny model (1.6 MB in fp32) spreads over several shards
SAMPLE_TEXT = (
    "The quick brown fox — naïve café, 日本語のテキスト, emoji 🤗🚀, Ελληνικά,\n"
    "combining e\u0301, tabs\tand  double   spaces,\r\nwindows lines,   trailing   \n\n\n"
    "numbers 1234567 3.14159 0042; don't WE'LL they'Re.\n"
    "<|begin_of_text|> <|eot_id|> <|reserved_special_token_7|> <|not_special|> <| |>"
)


# ---------------------------------------------------------------- helpers
def _model_args(dump: Path) -> Any:
    cfg = load_toml(dump / "config.toml", JobConfig())
    return build_model_args(cfg, Tokenizer(str(default_tokenizer_path())).n_words)


def _assert_nothing_at(output: Path) -> None:
    assert not output.exists()
    leftovers = [p.name for p in output.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def _titan_model(checkpoint: Path, dump: Path) -> Transformer:
    model = Transformer(_model_args(dump)).eval()
    model.load_state_dict(dcp_model(str(checkpoint)))
    return model


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[str, Any]:
    """A 2-step single-process run with a full checkpoint (optimizer and all) at step-2."""
    dump = tmp_path_factory.mktemp("job") / "run"
    history = run(parse_args([*TRAIN, "--job.dump_folder", str(dump)]))
    return {"dump": dump, "step": dump / "checkpoint" / "step-2", "history": history}


@pytest.fixture(scope="module")
def exported(job: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-2 checkpoint exported to HF in fp32 (config found next to the checkpoint)."""
    out = tmp_path_factory.mktemp("export") / "hf"
    argv = ["dcp-to-hf", "--checkpoint", str(job["step"]), "--output", str(out), "--dtype"]
    assert cli.main([*argv, "fp32", "--max-shard-size", str(SHARD), "--no-progress"]) == 0
    return out


# ---------------------------------------------------------------- round trip and layout
@pytest.mark.torch_range
def test_round_trip_is_bitwise(job: dict[str, Any], exported: Path, tmp_path: Path) -> None:
    assert cli.main(["hf-to-dcp", "--hf", str(exported), "--output", str(tmp_path / "dcp")]) == 0
    marker = json.loads((tmp_path / "dcp" / COMMIT_MARKER).read_text())
    assert marker["step"] == 0 and marker["model_only"] is True
    # Checksums as a training save's: a changed byte is named before anything loads it.
    assert set(marker["files"]) == {p.name for p in (tmp_path / "dcp").iterdir()} - {COMMIT_MARKER}
    assert damage(str(tmp_path / "dcp")) is None
    shutil.copytree(tmp_path / "dcp", tmp_path / "flipped")
    data = next((tmp_path / "flipped").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert "checksum mismatch" in (damage(str(tmp_path / "flipped")) or "")
    original = dcp_model(str(job["step"]))
    assert original["tok_embeddings.weight"].dtype == torch.float32
    assert_bitwise(dcp_model(str(tmp_path / "dcp")), original)
    # The same weights as one model.safetensors without an index.
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(exported / "config.json", single)
    save_file(hf_tensors(exported), single / "model.safetensors")
    hf_to_dcp(str(single), str(tmp_path / "dcp_single"))
    assert_bitwise(dcp_model(str(tmp_path / "dcp_single")), original)


def test_export_layout_and_config(exported: Path) -> None:
    names = sorted(p.name for p in exported.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(names) - set(shards) == {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    tensors = hf_tensors(exported)  # index consistent with the files and total_size
    assert all(t.dtype == torch.float32 for t in tensors.values())
    config = json.loads((exported / "config.json").read_text())
    tok = Tokenizer(str(default_tokenizer_path()))
    assert config["vocab_size"] == tok.n_words and config["torch_dtype"] == "float32"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in tensors
    generation = json.loads((exported / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (tok.bos_id, tok.eos_id)


def test_bf16_export_and_tied_embeddings(job: dict[str, Any], tmp_path: Path) -> None:
    """bf16 halves the bytes; a tied model exports without lm_head and comes back tied."""
    args = _model_args(job["dump"])
    args.tie_word_embeddings = True
    tied = tmp_path / "tied" / "checkpoint" / "step-0"
    model = dcp_model(str(job["step"]))
    model.pop("output.weight")
    dcp.save({"model": model}, checkpoint_id=str(tied), no_dist=True)
    (tied / COMMIT_MARKER).write_text(json.dumps({"step": 0, "model_only": True}))
    dcp_to_hf(str(tied), str(tmp_path / "hf"), model_args=args, tokenizer_path=None)
    hf = hf_tensors(tmp_path / "hf")
    assert "lm_head.weight" not in hf and all(t.dtype == torch.bfloat16 for t in hf.values())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    back = dcp_model(str(tmp_path / "dcp"))
    assert torch.equal(back["output.weight"], back["tok_embeddings.weight"])
    assert torch.equal(back["tok_embeddings.weight"], model["tok_embeddings.weight"].bfloat16())


@pytest.mark.parametrize("flavor", list(llama3_flavors))
def test_hf_config_gives_back_the_model_args(flavor: str) -> None:
    """hf-to-dcp reads the exact model back from config.json, FFN sizing and rope included."""
    args = llama3_flavors[flavor]
    config = json.loads(json.dumps(hf_config(args, "bfloat16", None, "llama3")))
    assert model_args_from_hf_config(config, "config.json") == args


# ---------------------------------------------------------------- transformers parity
@pytest.mark.torch_range
def test_transformers_loads_export(job: dict[str, Any], exported: Path) -> None:
    transformers = pytest.importorskip("transformers")
    # local_files_only: every load is local (and setting HF_HUB_OFFLINE here would leak into
    # every later test of the session, huggingface_hub reads it once at import).
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    tok = Tokenizer(str(default_tokenizer_path()))
    # Tokenizer: BOS added automatically, special-token strings in text stay plain text.
    assert hf_tok(SAMPLE_TEXT)["input_ids"] == tok.encode(SAMPLE_TEXT, bos=True, eos=False)
    bare = hf_tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    assert bare == tok.encode(SAMPLE_TEXT, bos=False, eos=False)
    assert hf_tok.decode(bare) == SAMPLE_TEXT
    prose = "\n\n".join(topics[k] for k in sorted(topics)[:40])  # ~100 kB of English + code
    assert hf_tok(prose, add_special_tokens=False)["input_ids"] == tok.encode(
        prose, bos=False, eos=False
    )
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_id, tok.eos_id)

    model = _titan_model(job["step"], job["dump"])
    tokens = torch.tensor([tok.encode(SAMPLE_TEXT, bos=True, eos=False)])  # (1, seq)
    with torch.no_grad():
        ours = model(tokens)  # (1, seq, vocab)
        ref = hf(tokens).logits  # (1, seq, vocab)
    assert ref.abs().max() > 0.5  # O(1) logits, so the relative bound means something
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5

    prompt = torch.tensor([tok.encode("The meaning of", bos=True, eos=False)])
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            next_id = model(ids)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            ids = torch.cat([ids, next_id], dim=1)
            if next_id.item() == tok.eos_id:
                break
        generated = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8
        )
    assert generated.tolist() == ids.tolist()


# ---------------------------------------------------------------- FSDP checkpoints
def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.multiprocess
def test_fsdp_checkpoint_converts_like_single_process(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dump = tmp_path / "fsdp"
    proc = _torchrun("-m", "titan_core.train", *TRAIN, "--job.dump_folder", str(dump))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fsdp_step = dump / "checkpoint" / "step-2"
    md = dcp_reader(str(fsdp_step)).read_metadata().state_dict_metadata
    assert len(md["model.tok_embeddings.weight"].chunks) == 2  # really saved as 2 shards

    # The same weights, resharded into one process and saved from there.
    single_step = tmp_path / "single" / "checkpoint" / "step-2"
    dcp.save({"model": dcp_model(str(fsdp_step))}, checkpoint_id=str(single_step), no_dist=True)
    (single_step / COMMIT_MARKER).write_text(json.dumps({"step": 2, "model_only": True}))
    single_md = dcp_reader(str(single_step)).read_metadata().state_dict_metadata
    assert len(single_md["model.tok_embeddings.weight"].chunks) == 1

    args = _model_args(dump)
    hf_dirs = ("hf_fsdp", "hf_single")
    for step, out in zip((fsdp_step, single_step), hf_dirs):
        options = {"tokenizer_path": None, "dtype": "float32", "max_shard_size": SHARD}
        dcp_to_hf(str(step), str(tmp_path / out), model_args=args, **options)
    assert_bitwise(hf_tensors(tmp_path / "hf_fsdp"), hf_tensors(tmp_path / "hf_single"))
    indexes = [(tmp_path / d / "model.safetensors.index.json").read_text() for d in hf_dirs]
    assert indexes[0] == indexes[1]

    # The direct reader streams the two ranks' row slices (gathering the q/k ones to reorder
    # them) byte for byte like DCP's resharding reader, in both dtypes.
    metadata = dcp_reader(str(fsdp_step)).read_metadata()
    names = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    with contextlib.closing(DataFiles(str(fsdp_step))) as files:
        found = locate(str(fsdp_step), metadata, names, files)
    assert sorted(found) == sorted(names)
    assert len(found["model.layers.0.attention.wq.weight"].blocks) == 2
    for dtype in ("float32", "bfloat16"):
        for direct in (True, False):
            out = tmp_path / f"{dtype}-{direct}"
            _export(fsdp_step, out, args, dtype, direct=direct, mp=monkeypatch)
        _same_files(tmp_path / f"{dtype}-True", tmp_path / f"{dtype}-False")


_FSDP_HF_LOAD = """
import sys
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from titan_core.checkpoint.manager import CheckpointManager
from titan_core.checkpoint.states import ModelState
from titan_core.resolve import parse_args
from titan_core.checkpoint.hf_weights import (
    list_hf_weights, load_hf_into_model, load_hf_state_dict, read_hf_model_args,
)
from titan_core.distributed import utils
from titan_core.distributed.parallel_dims import ParallelDims
from titan_core.models.llama3 import Transformer
from titan_core.models.common.parallelize import parallelize_decoder

hf, dump = sys.argv[1], sys.argv[2]
cfg = parse_args(sys.argv[3:] + ["--checkpoint.enable", "--checkpoint.initial_load_path", hf,
                                 "--checkpoint.initial_load_in_hf"])
info = utils.init_distributed(60, 0, dump)
dims = ParallelDims.from_config(cfg.parallelism, info.world_size)
dims.build_mesh("cpu")
args = read_hf_model_args(hf)
with torch.device("meta"):
    model = Transformer(args)
parallelize_decoder(model, dims, cfg)
model.to_empty(device="cpu")
model.init_weights()
states = {"model": ModelState(model)}
manager = CheckpointManager(
    cfg.checkpoint, dump, states, rank=info.rank, world_size=info.world_size
)
manager.hf_loader = load_hf_into_model  # as the trainer sets it
assert manager.load() == 0
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
if all(isinstance(p, DTensor) for p in model.parameters()):
    print(f"rank {info.rank}: parameters are FSDP-sharded DTensors", flush=True)
if info.rank == 0:
    ref = load_hf_state_dict(list_hf_weights(hf), args)
    same = set(full) == set(ref) and all(torch.equal(full[k], ref[k]) for k in ref)
    print("HF-LOAD-MATCH" if same else "HF-LOAD-MISMATCH", flush=True)
utils.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_fsdp_training_loads_hf_weights(exported: Path, tmp_path: Path) -> None:
    """Under FSDP, rank 0 reads the HF files and broadcasts; every shard ends up exact."""
    script = tmp_path / "fsdp_hf_load.py"
    script.write_text(_FSDP_HF_LOAD)
    with socket.socket() as s:  # a free rendezvous port (torchrun's agent costs seconds)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(exported), str(tmp_path / "dump"), *TINY],
            env={**os.environ, **world, "OMP_NUM_THREADS": "1", "RANK": r, "LOCAL_RANK": r},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in ("0", "1")
    ]
    out = "".join(p.communicate(timeout=300)[0] for p in procs)
    assert [p.returncode for p in procs] == [0, 0], out[-3000:]
    assert out.count("parameters are FSDP-sharded DTensors") == 2
    assert "HF-LOAD-MATCH" in out


# ---------------------------------------------------------------- S3
def test_s3_conversion_both_ways(
    job: dict[str, Any],
    exported: Path,
    s3_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    fs = s3_server.filesystem()
    prefix = f"{s3_server.bucket}/{tmp_path.name}"
    fs.put(str(job["step"]), f"{prefix}/run/checkpoint/step-2", recursive=True)
    fs.put_file(str(job["dump"] / "config.toml"), f"{prefix}/run/config.toml")
    assert fs.exists(f"{prefix}/run/checkpoint/step-2/{COMMIT_MARKER}")
    ckpt, hf, back = (f"s3://{prefix}/{p}" for p in ("run/checkpoint/step-2", "hf", "dcp"))
    to_hf = ["dcp-to-hf", "--checkpoint", ckpt, "--dtype", "fp32", "--max-shard-size", str(SHARD)]

    # Credentials are enforced: a wrong secret is one clear line, and nothing is written.
    s3_server.set_env(monkeypatch, secret_key="not-the-secret")
    rc, err = convert_cli([*to_hf, "--output", hf], capsys)
    assert rc == 2 and err.count("\n") == 1 and "access denied" in err, err
    # A read-only identity reads the checkpoint but cannot write the export: no partial output.
    s3_server.set_env(monkeypatch, read_only=True)
    rc, err = convert_cli([*to_hf, "--output", hf], capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    fs.invalidate_cache()
    assert all("/run/" in key for key in fs.find(prefix))

    s3_server.set_env(monkeypatch)
    module = importlib.import_module("titan_core.convert.dcp_to_hf")
    read_by_dcp: list[str] = []
    real_load = module.load_tensors

    def load_tensors(checkpoint: str, group: list[Any]) -> dict[str, torch.Tensor]:
        read_by_dcp.extend(t.name for t in group)
        return real_load(checkpoint, group)

    monkeypatch.setattr(module, "load_tensors", load_tensors)
    assert cli.main([*to_hf, "--output", hf]) == 0  # config.toml found next to the checkpoint
    assert sorted(read_by_dcp) == sorted(dcp_model(str(job["step"])))  # no direct reads on S3
    assert cli.main(["hf-to-dcp", "--hf", hf, "--output", back]) == 0
    fs.invalidate_cache()
    tops = {key[len(prefix) + 1 :].split("/")[0] for key in fs.find(prefix)}
    assert tops == {"dcp", "hf", "run"}  # no staging prefix left behind
    fs.get(f"{prefix}/hf", str(tmp_path / "hf"), recursive=True)
    assert_bitwise(hf_tensors(tmp_path / "hf"), hf_tensors(exported))
    assert fs.exists(f"{prefix}/dcp/{COMMIT_MARKER}")
    assert_bitwise(dcp_model(back), dcp_model(str(job["step"])))


# ---------------------------------------------------------------- sharding and streaming
def test_streaming_holds_one_shard_at_a_time(
    job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DCP-reader path (what remote checkpoints take): every tensor the converter reads or
    writes is tracked through weak references: when a shard is read, nothing from earlier shards
    may still be alive, and no read asks for more than one shard's bytes (or one tensor when a
    tensor alone exceeds the limit)."""
    module = importlib.import_module("titan_core.convert.dcp_to_hf")
    alive: list[weakref.ref[torch.Tensor]] = []
    nbytes: dict[int, int] = {}
    reads: list[tuple[int, int]] = []  # (bytes still alive from earlier shards, bytes requested)

    def track(t: torch.Tensor) -> None:
        alive.append(weakref.ref(t))
        nbytes[id(alive[-1])] = t.nbytes

    def live_bytes() -> int:
        return sum(nbytes[id(r)] for r in alive if r() is not None)

    real_load, real_write = module.load_tensors, ShardWriter.write_tensor

    def load_tensors(checkpoint: str, group: list[Any]) -> dict[str, torch.Tensor]:
        reads.append((live_bytes(), sum(t.nbytes() for t in group)))
        state = real_load(checkpoint, group)
        for t in state.values():
            track(t)
        return state

    def write_tensor(self: ShardWriter, tensor: torch.Tensor) -> None:
        track(tensor)
        real_write(self, tensor)

    monkeypatch.setattr(module, "locate", lambda *args: {})  # as for a remote checkpoint
    monkeypatch.setattr(module, "load_tensors", load_tensors)
    monkeypatch.setattr(ShardWriter, "write_tensor", write_tensor)
    args = _model_args(job["dump"])
    limit = 250_000
    options = {
        "tokenizer_path": None,
        "dtype": "float32",
        "max_shard_size": limit,
        "progress": True,
    }
    names = dcp_to_hf(str(job["step"]), str(tmp_path / "hf"), model_args=args, **options)
    largest = max(t.nbytes for t in dcp_model(str(job["step"])).values())
    assert len(names) == len(reads) >= 4
    assert all(earlier == 0 for earlier, _ in reads), reads
    assert all(size <= max(limit, largest) for _, size in reads), reads
    assert live_bytes() == 0
    for name in names:  # a shard over the limit holds a single tensor that alone exceeds it
        shard = load_file(tmp_path / "hf" / name)
        assert sum(t.nbytes for t in shard.values()) <= limit or len(shard) == 1
    hf_tensors(tmp_path / "hf")  # index matches the shards


def _export(step: Path, out: Path, args: Any, dtype: str, *, direct: bool, mp: Any) -> list[str]:
    """dcp_to_hf with the direct reader only (DCP's reader refused) or DCP's reader only."""
    module = importlib.import_module("titan_core.convert.dcp_to_hf")
    with mp.context() as m:
        if direct:
            m.setattr(module, "load_tensors", lambda *a: pytest.fail("DCP reader used"))
        else:
            m.setattr(module, "locate", lambda *a: {})
        options = {"tokenizer_path": None, "dtype": dtype, "max_shard_size": SHARD}
        return dcp_to_hf(str(step), str(out), model_args=args, **options)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize(
    ("saved", "dtype"), [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32")]
)
def test_direct_reader_writes_what_the_dcp_reader_writes(
    saved: str, dtype: str, job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensors streamed from the .distcp bytes give byte-identical shards to DCP's reader
    and in-memory conversion, also when casts and the q/k reordering go in many small steps;
    the files are valid safetensors with the usual metadata, and the buffers stay small."""
    module = importlib.import_module("titan_core.convert.shard_writer")
    args = _model_args(job["dump"])
    ckpt = job["step"]
    if saved == "bfloat16":  # a bf16 checkpoint (what checkpoint.export_dtype writes)
        ckpt = tmp_path / "bf16"
        weights = {k: v.bfloat16() for k, v in dcp_model(str(job["step"])).items()}
        dcp.save({"model": weights}, checkpoint_id=str(ckpt), no_dist=True)
        (ckpt / COMMIT_MARKER).write_text(json.dumps({"step": 2, "model_only": True}))
    _export(ckpt, tmp_path / "dcp", args, dtype, direct=False, mp=monkeypatch)
    step = 1024  # bytes per cast / reorder / copy step: several per tensor, several rows each
    monkeypatch.setattr(module, "CHUNK_BYTES", step)
    monkeypatch.setattr(module, "COPY_BYTES", step)
    buffers: list[int] = []
    real_buffer = ShardWriter._buffer

    def buffer(self: ShardWriter, *a: Any) -> torch.Tensor:
        out = real_buffer(self, *a)
        buffers.append(out.nbytes)
        return out

    monkeypatch.setattr(ShardWriter, "_buffer", buffer)
    _export(ckpt, tmp_path / "direct", args, dtype, direct=True, mp=monkeypatch)
    _same_files(tmp_path / "direct", tmp_path / "dcp")
    # A step's rows in the larger dtype (every row of the tiny model is under 1 kB).
    assert buffers and max(buffers) <= step * 2
    shards = sorted((tmp_path / "direct").glob("model-*.safetensors"))
    with safe_open(shards[0], framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    ref = dcp_model(str(ckpt))
    hf = hf_tensors(tmp_path / "direct")
    torch_dtype = getattr(torch, dtype)
    assert torch.equal(hf["lm_head.weight"], ref["output.weight"].to(torch_dtype))
    wq = hf["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(wq, ref["layers.0.attention.wq.weight"].to(torch_dtype))  # reordered


def _rezip(src: Path, dst: Path, *, compress: int = zipfile.ZIP_STORED, zip64: bool = False,
           comment: bytes = b"") -> None:  # fmt: skip
    """Rewrite a torch.save zip member by member with other zip options."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=compress) as zout:
        zout.comment = comment
        for info in zin.infolist():
            with zout.open(info.filename, "w", force_zip64=zip64) as f:
                f.write(zin.read(info))


def test_payload_offset_reads_torch_save_zips(tmp_path: Path) -> None:
    """The direct reader finds a tensor's bytes in the zip torch.save writes (a view with a
    storage offset included), through zipfile for directories it does not parse itself (an
    archive comment, zip64 records), and refuses compressed members and other tensors."""
    base = torch.randn(6, 8)
    tensor = base[2:]  # saved with its whole storage and a storage offset of 16 elements
    torch.save(tensor, tmp_path / "plain.pt")
    _rezip(tmp_path / "plain.pt", tmp_path / "comment.pt", comment=b"zipfile's path")
    _rezip(tmp_path / "plain.pt", tmp_path / "zip64.pt", zip64=True)
    _rezip(tmp_path / "plain.pt", tmp_path / "deflated.pt", compress=zipfile.ZIP_DEFLATED)
    chunk = SimpleNamespace(sizes=torch.Size([4, 8]))
    for name in ("plain", "comment", "zip64", "deflated"):
        raw = (tmp_path / f"{name}.pt").read_bytes()
        view = mmap.mmap(-1, len(raw) + 100)
        view[100:] = raw  # the item sits at an offset inside a bigger file, as in a .distcp
        if name == "deflated":
            with pytest.raises(ValueError, match="compressed"):
                _payload_offset(view, 100, len(raw), chunk, torch.float32)
            continue
        start = _payload_offset(view, 100, len(raw), chunk, torch.float32)
        assert view[start : start + tensor.nbytes] == tensor.numpy().tobytes(), name
        with pytest.raises(ValueError, match="expected"):
            _payload_offset(view, 100, len(raw), chunk, torch.bfloat16)
        with pytest.raises(ValueError, match="expected"):
            _payload_offset(view, 100, len(raw), SimpleNamespace(sizes=[6, 8]), torch.float32)
    torch.save(base.t(), tmp_path / "strided.pt")
    raw = (tmp_path / "strided.pt").read_bytes()
    view = mmap.mmap(-1, len(raw))
    view[:] = raw
    with pytest.raises(ValueError, match="non-contiguous"):
        _payload_offset(view, 0, len(raw), SimpleNamespace(sizes=[8, 6]), torch.float32)


def test_mixed_shards_and_row_order(
    job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards mixing streamed tensors and tensors read by DCP (what a damaged or unusual item
    leads to) are still identical; ``row_order`` is the adapter's q/k permutation, and refuses
    a conversion that is not a reordering of whole rows."""
    module = importlib.import_module("titan_core.convert.dcp_to_hf")
    args = _model_args(job["dump"])
    _export(job["step"], tmp_path / "dcp", args, "float32", direct=False, mp=monkeypatch)
    real_locate = module.locate
    located: list[int] = []

    def every_other(*a: Any) -> dict[str, Any]:
        found = real_locate(*a)
        located.append(len(found))
        return {k: v for i, (k, v) in enumerate(sorted(found.items())) if i % 2}

    monkeypatch.setattr(module, "locate", every_other)
    dcp_to_hf(str(job["step"]), str(tmp_path / "mixed"), model_args=args, tokenizer_path=None,
              dtype="float32", max_shard_size=SHARD)  # fmt: skip
    _same_files(tmp_path / "mixed", tmp_path / "dcp")
    assert located == [len(dcp_model(str(job["step"])))]  # the real reader found them all

    # Unchanged bytes whose offsets share their place in a page (here: every offset) are copied
    # by the kernel; where it refuses (another filesystem), through a buffer.
    writer = importlib.import_module("titan_core.convert.shard_writer")
    monkeypatch.setattr(module, "locate", real_locate)
    monkeypatch.setattr(writer, "_PAGE", 1)
    kernel_copies: list[int] = []
    real_copy = os.copy_file_range

    def copy_file_range(*a: Any) -> int:
        kernel_copies.append(a[2])
        return real_copy(*a)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    _export(job["step"], tmp_path / "kernel", args, "float32", direct=True, mp=monkeypatch)
    _same_files(tmp_path / "kernel", tmp_path / "dcp")
    assert sum(kernel_copies) > 0.9 * sum(t.nbytes for t in dcp_model(str(job["step"])).values())

    def cross_device(*a: Any) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    _export(job["step"], tmp_path / "written", args, "float32", direct=True, mp=monkeypatch)
    _same_files(tmp_path / "written", tmp_path / "dcp")

    planned = {t.name: t for t in module.read_checkpoint_tensors(str(job["step"]), args)}
    wk = dcp_model(str(job["step"]))["layers.1.attention.wk.weight"]
    order = module.row_order(planned["layers.1.attention.wk.weight"], args)
    assert order is not None and torch.equal(wk[order], to_rotate_half(wk, args.n_kv_heads))
    assert module.row_order(planned["layers.1.feed_forward.w1.weight"], args) is None
    spec = module.model_spec(args, "llama3")
    hf = spec.hf
    transposing = dataclasses.replace(
        spec,
        hf=dataclasses.replace(
            hf, to_hf=lambda sd, a: {k: v.t() for k, v in hf.to_hf(sd, a).items()}
        ),
    )
    monkeypatch.setattr(module, "model_spec", lambda args, name=None: transposing)
    with pytest.raises(ValueError, match="reshapes"):
        module.row_order(planned["layers.1.feed_forward.w1.weight"], args)
    flipping = dataclasses.replace(
        spec,
        hf=dataclasses.replace(
            hf, to_hf=lambda sd, a: {k: v.flip(-1) for k, v in hf.to_hf(sd, a).items()}
        ),
    )
    monkeypatch.setattr(module, "model_spec", lambda args, name=None: flipping)
    with pytest.raises(ValueError, match="not a reordering of whole rows"):
        module.row_order(planned["layers.1.feed_forward.w1.weight"], args)


# ---------------------------------------------------------------- training from HF weights
def test_training_starts_from_hf_weights(
    job: dict[str, Any], exported: Path, tmp_path: Path
) -> None:
    hf_to_dcp(str(exported), str(tmp_path / "dcp"))
    common = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--validation.no_enable"]
    common += ["--metrics.log_freq", "1", "--checkpoint.initial_load_path"]
    hf_flags = [str(exported), "--checkpoint.initial_load_in_hf"]
    from_hf = run(parse_args([*common, *hf_flags, "--job.dump_folder", str(tmp_path / "a")]))
    dcp_flags = [str(tmp_path / "dcp"), "--job.dump_folder", str(tmp_path / "b")]
    from_dcp = run(parse_args([*common, *dcp_flags]))
    assert from_hf[0]["step"] == 1 and from_hf[0]["loss"] == from_dcp[0]["loss"]
    # Not the fresh-initialization loss of the same seed and data: the weights were loaded.
    assert from_hf[0]["loss"] != job["history"][0]["loss"]


# ---------------------------------------------------------------- bad input
def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 20)


def _corrupt(step: Path, fqn: str, unlist: bool = False) -> None:
    """Overwrite the start of ``fqn``'s item; ``unlist``: drop the files' checksums from the
    commit marker too, as in one written before them."""
    storage_data = dcp_reader(str(step)).read_metadata().storage_data
    info = next(v for k, v in storage_data.items() if k.fqn == fqn)
    with open(step / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff" * min(info.length, 64))
    if unlist:
        marker = json.loads((step / COMMIT_MARKER).read_text())
        del marker["files"]
        (step / COMMIT_MARKER).write_text(json.dumps(marker))


def _shard_of(hf: Path, tensor: str) -> Path:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    return hf / index["weight_map"][tensor]


def _copy_job(job: dict[str, Any], root: Path) -> Path:
    """A copy of the job's dump folder (config.toml + step-2) to break; returns the step dir."""
    step = root / "run" / "checkpoint" / "step-2"
    shutil.copytree(job["step"], step)
    shutil.copy(job["dump"] / "config.toml", root / "run" / "config.toml")
    return step


def _add_unknown_tensor(hf: Path) -> None:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = _shard_of(hf, "model.norm.weight")
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, shard)
    index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = shard.name
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


_TO_HF_CASES = {
    "missing-dir": (lambda step: shutil.rmtree(step.parent), [], "does not exist"),
    "no-commit-marker": (lambda step: (step / COMMIT_MARKER).unlink(), [], "no commit marker"),
    "wrong-flavor": (lambda step: None, ["--model.flavor", "debugmodel"], "has shape"),
    "unknown-tensor": (lambda step: None, ["--model.n_layers", "1"], "unknown tensor"),
    "missing-tensor": (lambda step: None, ["--model.n_layers", "3"], "missing"),
    "truncated-data": (lambda step: _truncate(step / "__0_0.distcp"), [], "(truncated)"),
    # Changed bytes: the file's checksum (commit marker) refuses the step before any is read.
    "corrupt-data": (
        lambda step: _corrupt(step, "model.output.weight"),
        [],
        "__0_0.distcp: checksum mismatch (",
    ),
    # Without checksums (a marker written before them) found only while reading the last shard
    # (the direct reader leaves a damaged item to DCP's reader, which names it): the shards
    # already written must vanish too.
    "corrupt-data-unlisted": (
        lambda step: _corrupt(step, "model.output.weight", unlist=True),
        ["--max-shard-size", str(SHARD)],
        "cannot read model.output.weight from",  # bf16: in the second of two shards
    ),
    # The settings are config keys (--dtype/--max-shard-size are aliases): errors name the key.
    "bad-dtype": (
        lambda step: None,
        ["--dtype", "fp16"],
        "convert.dtype: expected one of 'bfloat16', 'float32', got 'fp16'",
    ),
    "bad-shard-size": (
        lambda step: None,
        ["--max-shard-size", "5XB"],
        "convert.max_shard_size: expected a size like 5GB",
    ),
    "bad-shard-key": (lambda step: None, ["--convert.max_shard_size", "0MB"], "got '0MB'"),
    "alias-and-key": (
        lambda step: None,
        ["--dtype", "fp32", "--convert.dtype", "float32"],
        "--dtype: an alias of --convert.dtype, which is given too; give one",
    ),
}


@pytest.mark.parametrize("case", list(_TO_HF_CASES))
def test_dcp_to_hf_bad_input(
    case: str, job: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = _copy_job(job, tmp_path)
    breaker, extra, expected = _TO_HF_CASES[case]
    breaker(step)
    output = tmp_path / "hf"
    rc, err = convert_cli(
        ["dcp-to-hf", "--checkpoint", str(step), "--output", str(output), *extra], capsys
    )
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err, err
    _assert_nothing_at(output)


_UP_PROJ = "model.layers.1.mlp.up_proj.weight"
_TO_DCP_CASES = {
    "no-weights": (lambda hf: (hf / "model.safetensors.index.json").unlink(), "has neither"),
    "missing-shard": (lambda hf: _shard_of(hf, _UP_PROJ).unlink(), "not found"),
    "truncated-shard": (lambda hf: _truncate(_shard_of(hf, _UP_PROJ)), "truncated"),
    "unknown-tensor": (_add_unknown_tensor, "unknown tensor model.layers.0.self_attn.q_norm"),
    "no-config": (lambda hf: (hf / "config.json").unlink(), "config.json not found"),
    "config-mismatch": (
        lambda hf: (hf / "config.json").write_text(
            (hf / "config.json")
            .read_text()
            .replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
        ),
        "missing",
    ),
    "zero-heads": (
        lambda hf: _edit_config(hf, num_attention_heads=0),
        "num_attention_heads is 0, expected an int >= 1",
    ),
    "float-layers": (
        lambda hf: _edit_config(hf, num_hidden_layers=2.5),
        "num_hidden_layers is 2.5, expected an int >= 1",
    ),
    "heads-not-in-groups": (
        lambda hf: _edit_config(hf, num_key_value_heads=3),
        "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    "nan-eps": (lambda hf: _edit_config(hf, rms_norm_eps=math.nan), "rms_norm_eps is nan"),
}


def _edit_config(hf: Path, **values: Any) -> None:
    path = hf / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | values))


@pytest.mark.parametrize("case", list(_TO_DCP_CASES))
def test_hf_to_dcp_bad_input(
    case: str, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "hf"
    shutil.copytree(exported, hf)
    assert len(list(hf.glob("model-*.safetensors"))) > 1  # sharded, with an index
    breaker, expected = _TO_DCP_CASES[case]
    breaker(hf)
    output = tmp_path / "dcp"
    rc, err = convert_cli(["hf-to-dcp", "--hf", str(hf), "--output", str(output)], capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err, err
    _assert_nothing_at(output)


def test_convert_section_drives_the_export(job: dict[str, Any], tmp_path: Path) -> None:
    """[convert] in the job's config decides dtype and sharding; --convert.x overrides it; the
    pipeline's export stage reads the same keys (from the run's config, plus overrides)."""
    from titan_core.pipeline.stages.export import export_checkpoint
    from titan_core.resolve import resolve_job

    text = (job["dump"] / "config.toml").read_text()
    assert '[convert]\ndtype = "bfloat16"\nmax_shard_size = "5GB"' in text  # saved by training
    config = tmp_path / "job.toml"
    config.write_text(text.replace('dtype = "bfloat16"\nmax_shard_size = "5GB"',
                                   f'dtype = "float32"\nmax_shard_size = "{SHARD}"'))  # fmt: skip
    argv = ["dcp-to-hf", "--checkpoint", str(job["step"]), "--config-file", str(config)]
    assert cli.main([*argv, "--output", str(tmp_path / "a"), "--no-progress"]) == 0
    shards = sorted((tmp_path / "a").glob("model-*.safetensors"))
    assert len(shards) > 1
    assert all(t.dtype == torch.float32 for t in hf_tensors(tmp_path / "a").values())
    override = ["--output", str(tmp_path / "b"), "--convert.dtype", "bfloat16"]
    assert cli.main([*argv, *override, "--convert.max_shard_size", "1GB"]) == 0
    (single,) = (tmp_path / "b").glob("model-*")
    assert single.name == "model-00001-of-00001.safetensors"
    assert all(t.dtype == torch.bfloat16 for t in hf_tensors(tmp_path / "b").values())
    values = {"convert.dtype": "float32", "convert.max_shard_size": str(SHARD)}
    saved = resolve_job("", str(job["dump"] / "config.toml"))
    export = export_checkpoint(str(job["step"]), saved, str(tmp_path / "c"), overrides=values)
    assert export.num_shards == len(shards) and not export.kept
    assert_bitwise(hf_tensors(tmp_path / "c"), hf_tensors(tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"^convert\.dtype: expected one of"):
        export_checkpoint(str(job["step"]), resolve_job("", str(config)), str(tmp_path / "d"),
                          overrides={"convert.dtype": "fp8"})  # fmt: skip
    assert not (tmp_path / "d").exists()


def test_existing_output_is_left_alone(
    job: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    argv = ["dcp-to-hf", "--checkpoint", str(job["step"]), "--output", str(tmp_path / "hf")]
    rc, err = convert_cli(argv, capsys)
    assert rc == 2 and "already exists" in err and err.count("\n") == 1, err
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["keep.txt"]


def test_a_full_or_read_only_output_is_one_line_and_leaves_nothing(
    job: dict[str, Any], tmp_path: Path, disk: Disk, read_only: tuple[Path, str]
) -> None:
    """Read-only: refused before the checkpoint is read, both ways. A disk that fills up
    during the export (1 MB, the weights are 1.7 MB): one line naming the output, and neither
    it nor its temporary folder stays."""
    folder, words = read_only
    for argv in (
        ["dcp-to-hf", "--checkpoint", str(job["step"])],
        ["hf-to-dcp", "--hf", str(tmp_path / "not-read")],
    ):
        proc = titan("convert", *argv, "--output", str(folder / "out"), cwd=tmp_path)
        assert one_line(proc) == f"error: --output: {folder / 'out'}: {words}"
    full = disk("1m")
    argv = ["dcp-to-hf", "--checkpoint", str(job["step"]), "--output", str(full / "hf")]
    proc = titan("convert", *argv, "--dtype", "fp32", "--no-progress", cwd=tmp_path)
    assert one_line(proc) == f"error: {full / 'hf'}: no space left on device"
    assert files_under(full) == []


def test_cli_module_entry_point(job: dict[str, Any], tmp_path: Path) -> None:
    """`python -m titan_core.cli convert`: exit 2 and one stderr line for a bad checkpoint."""
    output = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_core.cli",
            "convert",
            "dcp-to-hf",
            "--checkpoint",
            str(tmp_path / "nope"),
            "--output",
            str(output),
            *TINY,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: checkpoint: ") and "does not exist" in proc.stderr
    _assert_nothing_at(output)


# ---------------------------------------------------------------- docs
def _documented_commands() -> list[str]:
    text = (ROOT / "docs" / "conversion.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if re.match(r"^([A-Z_]+=\S+\s+)*titan convert ", line):
                lines.append(line)
    return lines


def test_documented_commands_parse(
    job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every `titan convert` line in docs/conversion.md parses, its model config included
    (a job's saved config.toml is placed wherever a command would look for one)."""
    monkeypatch.chdir(tmp_path)
    commands = _documented_commands()
    assert len(commands) >= 6
    for line in commands:
        words = [w for w in shlex.split(line) if not re.match(r"^[A-Z_]+=", w)][2:]
        if words[0] == "hf-to-dcp":
            cli.HF_TO_DCP.parse(words[1:])  # takes no config arguments
            continue
        parsed = cli.DCP_TO_HF.parse(words[1:])
        ns = parsed.options
        # the aliases' [convert] values, checked below
        values = cli._alias_values(cli.DCP_TO_HF.alias_values(parsed))
        saved_config = job["dump"] / "config.toml"
        config_file = parsed.config.config_file
        for path in (config_file, str(Path(ns.checkpoint).parent.parent / "config.toml")):
            if path and not storage.is_url(path):
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(saved_config, path)
        with monkeypatch.context() as m:
            if storage.is_url(ns.checkpoint):  # S3 lines: the config next to it is there
                m.setattr(cli.storage, "exists", lambda path: True)
            argv = cli._job_config_argv(ns.checkpoint, parsed.config)
        argv = [str(saved_config) if storage.is_url(a) else a for a in argv]
        assert apply_values(parse_args(argv), values).model.name == "llama3", line
    assert {shlex.split(c)[2] for c in commands} == {"dcp-to-hf", "hf-to-dcp"}
