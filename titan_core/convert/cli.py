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

import argparse
import os
import posixpath
import sys
from typing import NoReturn

from titan_core import storage
from titan_core.config.job import parse_size
from titan_core.errors import ConfigError, TitanError

# --dtype's abbreviations of convert.dtype's values (the full names work too).
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32"}


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line ConfigErrors instead of a usage dump + exit."""

    def error(self, message: str) -> NoReturn:
        """Raise the message as a ConfigError (printed by ``main`` as one line)."""
        raise ConfigError(f"{self.prog}: {message}")


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="titan convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="direction", required=True, metavar="{dcp-to-hf,hf-to-dcp}")
    to_hf = sub.add_parser(
        "dcp-to-hf",
        help="DCP checkpoint -> Hugging Face folder",
        allow_abbrev=False,
        epilog="Any other --section.field VALUE overrides the model config (e.g. "
        "--model.n_layers 4, --tokenizer.path P) or the export (--convert.dtype float32, "
        "--convert.max_shard_size 500MB). Without --module/--config or --config-file "
        "the config is the config.toml two levels above the checkpoint (<dump>/config.toml), "
        "else the model the checkpoint describes.",
    )
    to_hf.add_argument("--checkpoint", required=True, help="DCP step directory (path or URL)")
    to_hf.add_argument("--output", required=True, help="new HF folder (path or URL)")
    to_hf.add_argument("--dtype", help="alias of --convert.dtype (bf16 or fp32 accepted too)")
    to_hf.add_argument("--max-shard-size", help="alias of --convert.max_shard_size, e.g. 500MB")
    to_hf.add_argument("--module", help="config registry module (with --config), e.g. llama3")
    to_hf.add_argument("--config", help="config registry function, e.g. llama3_debugmodel")
    to_hf.add_argument("--config-file", help="a job's TOML config (e.g. <dump>/config.toml)")
    to_hf.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    to_dcp = sub.add_parser(
        "hf-to-dcp", help="Hugging Face folder -> DCP model-only checkpoint", allow_abbrev=False
    )
    to_dcp.add_argument("--hf", required=True, help="HF folder with config.json (path or URL)")
    to_dcp.add_argument("--output", required=True, help="new DCP checkpoint directory")
    return parser


def _job_config_argv(ns: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Config-manager argv for the job that wrote ``ns.checkpoint``."""
    argv = []
    if ns.module is not None and ns.config is None:
        raise ConfigError("--module: names the family of a --config recipe (e.g. --config X)")
    if ns.config is not None:  # the family is found from the recipe name when not given
        argv += (["--module", ns.module] if ns.module is not None else []) + ["--config", ns.config]
    config_file = ns.config_file
    if config_file is None and ns.config is None:
        # <dump_folder>/checkpoint/step-N -> <dump_folder>/config.toml
        parent = posixpath.dirname if storage.is_url(ns.checkpoint) else _local_dirname
        config_file = storage.join(parent(parent(ns.checkpoint.rstrip("/"))), "config.toml")
        if not storage.exists(config_file):
            from titan_core.checkpoint.manager import checkpoint_model

            if checkpoint_model(ns.checkpoint) is not None:  # its marker describes the model
                return ["--checkpoint.initial_load_path", ns.checkpoint, *overrides]
            raise ConfigError(
                f"no model config for {ns.checkpoint}: {config_file} not found and the "
                "checkpoint describes no model; pass --module/--config or --config-file"
            )
    if config_file is not None:
        argv += ["--job.config_file", config_file]
    return argv + overrides


def _alias_values(ns: argparse.Namespace, overrides: list[str]) -> dict[str, str]:
    """``[convert]`` values of the alias flags; both an alias and its key given is an error."""
    given = {t[2:].partition("=")[0].replace("-", "_") for t in overrides if t.startswith("--")}
    values = {}
    for flag, key, value in (
        ("--dtype", "convert.dtype", ns.dtype),
        ("--max-shard-size", "convert.max_shard_size", ns.max_shard_size),
    ):
        if value is None:
            continue
        if key in given:
            raise ConfigError(f"{flag}: an alias of --{key}, which is given too; give one")
        values[key] = _DTYPE_ALIASES.get(value, value) if flag == "--dtype" else value
    return values


def _local_dirname(path: str) -> str:
    return os.path.dirname(os.path.abspath(path.removeprefix("file://")))


def _dcp_to_hf(ns: argparse.Namespace, overrides: list[str]) -> int:
    from titan_core.build import build_model_args
    from titan_core.config.manager import parse_args
    from titan_core.config.resolve import apply_values
    from titan_core.convert import storage_errors
    from titan_core.convert.dcp_to_hf import dcp_to_hf
    from titan_core.data import Tokenizer, default_tokenizer_path

    values = _alias_values(ns, overrides)
    with storage_errors(ns.checkpoint):  # the config may be read from next to it, e.g. on S3
        cfg = apply_values(parse_args(_job_config_argv(ns, overrides)), values)
    tokenizer_path = cfg.tokenizer.path or str(default_tokenizer_path())
    model_args = build_model_args(cfg, Tokenizer(tokenizer_path).n_words)
    progress = sys.stderr.isatty() if ns.progress is None else ns.progress
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


def _hf_to_dcp(ns: argparse.Namespace, overrides: list[str]) -> int:
    from titan_core.convert.hf_to_dcp import hf_to_dcp

    if overrides:
        raise ConfigError(f"hf-to-dcp: unrecognized arguments: {' '.join(overrides)}")
    hf_to_dcp(ns.hf, ns.output)
    print(f"hf-to-dcp: wrote model-only DCP checkpoint (step 0) to {ns.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; user errors print one ``error:`` line on stderr and return 2."""
    from titan_core.logging import init_logger

    init_logger()
    try:
        ns, rest = _build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
        if ns.direction == "dcp-to-hf":
            return _dcp_to_hf(ns, rest)
        return _hf_to_dcp(ns, rest)
    except TitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
