"""Llama 3 model: logits parity with transformers, meta init, sizes, conversion, registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_core.errors import ConfigError
from titan_core.models import get_flavor, get_model_spec
from titan_core.models.common import precompute_freqs_cis
from titan_core.models.llama3 import (
    Transformer,
    TransformerModelArgs,
    from_hf,
    llama3_flavors,
    to_hf,
    to_hf_config,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch_range  # all of it runs again on the oldest supported torch


def _build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    """Build on meta, materialize on CPU and initialize, as the trainer does."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _hf_twin(model: Transformer, args: TransformerModelArgs) -> torch.nn.Module:
    config = transformers.LlamaConfig(**to_hf_config(args), attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(to_hf(model.state_dict(), args), strict=False)
    # A tied lm_head is the embedding itself, so only it may be missing from the HF dict.
    assert missing == (["lm_head.weight"] if args.tie_word_embeddings else [])
    assert unexpected == []
    return hf


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_logits_match_transformers_llama(flavor: str) -> None:
    args = get_flavor("llama3", flavor)
    scaling = args.rope_scaling
    assert args.n_kv_heads < args.n_heads and scaling is not None  # GQA and scaled RoPE
    model = _build(args).eval()
    hf = _hf_twin(model, args)
    if args.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    torch.manual_seed(1)
    seq = 3 * scaling.original_max_position_embeddings  # well past the scaling's original length
    tokens = torch.randint(0, args.vocab_size, (2, seq))
    with torch.no_grad():
        ours = model(tokens)  # (bs, seq, vocab)
        ref = hf(tokens).logits  # (bs, seq, vocab)
    rel_err = ((ours - ref).abs().max() / ref.abs().max()).item()
    # Measured on CPU fp32, torch 2.13 / transformers 5.23: 7.5e-7 (debugmodel), 4.6e-7 (tied).
    # Dropping the q/k permutation or the RoPE scaling gives 1e-2 to 3e-2, far above the bound.
    assert rel_err <= 1e-5, rel_err
    assert ref.abs().max() > 0.5  # logits of O(1), so the relative bound is meaningful


def test_rope_scaling_matches_transformers_inv_freq() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = get_flavor("llama3", "debugmodel")
    config = transformers.LlamaConfig(**to_hf_config(args))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = precompute_freqs_cis(args.head_dim, 2, args.rope_theta, args.rope_scaling)[1].angle()
    unscaled = precompute_freqs_cis(args.head_dim, 2, args.rope_theta, None)[1].angle()
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, unscaled)  # the debug scaling really changes frequencies


def test_meta_init_is_finite_complete_and_deterministic() -> None:
    args = get_flavor("llama3", "debugmodel_tied")
    a, b = _build(args, seed=3), _build(args, seed=3)
    c = _build(args, seed=4)
    for p in a.parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all()
    assert a.output.weight is a.tok_embeddings.weight  # to_empty() untied it; init re-tied
    expected = precompute_freqs_cis(
        args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling
    )
    assert a.freqs_cis.shape == (args.max_seq_len, args.head_dim // 2)
    assert torch.equal(a.freqs_cis, expected)
    assert "freqs_cis" not in a.state_dict()  # non-persistent
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # Depth init: the residual projections of deeper layers start smaller.
    assert a.layers["5"].attention.wo.weight.std() < a.layers["0"].attention.wo.weight.std()


def test_pipeline_stage_pattern() -> None:
    args = get_flavor("llama3", "debugmodel_tiny")
    model = _build(args)
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        full = model(tokens)
        first = _build(args)
        first.norm, first.output = None, None
        del first.layers["1"]
        last = _build(args)
        last.tok_embeddings = None
        del last.layers["0"]
        staged = last(first(tokens))  # (bs, seq, vocab)
    assert torch.equal(staged, full)
    with pytest.raises(ValueError, match="RoPE table"):
        model(torch.zeros(1, args.max_seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize(
    ("flavor", "published"),
    [("1B", 1.24e9), ("3B", 3.21e9), ("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9)],
)
def test_published_parameter_counts(flavor: str, published: float) -> None:
    assert llama3_flavors[flavor].num_params() == pytest.approx(published, rel=5e-3)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied", "debugmodel_tiny"])
def test_num_params_matches_module(flavor: str) -> None:
    args = get_flavor("llama3", flavor)
    with torch.device("meta"):
        model = Transformer(args)
    nparams, flops = args.get_nparams_and_flops(model, seq_len=2048)
    assert nparams == args.num_params() == sum(p.numel() for p in model.parameters())
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 2048
    # The output projection does matmul work even when it shares the embedding's table.
    matmul_params = nparams - (0 if args.tie_word_embeddings else args.vocab_size * args.dim)
    assert flops == 6 * matmul_params + attention
    untied = dataclasses.replace(args, tie_word_embeddings=False)
    with torch.device("meta"):
        untied_flops = untied.get_nparams_and_flops(Transformer(untied), seq_len=2048)[1]
    assert flops == untied_flops  # tying changes storage, not compute


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_state_dict_adapter_round_trip_is_bitwise(flavor: str) -> None:
    args = get_flavor("llama3", flavor)
    native = _build(args).state_dict()
    hf = to_hf(native, args)
    assert ("lm_head.weight" in hf) == (not args.tie_word_embeddings)
    back = from_hf(hf, args)
    assert back.keys() == native.keys()
    assert all(torch.equal(back[k], native[k]) for k in native)
    # The permutation is not the identity, so the round trip above is not trivially true.
    wq = native["layers.0.attention.wq.weight"]
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], wq)


def test_registry_errors_name_the_key() -> None:
    assert get_model_spec("llama3").model_cls is Transformer
    families = r"\['deepseek_v3', 'llama3', 'qwen3', 'qwen3_moe'\]"
    unknown = rf"^model\.name: expected one of {families}, got 'gpt'"
    with pytest.raises(ConfigError, match=unknown):
        get_model_spec("gpt")
    flavor = r"^model\.flavor: expected one of \[.*'8B'.*\] for model\.name 'llama3', got 'x'"
    with pytest.raises(ConfigError, match=flavor):
        get_flavor("llama3", "x")
    args = get_flavor("llama3", "debugmodel")
    args.vocab_size = 7  # a private copy: the registry's flavor is untouched
    assert llama3_flavors["debugmodel"].vocab_size == 2048
