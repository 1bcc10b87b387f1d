"""Tokenizer, bundled offline corpus, document sources and the packing dataloader."""

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
    register_dataset,
    registered_datasets,
)
from titan_core.data.loader import ParallelAwareDataloader, TextPackingDataset, build_dataloader
from titan_core.data.tokenizer import LLAMA3_PAT_STR, SPECIAL_TOKENS, Tokenizer, train_bpe

__all__ = [
    "LLAMA3_PAT_STR",
    "SPECIAL_TOKENS",
    "DatasetSpec",
    "DocumentSource",
    "DocumentStream",
    "HFDocumentSource",
    "LocalDocumentSource",
    "ParallelAwareDataloader",
    "TextPackingDataset",
    "Tokenizer",
    "assets_dir",
    "build_dataloader",
    "build_document_source",
    "bundled_corpus_dir",
    "default_tokenizer_path",
    "ensure_assets",
    "register_dataset",
    "registered_datasets",
    "train_bpe",
]
