"""The estimate as people read it: a header, the per-rank memory table and the FLOPs line
(``titan estimate``; COMM_MODE runs print it before their simulated step)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from titan_core.estimate import Estimate, fits

GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def _ac_label(est: Estimate) -> str:
    ac = est.layout.cfg.activation_checkpoint
    return ac.mode if ac.mode != "selective" else f"selective ({ac.selective_ac_option})"


def _header(est: Estimate) -> list[str]:
    d = est.to_dict()
    m, b, deg, dt = d["model"], d["batch"], d["degrees"], d["dtypes"]
    degrees = " × ".join(f"{k} {v}" for k, v in deg.items() if k != "ep")
    params = f"{m['num_params']:,} parameters"
    moe = d["moe"]
    if moe is not None:
        params += f" ({m['num_activated_params']:,} activated)"
    if m["num_mtp_params"]:
        params += (
            f" + multi-token prediction {m['num_mtp_params']:,} "
            f"({m['num_mtp_activated_params']:,} activated)"
        )
    lines = [
        f"{m['name']} {m['flavor']}: {params}, {m['n_layers']} layers, "
        f"vocab {m['vocab_size']:,} ({m['vocab_source']})",
        f"world {d['world_size']} = {degrees}"
        + (f"; ep {deg['ep']} (carved from dp_shard × cp)" if deg["ep"] > 1 else ""),
    ]
    if moe is not None:
        a2a = moe["all_to_all_bytes_per_layer"]
        lines.append(
            f"MoE: {moe['moe_layers']} layers × {moe['num_experts']} experts, top-{moe['top_k']}; "
            f"{moe['experts_per_rank']} experts per rank, FSDP-sharded over "
            f"{moe['expert_fsdp_degree']}; all-to-all per layer and microbatch "
            + (
                f"{a2a / 2**20:,.1f} MiB ({moe['routed_rows_per_layer']:,} rows, dispatch + "
                "combine, send + receive)"
                if a2a
                else "none (ep 1)"
            )
            + "; balanced routing assumed"
        )
    return [
        *lines,
        f"batch {b['local_batch_size']} × seq {b['seq_len']} × accum "
        f"{b['gradient_accumulation_steps']} (microbatch {b['microbatch_size']} × "
        f"{b['num_microbatches']}); params {dt['param']}, reduce {dt['reduce']}, "
        f"autocast {dt['autocast']}; AC {_ac_label(est)}",
    ]


def _table(est: Estimate) -> Table:
    mem = est.memory
    table = Table(title=f"Per-rank memory (pipeline rank {mem.pp_rank}, {mem.layers} layers)")
    table.add_column("term")
    table.add_column("GiB", justify="right")
    rows = [
        ("parameters (fp32 master, sharded)", mem.params),
        ("gradients (fp32)", mem.grads),
        ("optimizer state (AdamW exp_avg + exp_avg_sq)", mem.optimizer),
        ("buffers (RoPE table)", mem.buffers),
        ("FSDP all-gather / reduce-scatter buffers", mem.fsdp_buffers),
        (f"activations (AC {_ac_label(est)}, {mem.microbatches_in_flight} mb)", mem.activations),
        ("logits + loss (incl. cross-entropy grads)", mem.loss),
        ("backward transient (one block)", mem.backward_transient),
        ("optimizer-step temporaries", mem.optimizer_transient),
    ]
    if mem.all_to_all:
        rows.append(("expert-parallel all-to-all buffers (one layer)", mem.all_to_all))
    for name, value in rows:
        table.add_row(name, _gib(value))
    table.add_section()
    table.add_row("sum of all terms (upper bound)", _gib(mem.total))
    table.add_row(f"[bold]peak[/bold] (during {mem.peak_phase})", f"[bold]{_gib(mem.peak)}[/bold]")
    return table


def print_report(est: Estimate, device_bytes: int = 0) -> None:
    """Print the header, the per-rank memory table and FLOPs (and the fit verdict when
    ``device_bytes`` is given) to stdout."""
    console = Console(file=sys.stdout, width=max(100, Console().width))
    for line in _header(est):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(_table(est))
    f = est.flops
    console.print(
        f"FLOPs per step per rank: model {f.model_flops:.3e} + recompute {f.recompute_flops:.3e}"
        f" = {f.total_flops:.3e} ({f.flops_per_token:.3e} FLOPs/token × "
        f"{f.tokens_per_step:,} tokens per data-parallel rank)",
        highlight=False,
        soft_wrap=True,
    )
    if device_bytes:
        verdict = "fits" if fits(est.memory, device_bytes) else "does NOT fit"
        console.print(
            f"peak {_gib(est.memory.peak)} GiB {verdict} in {_gib(device_bytes)} GiB per device",
            highlight=False,
            soft_wrap=True,
        )
