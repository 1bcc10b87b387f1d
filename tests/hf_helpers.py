"""What the conversion and families' Hugging Face tests share: reading DCP model tensors and HF
folders, bitwise and relative comparisons, the convert CLI in-process, and the checks every
family's adapter goes through (refusals in one line, a trained export generating like the
engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from titan_core.checkpoint.dcp_io import dcp_reader
from titan_core.cli import convert as cli
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.resolve import parse_args
from titan_core.train import run


def convert_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run ``titan convert`` in-process; (exit code, stderr)."""
    capsys.readouterr()
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


def dcp_model(path: str | Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a DCP checkpoint (any sharding), read into this process."""
    md = dcp_reader(str(path)).read_metadata().state_dict_metadata
    state = {
        k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.items()
        if k.startswith("model.")
    }
    dcp.load({"model": state}, storage_reader=dcp_reader(str(path)), no_dist=True)
    return state


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder; with an index, checked against its weight map and size."""
    index_path = folder / "model.safetensors.index.json"
    if not index_path.exists():
        return load_file(folder / "model.safetensors")
    index = json.loads(index_path.read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(folder / file)
        assert all(index["weight_map"][k] == file for k in tensors)
        out.update(tensors)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in out.values())
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| for O(1) logits (so that the bound means something)."""
    assert ref.abs().max() > 0.1
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_hf_to_dcp_refuses(
    base: dict[str, Any],
    changes: dict[str, Any],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """hf-to-dcp of a folder whose ``config.json`` is ``base`` with ``changes`` (a key changed
    to None is left out): one ``error:`` line containing ``expected``, exit 2, nothing
    written."""
    (tmp_path / "hf").mkdir()
    merged = {**base, **changes}
    content = {k: v for k, v in merged.items() if v is not None or k not in changes}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(content))
    rc, err = convert_cli(
        ["hf-to-dcp", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "o")], capsys
    )
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and not (tmp_path / "o").exists()


def assert_export_generates_like_the_engine(
    tmp_path: Path, recipe: list[str], model_cls: type, flavor_args: Any, architecture: str
) -> None:
    """2 engine training steps of ``recipe`` -> dcp-to-hf (config found next to the checkpoint)
    -> AutoModelForCausalLM: an ``architecture``, same logits (1e-5), same greedy tokens."""
    import dataclasses

    import transformers

    dump = tmp_path / "run"
    argv = [*recipe, "--training.steps", "2", "--checkpoint.interval", "2"]
    run(parse_args([*argv, "--validation.no_enable", "--job.dump_folder", str(dump)]))
    step, out = dump / "checkpoint" / "step-2", tmp_path / "hf"
    export = ["dcp-to-hf", "--checkpoint", str(step), "--output", str(out), "--dtype", "fp32"]
    assert cli.main([*export, "--no-progress"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == architecture

    args = dataclasses.replace(flavor_args, vocab_size=hf.config.vocab_size, max_seq_len=2048)
    model = model_cls(args).eval()
    model.load_state_dict(dcp_model(step))
    tok = Tokenizer(str(default_tokenizer_path()))
    prompt = torch.tensor([tok.encode("The meaning of", bos=True, eos=False)])
    ids = prompt
    with torch.no_grad():
        assert rel_diff(model(prompt), hf(prompt).logits) <= 1e-5
        for _ in range(6):
            next_id = model(ids)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            ids = torch.cat([ids, next_id], dim=1)
        generated = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=None,
        )
    assert generated.tolist() == ids.tolist()


def export_hf_folder(model: torch.nn.Module, tokenizer: Tokenizer, out: Path) -> None:
    """A Hugging Face folder (fp32 weights, tokenizer files) for an engine Llama 3 model, as
    the converter produces it: what lm-eval and parity tests load with ``transformers``."""
    import transformers
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from titan_core.models import get_model_spec

    spec, args = get_model_spec("llama3"), model.model_args
    config = transformers.LlamaConfig(
        **spec.hf.to_hf_config(args), bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id
    )
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(spec.hf.to_hf(model.state_dict(), args))
    hf.save_pretrained(out)
    converted = TikTokenConverter(
        vocab_file=tokenizer.path,
        pattern=tokenizer.model._pat_str,
        extra_special_tokens=tokenizer.special_tokens,
    ).converted()
    # Encoding adds <|begin_of_text|>, as the converter's and Meta's Llama 3 tokenizers do.
    bos = ("<|begin_of_text|>", tokenizer.bos_id)
    converted.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos]),
        ]
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    ).save_pretrained(out)
