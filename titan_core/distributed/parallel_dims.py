"""Parallel degrees, their validation, and the named device mesh built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_core.config.job import Parallelism
from titan_core.errors import ConfigError


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension for one world; ``dp_shard=-1`` takes the rest."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    """Expert parallel degree: carved from the dp_shard x cp ranks (see ``ep_enabled``)."""
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"parallelism: {name} degree must be >= 1, got {getattr(self, name)}"
                )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"parallelism: world size {self.world_size} is not divisible by "
                    f"dp_replicate*cp*tp*pp = {others}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree: expected -1 or >= 1, got {self.dp_shard}"
            )
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"parallelism: dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * "
                f"cp({self.cp}) * tp({self.tp}) * pp({self.pp}) = {others * self.dp_shard} "
                f"!= world size {self.world_size}"
            )
        self._check_ep()

    def _check_ep(self) -> None:
        """Expert parallelism borrows every context-parallel rank and part of the FSDP ranks
        (torchtitan's rule with experts tensor-parallel like the dense layers): ``ep`` must be
        a multiple of ``cp`` and divide ``dp_shard * cp``."""
        key = "parallelism.expert_parallel_degree"
        if self.ep < 1:
            raise ConfigError(f"{key}: expected an int >= 1, got {self.ep}")
        if self.ep == 1:
            return
        if self.ep % self.cp:
            raise ConfigError(
                f"{key}: {self.ep} must be a multiple of context_parallel_degree ({self.cp}): "
                "expert parallelism takes every context-parallel rank"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"{key}: {self.ep} must divide data_parallel_shard_degree x "
                f"context_parallel_degree = {self.dp_shard} x {self.cp} = "
                f"{self.dp_shard * self.cp}, the ranks expert parallelism is carved from"
            )

    @classmethod
    def from_config(cls, parallelism: Parallelism, world_size: int) -> ParallelDims:
        """Build from the ``parallelism`` config section for a given world size."""
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            world_size=world_size,
            ep=parallelism.expert_parallel_degree,
        )

    def validate_model(self, n_heads: int, n_kv_heads: int, n_layers: int) -> None:
        """Check that the model's shapes can be split by these degrees."""
        if n_heads % self.tp or n_kv_heads % self.tp:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree: {self.tp} must divide n_heads ({n_heads}) "
                f"and n_kv_heads ({n_kv_heads})"
            )
        if self.pp > n_layers:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree: {self.pp} exceeds the number of layers "
                f"({n_layers})"
            )

    def validate_experts(self, num_experts: int) -> None:
        """Check that ``ep`` splits the routed experts evenly."""
        if num_experts % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree: {self.ep} must divide the number of "
                f"experts ({num_experts})"
            )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh with named dims (pp, dp_replicate, dp_shard, cp, tp) and the
        flattened views the loss and FSDP use (dp, dp_shard_cp, dp_cp)."""
        if self.ep_enabled:
            return self._build_ep_mesh(device_type)
        names, degrees = [], []
        for name, degree in (
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ):
            if degree > 1:
                names.append(name)
                degrees.append(degree)
        if not names:  # A world of one still gets a mesh so code paths stay uniform.
            names, degrees = ["dp_shard"], [1]
        mesh = init_device_mesh(device_type, tuple(degrees), mesh_dim_names=tuple(names))
        dp_names = [n for n in ("dp_replicate", "dp_shard") if n in names]
        if len(dp_names) > 1:
            mesh[tuple(dp_names)]._flatten(mesh_dim_name="dp")
        shard_cp = [n for n in ("dp_shard", "cp") if n in names]
        if len(shard_cp) > 1:
            mesh[tuple(shard_cp)]._flatten(mesh_dim_name="dp_shard_cp")
        dp_cp = [n for n in ("dp_replicate", "dp_shard", "cp") if n in names]
        if len(dp_cp) > 1:
            mesh[tuple(dp_cp)]._flatten(mesh_dim_name="dp_cp")
        self._mesh = mesh
        return mesh

    def _build_ep_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh with dp_shard split in two, (dp_shard_mod_ep, dp_shard_in_ep): experts are
        spread over ``ep`` = (dp_shard_in_ep, cp) and FSDP-sharded over dp_shard_mod_ep (kept
        even at size 1, the experts' FSDP mesh). The dense layers see the same flattened views
        (dp_shard, dp, dp_shard_cp, dp_cp) as without expert parallelism."""
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard_mod_ep", self.dp_shard_mod_ep),
            ("dp_shard_in_ep", self.dp_shard_in_ep),
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        kept = [(n, d) for n, d in dims if d > 1 or n == "dp_shard_mod_ep"]
        names = tuple(n for n, _ in kept)
        mesh = init_device_mesh(device_type, tuple(d for _, d in kept), mesh_dim_names=names)

        def flatten(parts: tuple[str, ...], name: str) -> None:
            present = tuple(p for p in parts if p in names)
            if present:
                mesh[present]._flatten(mesh_dim_name=name)

        flatten(("dp_shard_mod_ep", "dp_shard_in_ep"), "dp_shard")
        flatten(("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"), "dp")
        flatten(("dp_shard_mod_ep", "dp_shard_in_ep", "cp"), "dp_shard_cp")
        flatten(("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"), "dp_cp")
        flatten(("dp_shard_in_ep", "cp"), "ep")
        self._mesh = mesh
        return mesh

    @property
    def ep_enabled(self) -> bool:
        """Whether routed experts are spread over ranks (expert parallelism)."""
        return self.ep > 1

    @property
    def dp_shard_in_ep(self) -> int:
        """FSDP ranks that expert parallelism takes (it takes every CP rank too)."""
        return self.ep // self.cp if self.ep_enabled else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP ranks left to shard each expert's weights over (its FSDP degree)."""
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def ep_mesh(self) -> DeviceMesh:
        """1-D mesh over the ranks one layer's experts are spread over."""
        assert self.ep_enabled, "expert parallelism is off"
        return self.mesh["ep"]

    @property
    def expert_fsdp_mesh_dims(self) -> tuple[str, ...]:
        """Mesh dims the routed experts are FSDP-sharded (HSDP: replicated) over."""
        return (("dp_replicate",) if self.dp_replicate > 1 else ()) + ("dp_shard_mod_ep",)

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh built by ``build_mesh``."""
        assert self._mesh is not None, "build_mesh() has not been called"
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """1-D mesh over the ranks that see different data (flattened replicate x shard)."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return self.mesh["dp"]
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate"]
        # dp_shard is a mesh dim when > 1, in a world of one, and (flattened) under EP.
        if self.dp_shard > 1 or self.world_size == 1 or self.ep_enabled:
            return self.mesh["dp_shard"]
        raise AssertionError("the mesh has no data-parallel dimension")

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """1-D mesh over the ranks whose losses average to the global one: data parallel and
        context parallel (each CP rank holds an equal share of every sequence's tokens)."""
        if self.cp == 1:
            return self.dp_mesh
        return self.mesh["dp_cp" if self.dp_degree > 1 else "cp"]

    @property
    def dp_enabled(self) -> bool:
        """Whether any data parallelism (replicate or shard) is on."""
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters are sharded (FSDP, or the shard dim of HSDP, incl. CP)."""
        return self.dp_shard * self.cp > 1

    @property
    def fsdp_mesh_dims(self) -> tuple[str, ...]:
        """Mesh dims FSDP shards over: dp_shard and cp (flattened when both are on; CP ranks
        hold different tokens, so they split parameters too), behind dp_replicate for HSDP."""
        shard = [name for name in ("dp_shard", "cp") if getattr(self, name) > 1] or ["dp_shard"]
        names = ("dp_shard_cp",) if len(shard) == 2 else tuple(shard)
        return (("dp_replicate",) if self.dp_replicate > 1 else ()) + names

    @property
    def tp_enabled(self) -> bool:
        """Whether tensor (and sequence) parallelism is on."""
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        """Whether context parallelism is on."""
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        """Whether pipeline parallelism is on."""
        return self.pp > 1

    def loss_parallel_enabled(self, parallelism: Parallelism) -> bool:
        """Whether the loss runs on vocab-sharded logits (TP on, loss parallel not disabled)."""
        return self.tp > 1 and not parallelism.disable_loss_parallel

    @property
    def dp_degree(self) -> int:
        """Number of distinct data streams (ranks that see different samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one data stream (cp * tp * pp)."""
        return self.cp * self.tp * self.pp

    def dp_rank(self, global_rank: int) -> int:
        """This rank's index among the data streams (row-major mesh order pp, dp, cp, tp)."""
        return (global_rank // (self.cp * self.tp)) % self.dp_degree
