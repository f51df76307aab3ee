"""Which rank is which: replicas x pipeline stages x tensor-parallel ranks, the stage layer ranges.

rank = replica * (pp * tp) + stage * tp + tp_rank, so a replica's ranks are consecutive (one NVLink island on a
GPU box) and a stage's tp ranks are neighbours. Pure Python: the server process imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from poc.errors import InputError


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        bad = [f"{k}={getattr(self, k)}" for k in ("world", "tp", "pp")
               if not (isinstance(getattr(self, k), int) and getattr(self, k) >= 1)]
        if bad:
            raise InputError(f"world size, tp and pp must be positive integers: {', '.join(bad)}", "tp")
        if self.world % (self.tp * self.pp):
            raise InputError(
                f"{self.world} devices cannot be split into groups of tp={self.tp} x pp={self.pp} = "
                f"{self.tp * self.pp} (world % (tp*pp) = {self.world % (self.tp * self.pp)})", "tp")

    @property
    def replicas(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def group_size(self) -> int:
        """Ranks per replica."""
        return self.tp * self.pp

    def rank(self, replica: int, stage: int, tp_rank: int) -> int:
        return replica * self.group_size + stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, stage, tp_rank) of a global rank."""
        replica, rest = divmod(rank, self.group_size)
        stage, tp_rank = divmod(rest, self.tp)
        return replica, stage, tp_rank

    def leader(self, replica: int) -> int:
        """The rank that takes a replica's jobs and broadcasts them: first stage, tp rank 0."""
        return self.rank(replica, 0, 0)

    def reporter(self, replica: int) -> int:
        """The rank that sends a replica's results: last stage, tp rank 0."""
        return self.rank(replica, self.pp - 1, 0)

    def replica_groups(self) -> list[list[int]]:
        return [list(range(r * self.group_size, (r + 1) * self.group_size)) for r in range(self.replicas)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(r, s, t) for t in range(self.tp)] for r in range(self.replicas) for s in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(r, s, t) for s in range(self.pp)] for r in range(self.replicas) for t in range(self.tp)]

    def check_model(self, n_heads: int, n_kv_heads: int, ffn_dim: int, n_layers: int,
                    what: str = "the model", n_experts: int = 0) -> None:
        """Refuse a model that does not split evenly, naming every number. ffn_dim: of the dense MLP layers (0 when
        there are none); n_experts: of the sparse MoE layers (0 when none), which tp splits by whole experts."""
        problems = [f"{name}={n} is not divisible by tp={self.tp}"
                    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_dim", ffn_dim),
                                    ("n_experts", n_experts))
                    if n % self.tp]
        if n_layers < self.pp:
            problems.append(f"n_layers={n_layers} is fewer than pp={self.pp} stages")
        if problems:
            raise InputError(f"{what} cannot be split over tp={self.tp} x pp={self.pp}: "
                             + "; ".join(problems), "tp")

    def check_config(self, cfg, what: str = "the model") -> None:
        """check_model for a ModelConfig: ffn_dim only if some layer is dense, n_experts only if some is sparse."""
        moe = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
        self.check_model(cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim if not all(moe) else 0, cfg.n_layers, what,
                         n_experts=cfg.n_experts if any(moe) else 0)


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Balanced consecutive layer ranges, one per stage; the last stages take one extra layer when uneven: the last
    stage runs its layers fastest (it sends nothing on, its post-processing is one position, and its GPU idles
    most, so the power cap slows it least). MiniMax-M2.7 as pp=4 on four H200, through the node's callback path:
    16/16/15/15 ran 0.461/0.461/0.412/0.390 s a batch (134.3 nonces/s), 15/15/16/16 0.421/0.420/0.454/0.415 (139.4;
    benchmarks/h200x4/serve_layouts_minimax_pp4_split.json, two calls in a row)."""
    if n_stages < 1 or n_layers < n_stages:
        raise InputError(f"n_layers={n_layers} cannot be split into {n_stages} pipeline stages", "pp")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s >= n_stages - extra)
        out.append(range(start, start + n))
        start += n
    return out
