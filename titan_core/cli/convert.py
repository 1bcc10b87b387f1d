"""``titan convert``: checkpoint conversion between DCP and Hugging Face folders.

    titan convert dcp-to-hf --checkpoint URL --output URL
        [--module M --config C | --config-file F] [--section.field v ...]
    titan convert hf-to-dcp --hf PATH_OR_URL --output URL

dcp-to-hf needs the job's model config: by default the ``config.toml`` a training job saved two
levels above ``<dump>/checkpoint/step-N``, else the model the checkpoint's commit marker describes
(every checkpoint ``titan train`` or ``hf-to-dcp`` writes does); ``--module/--config``,
``--config-file`` and config overrides (e.g. ``--model.n_layers 4``, ``--tokenizer.path P``)
replace or adjust it. The export's settings are that config's ``[convert]`` section
(``--convert.dtype float32``, ``--convert.max_shard_size 500MB``); ``--dtype bf16|fp32`` and
``--max-shard-size`` are aliases of those keys.
Paths may be local or fsspec URLs (``s3://``, credentials from the AWS_* environment).
"""

from __future__ import annotations

import os
import posixpath
import sys
from dataclasses import dataclass
from typing import Annotated, Any

from titan_core import storage
from titan_core.cli.command import Command, ConfigArgs, default, dispatch, run
from titan_core.config.job import parse_size
from titan_core.errors import ConfigError

# --dtype's abbreviations of convert.dtype's values (the full names work too).
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(kw_only=True)
class DcpToHfOptions:
    """The options of ``titan convert dcp-to-hf`` (config arguments aside)."""

    checkpoint: str
    """DCP step directory (path or URL)"""
    output: str
    """new HF folder (path or URL)"""
    dtype: Annotated[str, default("the config's convert.dtype")] = ""
    """alias of --convert.dtype (bf16 or fp32 accepted too)"""
    max_shard_size: Annotated[str, default("the config's convert.max_shard_size")] = ""
    """alias of --convert.max_shard_size, e.g. 500MB"""
    progress: Annotated[bool, default("when stderr is a terminal")] = False
    """progress bar on stderr"""


@dataclass(kw_only=True)
class HfToDcpOptions:
    """The options of ``titan convert hf-to-dcp``."""

    hf: str
    """HF folder with config.json (path or URL)"""
    output: str
    """new DCP checkpoint directory"""


DCP_TO_HF = Command(
    "titan convert dcp-to-hf",
    DcpToHfOptions,
    "DCP checkpoint -> Hugging Face folder. Without --module/--config or --config-file the "
    "model config is the config.toml two levels above the checkpoint (<dump>/config.toml), else "
    "the model the checkpoint describes; --section.field VALUE overrides adjust it (e.g. "
    "--model.n_layers 4, --tokenizer.path P) and the export (--convert.dtype float32, "
    "--convert.max_shard_size 500MB).",
    aliases={"dtype": "convert.dtype", "max_shard_size": "convert.max_shard_size"},
)
HF_TO_DCP = Command(
    "titan convert hf-to-dcp",
    HfToDcpOptions,
    "Hugging Face folder -> DCP model-only checkpoint (step 0).",
    takes_config=False,
)


def _job_config_argv(checkpoint: str, config: ConfigArgs) -> list[str]:
    """Config-manager argv for the job that wrote ``checkpoint``."""
    if config.config or config.config_file:
        return config.argv()
    if config.module:
        raise ConfigError("--module: names the family of a --config recipe (e.g. --config X)")
    # <dump_folder>/checkpoint/step-N -> <dump_folder>/config.toml
    parent = posixpath.dirname if storage.is_url(checkpoint) else _local_dirname
    config_file = storage.join(parent(parent(checkpoint.rstrip("/"))), "config.toml")
    if storage.exists(config_file):
        return ["--job.config_file", config_file, *config.overrides]
    from titan_core.checkpoint.manager import checkpoint_model

    if checkpoint_model(checkpoint) is not None:  # its marker describes the model
        return ["--checkpoint.initial_load_path", checkpoint, *config.overrides]
    raise ConfigError(
        f"no model config for {checkpoint}: {config_file} not found and the "
        "checkpoint describes no model; pass --module/--config or --config-file"
    )


def _alias_values(values: dict[str, Any]) -> dict[str, Any]:
    """The ``[convert]`` values of the alias options given (``bf16``/``fp32`` spelled out)."""
    dtype = values.get("convert.dtype")
    return values | ({"convert.dtype": _DTYPE_ALIASES.get(dtype, dtype)} if dtype else {})


def _local_dirname(path: str) -> str:
    return os.path.dirname(os.path.abspath(path.removeprefix("file://")))


def _dcp_to_hf(argv: list[str]) -> int:
    from titan_core.build import build_model_args
    from titan_core.config.schema import apply_values
    from titan_core.convert import storage_errors
    from titan_core.convert.dcp_to_hf import dcp_to_hf
    from titan_core.data import Tokenizer, default_tokenizer_path
    from titan_core.resolve import parse_args

    parsed = DCP_TO_HF.parse(argv)
    ns = parsed.options
    storage.check_writable(ns.output, "--output")  # before a checkpoint is read
    values = _alias_values(DCP_TO_HF.alias_values(parsed))
    with storage_errors(ns.checkpoint):  # the config may be read from next to it, e.g. on S3
        cfg = apply_values(parse_args(_job_config_argv(ns.checkpoint, parsed.config)), values)
    tokenizer_path = cfg.tokenizer.path or str(default_tokenizer_path())
    model_args = build_model_args(cfg, Tokenizer(tokenizer_path).n_words)
    progress = parsed.given.get("progress", sys.stderr.isatty())
    shards = dcp_to_hf(
        ns.checkpoint,
        ns.output,
        model_args=model_args,
        tokenizer_path=tokenizer_path,
        dtype=cfg.convert.dtype,
        max_shard_size=parse_size(cfg.convert.max_shard_size),
        progress=progress,
        model_name=cfg.model.name,
    )
    print(f"dcp-to-hf: wrote {len(shards)} shard(s) + config and tokenizer to {ns.output}")
    return 0


def _hf_to_dcp(argv: list[str]) -> int:
    from titan_core.convert.hf_to_dcp import hf_to_dcp

    ns = HF_TO_DCP.parse(argv).options
    storage.check_writable(ns.output, "--output")
    hf_to_dcp(ns.hf, ns.output)
    print(f"hf-to-dcp: wrote model-only DCP checkpoint (step 0) to {ns.output}")
    return 0


COMMANDS = {
    "dcp-to-hf": ("DCP checkpoint -> Hugging Face folder", _dcp_to_hf),
    "hf-to-dcp": ("Hugging Face folder -> DCP model-only checkpoint", _hf_to_dcp),
}


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; user errors print one ``error:`` line on stderr and return 2."""
    return run(_convert, argv)


def _convert(argv: list[str]) -> int:
    from titan_core.logging import init_logger

    init_logger()
    return dispatch("titan convert", __doc__ or "", COMMANDS, argv)
