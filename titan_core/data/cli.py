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
``--data.*``, ``--tokenizer.path``, ``--storage.root``) fill in what the flags leave out.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from titan_core.errors import ConfigError, TitanError

DEFAULT_ROOT = "./outputs/data"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line ConfigErrors instead of a usage dump + exit."""

    def error(self, message: str) -> NoReturn:
        """Raise the message as a ConfigError (printed by ``main`` as one line)."""
        raise ConfigError(f"{self.prog}: {message}")


def _parsers() -> dict[str, _Parser]:
    prep = _Parser(
        prog="titan data prepare",
        description="Tokenize sources into shards (a rerun is cached; new files are appended).",
        epilog="Config arguments (--module/--config, --data.*, --tokenizer.path, --storage.root) "
        "may follow and fill in what the flags leave out.",
        allow_abbrev=False,
    )
    prep.add_argument("sources", nargs="*", metavar="SOURCE", help="files, folders, URLs, hf:…")
    prep.add_argument("--out", help=f"data root (default {DEFAULT_ROOT}, or the config's)")
    prep.add_argument("--text-field", help="row field holding the text (default: text)")
    prep.add_argument("--tokenizer", help="tiktoken ranks file (default: the bundled one)")
    prep.add_argument(
        "--validation-every", type=int, help="hold out every Nth document (default 100; 0: none)"
    )
    prep.add_argument("--workers", type=int, help="local processes (default: every core)")
    info = _Parser(
        prog="titan data info", description="Summarise a prepared dataset.", allow_abbrev=False
    )
    info.add_argument("url", help="prepared dataset folder or URL")
    verify = _Parser(
        prog="titan data verify",
        description="Check shard sizes (and sha256 with --checksum) against the manifest.",
        allow_abbrev=False,
    )
    verify.add_argument("url", help="prepared dataset folder or URL")
    verify.add_argument("--checksum", action="store_true", help="also compare sha256 (reads all)")
    return {"prepare": prep, "info": info, "verify": verify}


_PREPARE_FLAGS = ("--out", "--text-field", "--tokenizer", "--validation-every", "--workers")


def split_config_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(prepare's own arguments, config arguments): an option that is not one of prepare's
    flags starts config arguments and keeps the values after it (``--data.sources a b``), so
    SOURCEs go before config options."""
    own: list[str] = []
    config: list[str] = []
    target = own
    for token in argv:
        if token.startswith("-") and not token[1:].isdigit():
            known = token.partition("=")[0] in (*_PREPARE_FLAGS, "--help", "-h")
            target = own if known else config
        target.append(token)
    return own, config


def _prepare(ns: argparse.Namespace, config_argv: list[str]) -> int:
    from titan_core.data.prepare import PrepareSpec, prepare

    base = {"sources": (), "root": DEFAULT_ROOT, "tokenizer_path": "", "text_field": "text"}
    validation_every, workers = 100, 0
    if config_argv:
        from titan_core.config.manager import parse_args

        cfg = parse_args(config_argv)
        base = {
            "sources": tuple(cfg.data.sources),
            "root": cfg.data.root or f"{cfg.storage.root.rstrip('/')}/data",
            "tokenizer_path": cfg.tokenizer.path,
            "text_field": cfg.data.text_field,
        }
        validation_every, workers = cfg.data.validation_every, cfg.data.workers
    if ns.workers is not None and ns.workers < 0:
        raise ConfigError(f"--workers: expected >= 0, got {ns.workers}")
    sources = tuple(ns.sources) or base["sources"]
    if not sources:
        raise ConfigError("titan data prepare: no sources (give SOURCE ... or --data.sources)")
    spec = PrepareSpec(
        sources=sources,
        root=ns.out or base["root"],
        tokenizer_path=ns.tokenizer or base["tokenizer_path"] or _default_tokenizer(),
        text_field=ns.text_field or base["text_field"],
        validation_every=validation_every if ns.validation_every is None else ns.validation_every,
    )
    result = prepare(spec, workers=workers if ns.workers is None else ns.workers)
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


def _default_tokenizer() -> str:
    from titan_core.data.assets import default_tokenizer_path

    return str(default_tokenizer_path())


def _info(ns: argparse.Namespace) -> int:
    from titan_core.data.shards import SPLITS, read_manifest
    from titan_core.data.sources import storage_errors

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


def _verify(ns: argparse.Namespace) -> int:
    from titan_core.data.shards import read_manifest, verify_shards
    from titan_core.data.sources import storage_errors

    with storage_errors(ns.url):
        manifest = read_manifest(ns.url)
        verify_shards(ns.url, manifest, checksum=ns.checksum)
    what = "sizes and sha256" if ns.checksum else "sizes"
    print(f"data verify: {len(manifest.shards)} shards ok ({what}) in {ns.url}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``titan data``; user errors print one ``error:`` line on stderr and return 2."""
    from titan_core.logging import init_logger

    init_logger()
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        parsers = _parsers()
        if args[:1] in (["-h"], ["--help"]):
            print(__doc__)
            return 0
        command, args = (args[0], args[1:]) if args else ("", [])
        if command not in parsers:
            raise ConfigError(f"titan data: expected prepare, info or verify, got {command!r}")
        if command == "prepare":
            own, config = split_config_args(args)
            return _prepare(parsers[command].parse_intermixed_args(own), config)
        ns = parsers[command].parse_args(args)
        return _info(ns) if command == "info" else _verify(ns)
    except TitanError as e:
        print("error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
