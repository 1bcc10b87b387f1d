"""Llama 3 <-> Hugging Face ``LlamaForCausalLM``: the shared decoder conversion
(``models.common.family``) with Llama's FFN sizing read back from ``intermediate_size``."""

from __future__ import annotations

from typing import Any

from titan_core.models.common import ffn_hidden_dim
from titan_core.models.common.family import DecoderHF
from titan_core.models.llama3.flavors import llama3_flavors
from titan_core.models.llama3.model import TransformerModelArgs


def _ffn_sizing(dim: int, intermediate: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) giving ``intermediate``; a known flavor's if one fits."""
    candidates = [
        (f.multiple_of, f.ffn_dim_multiplier) for f in llama3_flavors.values() if f.dim == dim
    ]
    candidates += [(2**k, None) for k in range(12, -1, -1)]
    for multiple_of, multiplier in candidates:
        if ffn_hidden_dim(dim, multiple_of, multiplier) == intermediate:
            return multiple_of, multiplier
    # Any size is reachable with multiple_of=1; +0.5 keeps int() from rounding down.
    multiplier = (intermediate + 0.5) / int(2 * (4 * dim) / 3)
    assert ffn_hidden_dim(dim, 1, multiplier) == intermediate
    return 1, multiplier


def _read(config: dict[str, Any], source: str) -> dict[str, Any]:
    multiple_of, multiplier = _ffn_sizing(config["hidden_size"], config["intermediate_size"])
    return {"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier}


def _write(args: TransformerModelArgs) -> dict[str, Any]:
    return {"mlp_bias": False}


HF = DecoderHF(
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    name="Llama 3",
    hf_name="Llama",
    args_cls=TransformerModelArgs,
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 8192},
    read=_read,
    write=_write,
)
to_hf, from_hf = HF.to_hf, HF.from_hf
to_hf_config, from_hf_config = HF.to_hf_config, HF.from_hf_config
