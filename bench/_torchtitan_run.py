"""Run torchtitan's own trainer offline, single process, as a tokens/s reference.

Targets torchtitan 0.2.2 (the newest PyPI release that runs on torch 2.11; 0.3.0
needs torch > 2.11). Into a scratch directory it writes a tiny local tokenizer
(byte-level BPE, 2000 tokens so it fits debugmodel), a small synthetic JSONL dataset, a
TOML job config, and an entry script that registers a Llama 3.2 "1B" flavor
(absent from 0.2.x) before calling ``torchtitan.train.main``. It launches that
with ``torch.distributed.run --nproc_per_node 1`` with the hub switched off,
parses torchtitan's per-step log lines (``step: N ... memory: X GiB ... tps: T``)
and prints, as the LAST stdout line, a JSON object: median tokens/s per device
over the steps after warm-up, peak reserved memory, steps, version, note.

torchtitan defaults kept: bf16 params / fp32 reduce (FSDP2 mixed precision),
fused AdamW (lr 8e-4, betas 0.9/0.95, wd 0.1), grad clip 1.0, SDPA causal.
Differences from Llama 3.2 1B: no tied embeddings (0.2.x has no weight tying),
rope scaling factor 8 (8B default) instead of 32.

Examples:
    python bench/gpu_torchtitan.py --seq 2048 --batch 4 --steps 30 --compile
    python bench/gpu_torchtitan.py --model qwen3 --flavor 1.7B --ac selective
    python bench/gpu_torchtitan.py --cpu --flavor debugmodel --seq 256 --batch 2 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ENTRY = """
import collections, os, types
import torch

if os.environ.get("TTB_CPU"):  # CPU smoke test: make torchtitan pick the cpu device
    torch._utils._get_available_device_type = lambda: "cpu"
    c = torch.cpu
    c.get_device_name = lambda *a: "cpu"
    c.get_device_properties = lambda *a: types.SimpleNamespace(total_memory=1 << 40)
    c.memory_stats = lambda *a: collections.defaultdict(int)
    c.reset_peak_memory_stats = c.empty_cache = lambda *a: None
    c.current_device = lambda: 0
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs

# Llama 3.2 1B shape (0.2.x ships no 1B flavor); rope scaling left at the 8B defaults.
llama3_args["1B"] = TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
    multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000,
)
from torchtitan.train import Trainer, main

main(Trainer)
"""

TOML = """
[job]
dump_folder = "{dump}"
[metrics]
log_freq = 1
[model]
name = "{model}"
flavor = "{flavor}"
hf_assets_path = "{tok}"
[optimizer]
name = "AdamW"
lr = 8e-4
implementation = "{opt_impl}"
[lr_scheduler]
warmup_steps = 2
[training]
dataset = "c4_test"
dataset_path = "{data}"
local_batch_size = {batch}
seq_len = {seq}
steps = {steps}
mixed_precision_param = "{mp_param}"
[activation_checkpoint]
mode = "{ac}"
[compile]
enable = {compile}
[checkpoint]
enable = false
[validation]
enable = false
"""

STEP_RE = re.compile(r"step:\s*(\d+).*?memory:\s*(-?[\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def make_assets(root: Path, n_docs: int = 1500, vocab: int = 2000) -> tuple[Path, Path]:
    """Synthetic JSONL corpus plus a byte-level BPE tokenizer.json trained on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(20000)
    ]
    data_dir, tok_dir = root / "data", root / "tokenizer"
    data_dir.mkdir(parents=True, exist_ok=True)
    tok_dir.mkdir(parents=True, exist_ok=True)
    texts = [" ".join(rng.choices(words, k=rng.randint(300, 1500))) + "." for _ in range(n_docs)]
    with open(data_dir / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts[:300], trainer=trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": False}
        )
    )
    return data_dir, tok_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["llama3", "qwen3"], default="llama3")
    ap.add_argument("--flavor", default=None, help="1B (llama3), 1.7B (qwen3), debugmodel")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="logged steps excluded from median")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--cpu", action="store_true", help="gloo + fp32, for a CPU smoke test")
    ap.add_argument("--workdir", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--timeout", type=int, default=3000)
    a = ap.parse_args()
    flavor = a.flavor or {"llama3": "1B", "qwen3": "1.7B"}[a.model]

    root = Path(a.workdir or tempfile.mkdtemp(prefix="ttbench_"))
    data_dir, tok_dir = make_assets(root)
    (root / "ttbench_main.py").write_text(ENTRY)
    (root / "bench.toml").write_text(
        TOML.format(
            model=a.model,
            flavor=flavor,
            tok=tok_dir,
            data=data_dir,
            dump=root / "outputs",
            seq=a.seq,
            batch=a.batch,
            steps=a.steps,
            ac=a.ac,
            compile=str(a.compile).lower(),
            mp_param="float32" if a.cpu else "bfloat16",
            opt_impl="foreach" if a.cpu else "fused",
        )
    )
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(root / "hf_cache"),
        HF_HOME=str(root / "hf_home"),
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    )
    if a.cpu:
        env.update(CUDA_VISIBLE_DEVICES="", TTB_CPU="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "ttbench_main.py",
        "--job.config_file",
        str(root / "bench.toml"),
    ]
    print("+", " ".join(cmd), flush=True)
    steps: dict[int, tuple[float, float]] = {}
    tail: list[str] = []  # last lines naming an error
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        clean = ANSI_RE.sub("", line.rstrip())
        print(clean, flush=True)
        if "Error" in clean:
            tail = [*tail, clean][-5:]
        m = STEP_RE.search(clean)
        if m:
            steps[int(m.group(1))] = (float(m.group(3).replace(",", "")), float(m.group(2)))
    rc = proc.wait(timeout=a.timeout)

    try:
        version = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        version = "unknown"
    measured = [v for k, v in sorted(steps.items()) if k > a.warmup] or list(steps.values())[1:]
    note = (
        f"{a.model} {flavor} seq={a.seq} batch={a.batch} compile={a.compile} ac={a.ac} "
        f"cpu={a.cpu} rc={rc}; tps from torchtitan logs (per device), "
        f"median over steps > {a.warmup}; mem = max reserved"
    )
    if rc != 0 or not measured:
        note += "; FAILED: " + " | ".join(tail)
    out = {
        "tps": statistics.median(t for t, _ in measured) if measured else None,
        "mem_gib": max((m for _, m in steps.values()), default=None),
        "steps": len(steps),
        "version": version,
        "note": note,
    }
    print(json.dumps(out))
    sys.exit(0 if rc == 0 and measured else 1)


if __name__ == "__main__":
    main()
