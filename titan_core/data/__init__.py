"""Tokenizer, bundled offline corpus, document sources and the packing dataloader."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_core.data.assets import (
        assets_dir,
        bundled_corpus_dir,
        default_tokenizer_path,
        ensure_assets,
    )
    from titan_core.data.datasets import (
        DatasetSpec,
        DocumentSource,
        DocumentStream,
        HFDocumentSource,
        LocalDocumentSource,
        build_document_source,
        is_local_dataset,
        register_dataset,
        registered_datasets,
    )
    from titan_core.data.loader import (
        ParallelAwareDataloader,
        TextPackingDataset,
        build_dataloader,
    )
    from titan_core.data.reader import PreparedDataloader, build_prepared_dataloader
    from titan_core.data.tokenizer import LLAMA3_PAT_STR, SPECIAL_TOKENS, Tokenizer, train_bpe

# Exports resolve lazily: `python -m titan_core.data.assets` must not find its own module already
# imported by this package, and tokenizer users need not import torch.
_EXPORTS = {
    "assets": ["assets_dir", "bundled_corpus_dir", "default_tokenizer_path", "ensure_assets"],
    "datasets": [
        "DatasetSpec",
        "DocumentSource",
        "DocumentStream",
        "HFDocumentSource",
        "LocalDocumentSource",
        "build_document_source",
        "is_local_dataset",
        "register_dataset",
        "registered_datasets",
    ],
    "loader": ["ParallelAwareDataloader", "TextPackingDataset", "build_dataloader"],
    "reader": ["PreparedDataloader", "build_prepared_dataloader"],
    "tokenizer": ["LLAMA3_PAT_STR", "SPECIAL_TOKENS", "Tokenizer", "train_bpe"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "LLAMA3_PAT_STR",
    "SPECIAL_TOKENS",
    "DatasetSpec",
    "DocumentSource",
    "DocumentStream",
    "HFDocumentSource",
    "LocalDocumentSource",
    "ParallelAwareDataloader",
    "PreparedDataloader",
    "TextPackingDataset",
    "Tokenizer",
    "assets_dir",
    "build_dataloader",
    "build_document_source",
    "build_prepared_dataloader",
    "bundled_corpus_dir",
    "default_tokenizer_path",
    "ensure_assets",
    "is_local_dataset",
    "register_dataset",
    "registered_datasets",
    "train_bpe",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
