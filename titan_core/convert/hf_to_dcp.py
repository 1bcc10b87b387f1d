"""Hugging Face folder (any registered family) -> DCP model-only checkpoint.

The folder is read by ``checkpoint.hf_weights`` (which the trainer shares for
``checkpoint.initial_load_in_hf``): every shard's header is read and checked (names, shapes,
truncation) before any tensor data is, and before anything is written.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import torch.distributed.checkpoint as dcp

from titan_core import storage
from titan_core.checkpoint.dcp_io import dcp_writer
from titan_core.checkpoint.hf_weights import (
    check_hf_weights,
    expected_shapes,
    initialized_tensors,
    list_hf_weights,
    load_hf_state_dict,
    read_hf_model_args,
)
from titan_core.checkpoint.manager import COMMIT_MARKER
from titan_core.convert import StagedOutput, format_size
from titan_core.logging import logger
from titan_core.models import describe_model, spec_for_args


def hf_to_dcp(hf: str, output: str, *, model_args: Any | None = None) -> Any:
    """Save an HF folder as a committed model-only DCP checkpoint (step 0) at ``output``.

    Model args come from ``config.json`` unless given; returns the args used. The commit marker
    describes the model (``models.describe_model``), so dcp-to-hf, ``titan eval`` and
    ``titan train --checkpoint.initial_load_path`` need no config for it.
    """
    hf = hf.rstrip("/")
    model_args = model_args if model_args is not None else read_hf_model_args(hf)
    weights = list_hf_weights(hf)
    absent = check_hf_weights(hf, weights, model_args)
    state_dict = load_hf_state_dict(weights, model_args)
    if absent:  # a part the folder may lack (warned about): the model's own initialization
        state_dict |= initialized_tensors(
            model_args, set(expected_shapes(model_args)) - set(state_dict)
        )
    model = describe_model(spec_for_args(model_args).name, model_args)  # self-describing
    with StagedOutput(output, last=COMMIT_MARKER) as out:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            writer = dcp_writer(out.staging)
            dcp.save({"model": state_dict}, storage_writer=writer, no_dist=True)
        marker = {"step": 0, "model_only": True, "time": time.time(), "source": hf, "model": model}
        marker["files"] = writer.files  # each file's size and checksum, verified before a load
        storage.write_text(storage.join(out.staging, COMMIT_MARKER), json.dumps(marker))
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    logger.info("Wrote DCP checkpoint %s (%s) from %s", output, format_size(nbytes), hf)
    return model_args


__all__ = ["hf_to_dcp"]
