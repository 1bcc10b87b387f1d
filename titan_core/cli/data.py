"""``titan data``: prepare raw sources into token shards, describe and verify prepared datasets.

    titan data prepare SOURCE [SOURCE ...] [--out ROOT] [--text-field F] [--tokenizer PATH]
        [--validation-every N] [--workers N]
    titan data prepare --module M --config C [--data.sources S ...] [--section.field v ...]
    titan data info URL
    titan data verify URL [--checksum]

A SOURCE is a file or folder of .txt/.jsonl/.json/.parquet files (compressed .gz/.bz2/.xz/.zst
too), any fsspec URL (s3://bucket/prefix, credentials from the AWS_* environment), or a Hugging
Face dataset ``hf:NAME?name=CONFIG&split=SPLIT&revision=REV``. The dataset is written to
``<ROOT>/<fingerprint>``; its URL is the last line printed. Running it again is a cache hit;
files added to a source since are tokenized and appended. Config arguments (``--module/--config``,
``--data.*``, ``--tokenizer.path``, ``--job.dump_folder``) fill in what the flags leave out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import tyro

from titan_core import storage
from titan_core.cli.command import Command, Parsed, default, dispatch, run
from titan_core.errors import ConfigError


@dataclass(kw_only=True)
class PrepareOptions:
    """The options of ``titan data prepare`` (config arguments aside)."""

    sources: Annotated[
        tyro.conf.Positional[list[str]],
        tyro.conf.arg(metavar="SOURCE ...", help_behavior_hint="(default: data.sources)"),
    ] = field(default_factory=list)
    """files, folders, fsspec URLs, hf:NAME?... datasets"""
    out: Annotated[str, default("the config's data.root, else <job.dump_folder>/data")] = ""
    """data root; the dataset goes to <ROOT>/<fingerprint>"""
    text_field: Annotated[str, default("the config's data.text_field, else text")] = ""
    """row field holding the text"""
    tokenizer: Annotated[str, default("the config's tokenizer.path, else the bundled one")] = ""
    """tiktoken ranks file"""
    validation_every: Annotated[int, default("the config's data.validation_every, else 100")] = 100
    """hold out every Nth document (0: none)"""
    workers: Annotated[int, default("the config's data.workers, else 0: every core")] = 0
    """local processes"""


@dataclass(kw_only=True)
class InfoOptions:
    """The options of ``titan data info``."""

    url: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="URL")]
    """prepared dataset folder or URL"""


@dataclass(kw_only=True)
class VerifyOptions:
    """The options of ``titan data verify``."""

    url: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="URL")]
    """prepared dataset folder or URL"""
    checksum: bool = False
    """also compare sha256 (reads every shard)"""


PREPARE = Command(
    "titan data prepare",
    PrepareOptions,
    "Tokenize sources into shards (a rerun is cached; new files are appended). SOURCEs go "
    "before config arguments, which take the values after them (--data.sources A B). What the "
    "options leave out comes from the config: data.*, tokenizer.path, job.dump_folder.",
)
INFO = Command("titan data info", InfoOptions, "Summarise a prepared dataset.", takes_config=False)
VERIFY = Command(
    "titan data verify",
    VerifyOptions,
    "Check shard sizes (and sha256 with --checksum) against the manifest.",
    takes_config=False,
)


def _prepare(argv: list[str]) -> int:
    from titan_core.config.job import JobConfig
    from titan_core.data.prepare import prepare, spec_from_config

    parsed: Parsed[PrepareOptions] = PREPARE.parse(argv)
    ns, given = parsed.options, parsed.given
    if ns.workers < 0:
        raise ConfigError(f"--workers: expected >= 0, got {ns.workers}")
    cfg = JobConfig()  # no config arguments: the defaults, without importing the engine (torch)
    if config_argv := parsed.config.argv():
        from titan_core.resolve import parse_args

        cfg = parse_args(config_argv)
    if not ns.sources and not cfg.data.sources:
        raise ConfigError("titan data prepare: no sources (give SOURCE ... or --data.sources)")
    options = {
        "sources": tuple(ns.sources),
        "root": ns.out,
        "tokenizer_path": ns.tokenizer,
        "text_field": ns.text_field,
    }
    options = {k: v for k, v in options.items() if v}
    if "validation_every" in given:  # 0 (none held out) is a value
        options["validation_every"] = given["validation_every"]
    spec = spec_from_config(cfg, **options)
    storage.check_writable(spec.root, "--out" if ns.out else "data.root")
    with storage.folders_kept_on_success(spec.root):  # a full disk leaves no empty folders
        result = prepare(spec, workers=given.get("workers", cfg.data.workers))
    manifest = result.manifest
    total = sum(s.num_tokens for s in manifest.shards)
    if result.cached:
        print(
            f"data prepare: cached, nothing new in {len(manifest.files)} file(s); "
            f"{total:,} tokens in {len(manifest.shards)} shards"
        )
    else:
        rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
        print(
            f"data prepare: {result.new_units} new file(s) ({result.reused_units} already "
            f"prepared) -> {result.new_shards} new shards, {result.tokens:,} tokens in "
            f"{result.seconds:.1f} s ({rate:,.0f} tokens/s); dataset: {total:,} tokens"
        )
    print(result.url)
    return 0


def _info(argv: list[str]) -> int:
    from titan_core.data.shards import SPLITS, read_manifest
    from titan_core.data.sources import storage_errors

    ns = INFO.parse(argv).options

    with storage_errors(ns.url):
        manifest = read_manifest(ns.url)
    tok = manifest.tokenizer
    every = manifest.validation.get("every", 0)
    rule = f"1 in {every} documents of each file" if every else "none"
    print(ns.url)
    print(f"  format      {manifest.format} v{manifest.format_version}, tokens {manifest.dtype}")
    print(
        f"  tokenizer   {tok.get('fingerprint', '')[:16]} (vocab {tok.get('vocab_size')}, "
        f"bos {tok.get('bos_id')}, eos {tok.get('eos_id')}) from {tok.get('path')}"
    )
    print(f"  text field  {manifest.text_field!r}; validation: {rule}")
    for source in manifest.sources:
        print(f"  source      {source}")
    print(f"  files       {len(manifest.files)}")
    for split in SPLITS:
        shards = manifest.split_shards(split)
        docs, tokens = sum(s.num_docs for s in shards), sum(s.num_tokens for s in shards)
        print(f"  {split:<11} {len(shards)} shards, {docs:,} documents, {tokens:,} tokens")
    return 0


def _verify(argv: list[str]) -> int:
    from titan_core.data.shards import read_manifest, verify_shards
    from titan_core.data.sources import storage_errors

    ns = VERIFY.parse(argv).options

    with storage_errors(ns.url):
        manifest = read_manifest(ns.url)
        verify_shards(ns.url, manifest, checksum=ns.checksum)
    what = "sizes and sha256" if ns.checksum else "sizes"
    print(f"data verify: {len(manifest.shards)} shards ok ({what}) in {ns.url}")
    return 0


COMMANDS = {
    "prepare": ("tokenize sources into shards (a rerun is cached)", _prepare),
    "info": ("summarise a prepared dataset", _info),
    "verify": ("check shards against the manifest", _verify),
}


def main(argv: list[str] | None = None) -> int:
    """Run ``titan data``; user errors print one ``error:`` line on stderr and return 2."""
    return run(_data, argv)


def _data(argv: list[str]) -> int:
    from titan_core.logging import init_logger

    init_logger()
    return dispatch("titan data", __doc__ or "", COMMANDS, argv)
