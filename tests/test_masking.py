"""Document masking: block-causal attention within the documents of a packed sample, RoPE
positions restarting per document, the flex (CUDA) mask agreeing with the dense (CPU) one, and
the configurations refused at build time."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parallel_harness import free_port
from prepared_helpers import write_docs
from torch.nn.attention.flex_attention import flex_attention

from titan_core.build import check_job
from titan_core.components.loss import cross_entropy_loss
from titan_core.config.job import Float8
from titan_core.data import Tokenizer, default_tokenizer_path
from titan_core.data.shards import tokenizer_info
from titan_core.errors import ConfigError
from titan_core.models import get_flavor
from titan_core.models.common import (
    document_block_mask,
    document_causal_mask,
    document_positions,
)
from titan_core.models.common.parallelize import decoder_tp_plan
from titan_core.models.llama3 import Transformer, TransformerModelArgs
from titan_core.resolve import parse_args
from titan_core.train import run

SEQ = 64


def _build(positions: bool = False) -> tuple[Transformer, TransformerModelArgs]:
    """The tiny debug model on CPU, initialized from a fixed seed (as tests/test_model.py)."""
    args = dataclasses.replace(
        get_flavor("llama3", "debugmodel_tiny"), document_positions=positions
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval(), args


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    """(1, sum(lengths)) int32 document numbers, as the prepared-data loader yields them."""
    ids = [i for i, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor([ids], dtype=torch.int32)


def test_positions_and_mask_helpers() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    expected = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]])
    assert torch.equal(document_positions(doc_ids), expected)
    mask = document_causal_mask(doc_ids)  # (bs, 1, seq, seq)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[1, 0, 5].tolist() == [False, True, True, True, True, True]
    assert torch.equal(mask[:, 0].diagonal(dim1=1, dim2=2), torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("positions", [False, True])
def test_documents_longer_than_seq_len_give_the_unmasked_loss(positions: bool) -> None:
    """A sample inside one document (doc_ids all 0): the block-causal mask is the causal mask
    and the positions are 0..seq-1, so masking changes nothing."""
    model, args = _build(positions)
    model.train()
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (4, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    doc_ids = torch.zeros(4, SEQ, dtype=torch.int32)
    unmasked = cross_entropy_loss(model(inputs), labels)
    grads = torch.autograd.grad(unmasked, list(model.parameters()))
    masked = cross_entropy_loss(model(inputs, doc_ids=doc_ids), labels)
    masked_grads = torch.autograd.grad(masked, list(model.parameters()))
    # Same values from two kernels (is_causal vs an explicit mask): measured bitwise equal on
    # CPU fp32; the bound leaves room for a kernel that sums in another order.
    torch.testing.assert_close(masked, unmasked, rtol=1e-6, atol=0)
    for got, ref in zip(masked_grads, grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_no_attention_across_a_document_boundary() -> None:
    """Changing document 0's tokens leaves document 1's logits untouched under masking only."""
    model, args = _build()
    lengths = [20, 24, 20]
    doc_ids = _doc_ids(lengths)
    torch.manual_seed(2)
    tokens = torch.randint(0, args.vocab_size, (1, SEQ))
    perturbed = tokens.clone()
    perturbed[0, : lengths[0]] = torch.randint(0, args.vocab_size, (lengths[0],))
    later = slice(lengths[0], SEQ)  # documents 1 and 2
    with torch.no_grad():
        masked = model(tokens, doc_ids=doc_ids)[0, later]
        masked_perturbed = model(perturbed, doc_ids=doc_ids)[0, later]
        unmasked = model(tokens)[0, later]
        unmasked_perturbed = model(perturbed)[0, later]
    torch.testing.assert_close(masked_perturbed, masked, rtol=0, atol=1e-6)
    assert (unmasked_perturbed - unmasked).abs().max() > 1e-2  # the test can see leaks


def _logits_and_rotated_q(
    model: Transformer, tokens: torch.Tensor, doc_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (bs, seq, vocab) and the first layer's rotated queries (bs, heads, seq, hd)."""
    seen = []
    hook = model.layers["0"].attention.sdpa.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0])
    )
    with torch.no_grad():
        logits = model(tokens, doc_ids=doc_ids)
    hook.remove()
    return logits, seen[0]


@pytest.mark.parametrize("offset", [1, 23])
def test_positions_restart_at_each_document(offset: int) -> None:
    """With document positions a document placed at ``offset`` is rotated as if it started the
    sample, and its logits equal those of the document alone.

    RoPE scores depend on relative positions only, so under the block mask the logits agree
    (to rounding) even without restarting; the rotated queries show which positions were used.
    """
    doc_len = SEQ - offset
    torch.manual_seed(3)
    doc = torch.randint(0, 2048, (1, doc_len))
    tokens = torch.cat([torch.randint(0, 2048, (1, offset)), doc], dim=1)  # (1, SEQ)
    doc_ids = _doc_ids([offset, doc_len])
    for positions in (True, False):
        model, _ = _build(positions)
        alone, q_alone = _logits_and_rotated_q(model, doc, None)  # positions 0..doc_len-1
        packed, q_packed = _logits_and_rotated_q(model, tokens, doc_ids)
        torch.testing.assert_close(packed[:, offset:], alone, rtol=0, atol=1e-5)
        if positions:
            torch.testing.assert_close(q_packed[:, :, offset:], q_alone, rtol=0, atol=1e-5)
        else:  # rotated by offset + i
            assert (q_packed[:, :, offset:] - q_alone).abs().max() > 0.1


def test_flex_block_mask_matches_the_dense_mask() -> None:
    """The CUDA path's BlockMask allows exactly the pairs of the CPU path's dense mask (flex
    attention runs forward-only and unfused on CPU, enough to compare)."""
    doc_ids = torch.cat([_doc_ids([50, 30, 48]), _doc_ids([128]), _doc_ids([1, 126, 1])])
    torch.manual_seed(4)
    q, k, v = torch.randn(3, 3, 2, 128, 16).unbind(0)  # (bs, heads, seq, head_dim) each
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_causal_mask(doc_ids)
    )
    with pytest.warns(UserWarning):  # the unfused-on-CPU notice
        flex = flex_attention(q, k, v, block_mask=document_block_mask(doc_ids))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


def _train(dump: Path, docs: list[list[int]], masking: bool) -> dict[str, dict[int, float]]:
    """Train the tiny model 3 steps on a prepared dataset of ``docs`` (validating each step on
    the same documents); returns {"loss": {step: loss}, "validation/loss": {...}}."""
    url = str(dump / "data")
    tokenizer = tokenizer_info(Tokenizer(str(default_tokenizer_path())))
    write_docs(url, [docs], [docs], tokenizer=tokenizer)
    args = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", "--dataloader.dataset", url]
    args += ["--job.dump_folder", str(dump / "run"), "--training.steps", "3"]
    args += ["--dataloader.no_shuffle", "--metrics.log_freq", "1", "--debug.deterministic"]
    args += ["--validation.enable", "--validation.freq", "1", "--validation.steps", "2"]
    if masking:
        args += ["--dataloader.document_masking", "--training.document_positions"]
    history = run(parse_args(args))
    keys = ("loss", "validation/loss")
    return {k: {int(row["step"]): row[k] for row in history if k in row} for k in keys}


def test_trainer_with_one_long_document_is_unchanged_by_masking(tmp_path: Path) -> None:
    """Through the trainer and validator: a dataset of one document longer than every sample
    gives the same training and validation losses with masking on."""
    torch.manual_seed(6)
    docs = [torch.randint(2, 2000, (2000,)).tolist()]
    plain = _train(tmp_path / "plain", docs, masking=False)
    masked = _train(tmp_path / "masked", docs, masking=True)
    for key, losses in plain.items():
        assert sorted(losses) == [1, 2, 3], key
        assert masked[key] == pytest.approx(losses, rel=1e-6, abs=0), key


def test_trainer_with_short_documents_masks_them(tmp_path: Path) -> None:
    """Short documents: masking reaches the model in training and validation (losses change)."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(5, 40, (80,), generator=gen).tolist()
    docs = [torch.randint(2, 2000, (n,), generator=gen).tolist() for n in lengths]
    plain = _train(tmp_path / "plain", docs, masking=False)
    masked = _train(tmp_path / "masked", docs, masking=True)
    for key, losses in plain.items():
        assert all(abs(masked[key][s] - loss) > 1e-4 for s, loss in losses.items()), key


def _tp_worker(rank: int, world: int, port: int) -> None:
    """Logits and grads of a masked packed batch under TP + SP (heads sharded, the mask shared
    by every head) against the same model unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(5)
        tokens = torch.randint(0, 2048, (2, SEQ + 1))
        doc_ids = torch.cat([_doc_ids([10, 30, 24]), _doc_ids([40, 24])])
        ref_model, _ = _build(positions=True)
        tp_model, _ = _build(positions=True)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(tp_model, mesh, decoder_tp_plan(tp_model, False, Float8()))
        assert isinstance(tp_model.layers["0"].attention.wq.weight, DTensor)
        results = []
        for model in (ref_model, tp_model):
            logits = model(tokens[:, :-1], doc_ids=doc_ids)  # (bs, seq, vocab), replicated
            cross_entropy_loss(logits, tokens[:, 1:]).backward()
            grad = model.layers["0"].attention.wq.weight.grad
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            results.append((logits.detach(), grad))
        (ref_logits, ref_grad), (tp_logits, tp_grad) = results
        torch.testing.assert_close(tp_logits, ref_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tp_grad, ref_grad, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_masking_under_tensor_parallel() -> None:
    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2)


@pytest.mark.parametrize(
    "flags",
    [
        ["--parallelism.pipeline_parallel_degree", "2"],
        ["--parallelism.context_parallel_degree", "2"],
    ],
)
def test_masking_with_pp_or_cp_is_refused(flags: list[str]) -> None:
    base = ["--module", "llama3", "--config", "llama3_debugmodel_tiny", *flags]
    check_job(parse_args(base), world_size=2)  # the layout itself is valid
    with pytest.raises(ConfigError, match=r"^dataloader\.document_masking: .*pipeline"):
        check_job(parse_args([*base, "--dataloader.document_masking"]), world_size=2)


def test_evaluation_masks_like_training() -> None:
    """``titan eval``'s metrics pass doc_ids on: the loss of masked batches is the masked
    forward's loss, and differs from scoring the same batches unmasked."""
    from titan_core.evaluate.evaluator import compute_metrics

    model, _ = _build()
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randint(2, 2000, (2, SEQ), generator=gen)
    labels = torch.randint(2, 2000, (2, SEQ), generator=gen)
    doc_ids = torch.cat([_doc_ids([20, 30, 14]), _doc_ids([5, 59])])
    byte_lengths = torch.ones(2304, dtype=torch.long)
    metrics = {
        name: compute_metrics(model, batches, byte_lengths, device=torch.device("cpu"))
        for name, batches in (
            ("masked", [(inputs, labels, doc_ids)]),
            ("plain", [(inputs, labels)]),
        )
    }
    with torch.no_grad():
        expected = cross_entropy_loss(model(inputs, doc_ids=doc_ids), labels).item()
    assert metrics["masked"].loss == pytest.approx(expected, rel=1e-6)
    assert abs(metrics["masked"].loss - metrics["plain"].loss) > 1e-4
