"""The CUDA paths of the engine, run on a real GPU: ``pytest -m gpu`` (``bench/gpu_check.sh``).

Every test here is skipped where CUDA is absent, so CI (CPU only) collects and skips them; they
are run on a lent GPU machine by ``bench/gpu_check.sh``. Each uses a small model, so the whole
file takes a few minutes on one H100, most of it compilation.
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest
import torch
from hf_helpers import dcp_model

from titan_core.resolve import parse_args
from titan_core.train import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel"]
TINY = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
BF16 = ["--training.autocast_dtype", "bfloat16"]


def _args(dump: Path, *extra: str, model: list[str] = DEBUG, steps: int = 8) -> list[str]:
    return [
        *model,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "4",
        "--training.seq_len",
        "512",
        "--metrics.log_freq",
        "1",
        "--validation.no_enable",
        "--job.no_save_config",
        *extra,
    ]


def _losses(history: list[dict[str, float]]) -> dict[int, float]:
    return {int(h["step"]): h["loss"] for h in history if "loss" in h}


def _ops_seen(fn) -> set[str]:
    """Names of the aten ops run by ``fn()`` (from the profiler's CPU-side op records)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.fixture(autouse=True)
def _fresh_cuda() -> None:
    """Each test starts with no cached blocks and no compiled graphs of an earlier test (their
    recompiles would count towards dynamo's limit)."""
    yield
    torch.cuda.synchronize()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> dict[int, float]:
    """10 steps of the debug model in bf16 autocast: the reference of the float8 test."""
    dump = tmp_path_factory.mktemp("bf16") / "run"
    return _losses(run(parse_args(_args(dump, *BF16, steps=10))))


FUSED = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention")


def test_bf16_training_on_a_flash_attention_kernel(tmp_path: Path, assets: Path) -> None:
    """SDPA runs a fused flash-attention kernel, forward and backward: cuDNN's where torch
    prefers it (torch 2.11 on an H100, as torchtitan also asks), else FlashAttention-2; never
    the math or memory-efficient fallbacks that a wrong dtype or layout would fall back to."""
    losses: dict[int, float] = {}
    ops = _ops_seen(lambda: losses.update(_losses(run(parse_args(_args(tmp_path, *BF16))))))
    attention_ops = sorted(o for o in ops if "attention" in o)
    fused = [kernel for kernel in FUSED if kernel in ops]
    assert len(fused) == 1, attention_ops
    assert f"{fused[0]}_backward" in ops, attention_ops
    for slower in ("efficient", "math"):
        assert not [o for o in attention_ops if slower in o], attention_ops
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[8] < losses[1] - 0.5, losses  # it learns


def test_attention_layout_runs_on_flash_attention_2() -> None:
    """The q/k/v layout the model hands SDPA is one the FlashAttention-2 kernel takes (where
    cuDNN is missing or refuses, SDPA would otherwise fall back to a slower kernel silently)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from titan_core.models.common.attention import Attention
    from titan_core.models.common.rope import precompute_freqs_cis

    torch.manual_seed(0)
    attention = Attention(dim=256, n_heads=16, n_kv_heads=4).cuda()
    attention.init_weights(0.02)
    x = torch.randn(2, 512, 256, device="cuda", requires_grad=True)
    freqs = precompute_freqs_cis(16, 512).cuda()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", torch.bfloat16):
        ops = _ops_seen(lambda: attention(x, freqs).float().square().sum().backward())
    assert "aten::_scaled_dot_product_flash_attention" in ops
    assert "aten::_scaled_dot_product_flash_attention_backward" in ops
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_compile_matches_eager(tmp_path: Path, assets: Path) -> None:
    eager = _losses(run(parse_args(_args(tmp_path / "eager", *BF16))))
    compiled = _losses(run(parse_args(_args(tmp_path / "compiled", *BF16, "--compile.enable"))))
    assert sorted(compiled) == sorted(eager)
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=2e-2), (step, eager, compiled)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_close_to_bf16(
    tmp_path: Path, bf16_losses: dict[int, float], recipe: str
) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability >= 8.9")
    argv = _args(tmp_path, *BF16, "--float8.recipe_name", recipe, "--compile.enable", steps=10)
    fp8 = _losses(run(parse_args(argv)))
    assert sorted(fp8) == sorted(bf16_losses)
    for step, loss in bf16_losses.items():
        assert fp8[step] == pytest.approx(loss, rel=5e-2), (step, bf16_losses, fp8)


def test_memory_snapshots_every_profile_freq_and_on_oom(tmp_path: Path, assets: Path) -> None:
    snap = ["--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"]
    snap += ["--profiling.profiler_warmup", "0"]
    run(parse_args(_args(tmp_path / "ok", *BF16, *snap, steps=4)))
    folder = tmp_path / "ok" / "memory_snapshot"
    written = sorted(p.name for p in folder.iterdir())
    assert written == ["iteration_2", "iteration_4"], written
    for it in written:
        with open(folder / it / "rank0_memory_snapshot.pickle", "rb") as f:
            snapshot = pickle.load(f)  # our own file, written by this test's run
        assert snapshot["segments"] and snapshot["device_traces"]

    # A forced OOM: cap this process at ~1% of the card, then ask for far more activations.
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.01)
    try:
        big = ["--training.local_batch_size", "64", "--training.seq_len", "2048"]
        with pytest.raises(torch.OutOfMemoryError):
            run(parse_args([*_args(tmp_path / "oom", *BF16, *snap, steps=2), *big]))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    exit_snapshot = tmp_path / "oom" / "memory_snapshot" / "iteration_1_exit"
    assert (exit_snapshot / "rank0_memory_snapshot.pickle").stat().st_size > 0


def test_async_pinned_checkpoint_resumes_bitwise(tmp_path: Path, assets: Path) -> None:
    common = ["--debug.deterministic", "--checkpoint.enable", "--checkpoint.interval", "4"]
    common += ["--checkpoint.keep_latest_k", "0", "--checkpoint.no_last_save_model_only"]
    reference = _losses(run(parse_args(_args(tmp_path / "ref", *BF16, *common, steps=12))))
    dump = tmp_path / "run"
    pinned = [*common, "--checkpoint.async_mode", "async_with_pinned_mem"]
    first = _losses(run(parse_args(_args(dump, *BF16, *pinned, steps=12))))
    assert first == reference  # deterministic: same seed, same losses, async save or not
    resumed = _losses(run(parse_args(_args(dump, *BF16, *pinned, "--checkpoint.load_step", "4",
                                           steps=12))))  # fmt: skip
    assert resumed == {s: reference[s] for s in range(5, 13)}


@pytest.mark.parametrize("tokens", [torch.bfloat16, torch.float32])
def test_grouped_gemm_experts_equal_the_loop(tokens: torch.dtype) -> None:
    """Under bf16 autocast with float32 master weights (one GPU, no FSDP), tokens in bf16 (from
    a bf16 layer) or float32 (the residual stream): the grouped GEMM path is taken and matches
    the per-expert loop, for uneven groups and empty experts."""
    from titan_core.models.common.moe import GroupedExperts, use_grouped_mm

    torch.manual_seed(0)
    experts = GroupedExperts(dim=256, hidden_dim=512, num_experts=8).cuda()
    experts.init_weights(0.02)
    counts = torch.tensor([0, 37, 5, 128, 1, 0, 64, 21], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=tokens)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert use_grouped_mm(x)
    results = []
    for grouped in (True, False):
        experts.grouped_mm = grouped
        experts.zero_grad()
        xg = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = experts(xg, counts)
        out.float().square().mean().backward()
        results.append((out.float(), xg.grad.float(), experts.w1.grad.float().clone()))
    (out_g, dx_g, dw_g), (out_l, dx_l, dw_l) = results
    for a, b in ((out_g, out_l), (dx_g, dx_l), (dw_g, dw_l)):
        scale = b.abs().max().item()
        assert scale > 0
        assert (a - b).abs().max().item() <= 2e-2 * scale  # bf16 rounding, not a wrong group


def test_flex_document_mask_equals_the_dense_mask() -> None:
    from titan_core.models.common.attention import ScaledDotProductAttention
    from titan_core.models.common.masking import document_block_mask, document_causal_mask

    torch.manual_seed(0)
    bs, heads, seq, hd = 2, 4, 512, 64
    lengths = [[100, 300, 112], [17, 256, 200, 39]]
    doc_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths]
    ).cuda()
    qkv = [torch.randn(bs, heads, seq, hd, device="cuda", requires_grad=True) for _ in range(3)]
    sdpa = ScaledDotProductAttention()
    outs, grads = [], []
    for mask in (document_block_mask(doc_ids), document_causal_mask(doc_ids)):
        for t in qkv:
            t.grad = None
        out = sdpa(*qkv, mask)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in qkv])
    assert type(document_block_mask(doc_ids)).__name__ == "BlockMask"
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-3)
    for flex_grad, dense_grad in zip(*grads):
        torch.testing.assert_close(flex_grad, dense_grad, atol=2e-2, rtol=2e-2)


def test_hf_export_of_a_gpu_checkpoint_loads_in_transformers(tmp_path: Path, assets: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from titan_core.build import build_model_args
    from titan_core.cli import convert as cli
    from titan_core.config.job import JobConfig
    from titan_core.config.toml import load_toml
    from titan_core.data import Tokenizer, default_tokenizer_path
    from titan_core.models.llama3.model import Transformer

    dump = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4", "--job.save_config"]
    run(parse_args([*_args(dump, *BF16, *ckpt, model=TINY, steps=4)]))
    step = dump / "checkpoint" / "step-4"
    out = tmp_path / "hf"
    argv = ["dcp-to-hf", "--checkpoint", str(step), "--output", str(out), "--dtype", "fp32"]
    assert cli.main([*argv, "--no-progress"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = Tokenizer(str(default_tokenizer_path()))
    args = build_model_args(load_toml(dump / "config.toml", JobConfig()), tok.n_words)
    ours = Transformer(args).eval()
    ours.load_state_dict(dcp_model(str(step)))
    tokens = torch.tensor([tok.encode("The GPU trained this model.", bos=True, eos=False)])
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


# ---------------------------------------------------------------- DeepSeek-V3 (MLA, MoE, MTP)
DSV3 = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"]
DSV3_GPU_FLAVOR = "gpu_check"


def dsv3_gpu_args() -> object:
    """A ~255M-parameter DeepSeek-V3 (~104M activated per token) for one GPU in seconds: MLA with
    query LoRA and decoupled RoPE heads, YaRN, a dense first layer, 16 experts in 4 groups of
    which 2 per token (group-limited routing), top-4, a shared expert, one MTP depth."""
    import dataclasses

    from titan_core.models.common.rope import YarnScaling
    from titan_core.models.deepseek_v3 import deepseek_v3_flavors

    base = deepseek_v3_flavors["debugmodel"]
    moe = dataclasses.replace(base.moe, num_experts=16, top_k=4, hidden_dim=512, num_groups=4,
                              top_groups=2)  # fmt: skip
    return dataclasses.replace(
        base,
        dim=1024,
        n_layers=8,
        n_heads=16,
        hidden_dim=2816,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=512),
        moe=moe,
    )


@pytest.fixture
def dsv3_gpu_flavor(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The recipe's argv with ``dsv3_gpu_args`` registered as a flavor for this test only."""
    from titan_core.models.deepseek_v3 import deepseek_v3_flavors

    monkeypatch.setitem(deepseek_v3_flavors, DSV3_GPU_FLAVOR, dsv3_gpu_args())
    return [*DSV3, "--model.flavor", DSV3_GPU_FLAVOR]


def test_deepseek_v3_bf16_training_learns(
    tmp_path: Path, assets: Path, dsv3_gpu_flavor: list[str]
) -> None:
    """10 bf16 steps of a small DeepSeek-V3 on CUDA (grouped GEMM experts, MLA through SDPA with
    its 96/64 q-k/v head sizes, the MTP depth, the loss-free balancing bias): finite losses and
    MTP losses, expert-load metrics for every MoE layer (the MTP block's included), and it
    learns."""
    extra = [*BF16, "--lr_scheduler.warmup_steps", "2", "--checkpoint.no_enable"]
    history = run(parse_args(_args(tmp_path, *extra, model=dsv3_gpu_flavor, steps=10)))
    losses = _losses(history)
    assert sorted(losses) == list(range(1, 11))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    mtp = [h["mtp/loss"] for h in history if "mtp/loss" in h]
    assert len(mtp) == 10 and all(torch.isfinite(torch.tensor(mtp))), mtp
    assert {f"moe/layer{i}/load_max" for i in range(1, 9)} <= set(history[-1]), history[-1]
    assert losses[10] < losses[1] - 0.5, losses  # it learns


def test_deepseek_v3_fp32_matches_cpu() -> None:
    """The tiny DeepSeek-V3 in float32 (TF32 off): CUDA's logits and gradients equal the CPU's
    to float32 rounding (the MLA RoPE layout, YaRN's table and group-limited routing take the
    same decisions on both devices)."""
    from titan_core.models.deepseek_v3 import DeepseekV3Model, deepseek_v3_flavors

    torch.manual_seed(0)
    cpu = DeepseekV3Model(deepseek_v3_flavors["debugmodel_tiny"])
    cpu.init_weights()
    gpu = DeepseekV3Model(deepseek_v3_flavors["debugmodel_tiny"])
    gpu.init_weights()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    tokens = torch.randint(0, deepseek_v3_flavors["debugmodel_tiny"].vocab_size, (2, 64))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        outs = []
        for model, device in ((cpu, "cpu"), (gpu, "cuda")):
            logits = model(tokens.to(device))
            logits.square().mean().backward()
            grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
            outs.append((logits.detach().cpu(), grads))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    (ref, ref_grads), (got, got_grads) = outs
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    assert sorted(got_grads) == sorted(ref_grads)
    for name, grad in ref_grads.items():
        scale = grad.abs().max().item()
        assert (got_grads[name] - grad).abs().max().item() <= 1e-3 * scale + 1e-8, name
