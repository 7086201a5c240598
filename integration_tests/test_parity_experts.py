"""An expert MLP end to end: a dense (TP) block, a router and E = 4 experts
(ColumnParallelLinear / RowParallelLinear with ``is_expert=True``), trained with mc's DDP,
``finalize_model_grads`` and SGD for 5 steps, against the same model trained by plain
PyTorch on one process over the same global batch.

The model, per token (``H = F = 8``)::

    h = x + fc2(gelu(fc1(ln1(x))))          dense Column/Row (TP; sequence-parallel at TP > 1)
    z = ln2(h);  p = softmax(router(z))     router: a replicated nn.Linear(H, E)
    out = h + p[e] · expert_e(z)            e = (token index in its micro-batch unit) mod E
    expert_e(z) = fc2_e(gelu(fc1_e(z)))     expert Column and Row layers, both with a bias

Routing is deterministic, and scaled by the router's softmax probability so the router gets
grads. Tokens move to the rank owning their expert and back through mc: the per-expert
counts by ``mg.all_to_all``, the tokens by ``mc_tp_layers.mappings.all_to_all`` (autograd: backward
is the reverse exchange) over the ``ep`` group. Under sequence parallelism each TP rank
routes its own sequence slice; the output is gathered over TP with
``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)`` and the loss
(mean over the unit's tokens, see ``_compositions.py``) is the same on every TP rank.

Localizes where each kind of grad is reduced: expert params (``allreduce=False``) must land
in DDP's expert buffer and be reduced over ``expt_dp`` (scaled by 1/|dp_cp| like the dense
ones: each expert's grad on a rank already holds the contributions of every token routed to
it), dense params in the dense buffer over ``dp_cp``, and the sequence-parallel params
(layer norms, router, the dense Row bias) summed over ``tp`` by finalize. Layouts:

- EP = 2 (ETP = TP = 1): world 2 (expt_dp of one rank) and world 4 (expt_dp of 2);
- EP = 1 with ETP ≠ TP (TP = 2, ETP = 1, sequence parallel): world 2 (dp_cp of one rank,
  expt_dp = both TP ranks) and world 4 (dp_cp of 2, expt_dp of 4). Here an expert weight
  tagged ``allreduce=True`` would sit in the dense buffer, reduced over dp_cp only, and miss
  the other TP rank's tokens (at 610d8f0, before the tag fix, both layouts fail: the expert
  params are in the dense buffer on dp_cp (0,) / (0, 2) instead of the expert buffer on
  expt_dp (0, 1) / (0, 1, 2, 3), and the TP ranks' step-0 grads of
  ``experts.0.fc1.weight`` differ by 1.1e-2);
- TP = 2 × EP = 2 (ETP = 1) on 4 ranks: the all-to-all inside each TP pair;
- EP = 2 × gtp_remat = 2 (expert_gtp_remat = 2) on 4 ranks: dense weights sharded over
  ``gtp_remat``, expert weights over ``expt_gtp_remat`` (another pair of ranks), the
  replicated grads of each kind averaged over its own axis by finalize; every rank sees
  different data (the data shard is the rank in ``dp_cp_gtp_remat``);
- EP = 2 and TP = 2 × ETP = 1 on 4 ranks with the distributed optimizer (each buffer
  reduce-scattered over its group; no step-0 grad check: only the shard is reduced);
- EP = 2 × CP = 2 on 4 ranks and TP = 2 × EP = 2 × CP = 2 on 8: the context-parallel ranks
  see different tokens (this model is per token, so CP splits data like DP), ``expt_dp``
  holds them (Megatron's expert layout folds CP into the expert data-parallel size) and the
  experts are scaled by 1/|dp_cp|, not 1/|dp| (scaling by |dp| fails exactly these two).

Step 2's collectives are recorded: the expert buffer reduced over expt_dp and the dense
one over dp_cp (each when the group has more than one rank; exactly the local elements of
the params of that kind), the all-to-alls over ``ep``, the SP sum over ``tp`` of exactly
the SP-tagged params, and nothing on any other group.

Tolerances as in ``test_parity_gtp.py`` (fp32, gloo): loss per step ≤ 1e-5 relative;
final weights ≤ 1e-6 absolute while every reference tensor moves ≥ 1e-4; step-0 grads ≤ 1e-5
of each tensor's largest magnitude; every copy of a weight on every rank bit-identical.
Measured (this machine, at 1c3d5af; ``pytest -s`` prints them): loss ≤ 1.1e-7 relative,
final weights ≤ 6e-8, step-0 grads ≤ 2.1e-7 of each tensor's largest magnitude, in every
layout.

Ambiguous points, read from Megatron-Core: the expert tag
``allreduce = not (is_expert and (ep > 1 or etp != tp))`` (``tensor_parallel/layers.py``,
``use_expert_pgs``); expert grads scaled by 1/|dp_cp| (``distributed/
distributed_data_parallel.py``, ``expert_gradient_scaling_factor``); the router's weight
tagged ``sequence_parallel`` (``transformer/moe/router.py``).

A deliberate difference from Megatron-Core, held here: the experts' Row bias. Megatron's
RowParallelLinear tags its bias ``sequence_parallel`` even for an expert (``layers.py``,
``setattr(self.bias, "sequence_parallel", self.sequence_parallel)``), so under SP with
TP = 2, ETP = 1 finalize sums over ``tp`` expert-bias grads that DDP already summed over
expt_dp: measured 2.0000× the reference for every ``experts.e.fc2.bias`` (the other expert
params exact) while mc copied that tag; mc's RowParallelLinear leaves expert biases
untagged, and ``experts.e.fc2.bias`` matches the reference like every other param.

Not tested, reported: expert_gtp_remat ≠ gtp_remat: mc's layers shard experts by
``config.gtp_remat_size`` (no expert size in the config), so gtp 2 / expert gtp 1 fails at
construction (ValueError: expt_gtp_remat has 1 rank), and gtp 1 / expert gtp 2 builds
unsharded experts that finalize averages over expt_gtp_remat: expert grads 0.5000× the
reference; by the same arithmetic Megatron-Core's 1/|dp_cp| expert scaling with a 1/egtp
reduce-scatter mean gives gtp/egtp, so only egtp = gtp is tested.
"""

from __future__ import annotations

import warnings
from functools import cache

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
from integration_tests._compositions import (
    UNITS,
    Layout,
    RankRun,
    Reduction,
    Reference,
    buffer_reduction,
    collection,
    compare,
    ddp_config,
    grad_reductions,
    load_weights,
    normalised,
    numel_by,
    reference_loss,
    reference_run,
    token_loss,
    tp_mlp,
    train,
)
from mc_ddp import DistributedDataParallel
from mc_groups.testing import RankPools
from mc_tp_layers.mappings import all_to_all, gather_from_sequence_parallel_region

H, FFN, E = 8, 8, 4
S, B = 8, 2  # a unit: 16 tokens, 4 per expert
SP_PARAMS = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "router.weight", "fc2.bias")


class Expert(torch.nn.Module):
    """``fc2(gelu(fc1(z)))`` on ``[tokens, H]`` with expert layers."""

    def __init__(self, config: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection) -> None:
        super().__init__()
        self.fc1, self.fc2 = tp_mlp(config, pgc, H, FFN, is_expert=True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(z)
        y, _ = self.fc2(F.gelu(hidden))
        return y  # type: ignore[no-any-return]


class MoEModel(torch.nn.Module):
    """The module docstring's model; this rank holds experts ``first … first + E/ep − 1``."""

    def __init__(self, config: mg.ModelParallelConfig, pgc: mg.ProcessGroupCollection) -> None:
        super().__init__()
        self.tp = pgc.require("tp", "MoEModel")
        self.ep = pgc.require("ep", "MoEModel")
        self.ln1 = torch.nn.LayerNorm(H)
        self.fc1, self.fc2 = tp_mlp(config, pgc, H, FFN)
        self.ln2 = torch.nn.LayerNorm(H)
        self.router = torch.nn.Linear(H, E, bias=False)
        for module in (self.ln1, self.ln2, self.router):
            for param in module.parameters():  # Megatron's LayerNorm and Router do this
                param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        self.local = E // mg.group_size(self.ep)
        self.first = mg.group_rank(self.ep) * self.local
        with warnings.catch_warnings():
            # the expert-TP group has one rank: "sequence parallelism is disabled for this layer"
            warnings.simplefilter("ignore", UserWarning)
            self.experts = torch.nn.ModuleList(Expert(config, pgc) for _ in range(self.local))

    def global_name(self, name: str) -> str:
        """``experts.<local>.…`` → ``experts.<global expert index>.…``."""
        if not name.startswith("experts."):
            return name
        _, local, rest = name.split(".", 2)
        return f"experts.{self.first + int(local)}.{rest}"

    def forward(self, x: torch.Tensor, first_token: int) -> torch.Tensor:
        """``x``: this rank's ``[s, B, H]`` (its sequence slice under SP); token ``j`` of the
        slice is token ``first_token + j`` of the unit (row-major over ``[S, B]``)."""
        hidden, _ = self.fc1(self.ln1(x))
        mlp, _ = self.fc2(F.gelu(hidden))
        h = x + mlp
        z = self.ln2(h).reshape(-1, H)
        probs = torch.softmax(self.router(z), dim=-1)
        expert = (first_token + torch.arange(z.shape[0])) % E
        gate = probs.gather(1, expert[:, None])
        out: torch.Tensor = h + (gate * self._dispatch(z, expert)).view_as(h)
        return out

    def _dispatch(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each token through its expert on the rank that owns it (all-to-all over ep)."""
        size, local = mg.group_size(self.ep), self.local
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=E)  # tokens per global expert
        received = torch.empty_like(counts)  # [source rank, my local expert]
        mg.all_to_all(received, counts, self.ep, label="moe token counts")
        send = counts.view(size, local).sum(1).tolist()
        recv = received.view(size, local).sum(1).tolist()
        arrived = all_to_all(self.ep, tokens[order], recv, send)
        pieces = list(torch.split(arrived, received.tolist()))  # source-major, then local expert
        for k in range(local):
            slots = [src * local + k for src in range(size)]
            out = self.experts[k](torch.cat([pieces[i] for i in slots]))
            parts = torch.split(out, [len(pieces[i]) for i in slots])
            for i, part in zip(slots, parts, strict=True):
                pieces[i] = part
        back = all_to_all(self.ep, torch.cat(pieces), send, recv)
        return back[torch.argsort(order)]


@cache
def initial() -> dict[str, torch.Tensor]:
    """The full initial weights (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(21)
    weights = {
        "ln1.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "ln1.bias": 0.1 * torch.randn(H, generator=g),
        "fc1.weight": 0.4 * torch.randn(FFN, H, generator=g),
        "fc1.bias": 0.1 * torch.randn(FFN, generator=g),
        "fc2.weight": 0.3 * torch.randn(H, FFN, generator=g),
        "fc2.bias": 0.1 * torch.randn(H, generator=g),
        "ln2.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "ln2.bias": 0.1 * torch.randn(H, generator=g),
        "router.weight": 0.5 * torch.randn(E, H, generator=g),
    }
    for e in range(E):
        weights[f"experts.{e}.fc1.weight"] = 0.4 * torch.randn(FFN, H, generator=g)
        weights[f"experts.{e}.fc1.bias"] = 0.1 * torch.randn(FFN, generator=g)
        weights[f"experts.{e}.fc2.weight"] = 0.3 * torch.randn(H, FFN, generator=g)
        weights[f"experts.{e}.fc2.bias"] = 0.1 * torch.randn(H, generator=g)
    return weights


@cache
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: inputs and targets ``[UNITS, S, B, H]``."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(UNITS, S, B, H, generator=g), torch.randn(UNITS, S, B, H, generator=g)


def _reference_forward(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[S, B, H]`` (one unit) → out ``[S, B, H]``."""
    hidden = F.linear(F.layer_norm(x, (H,), w["ln1.weight"], w["ln1.bias"]), w["fc1.weight"])
    h = x + F.linear(F.gelu(hidden + w["fc1.bias"]), w["fc2.weight"], w["fc2.bias"])
    z = F.layer_norm(h, (H,), w["ln2.weight"], w["ln2.bias"]).reshape(-1, H)
    probs = torch.softmax(F.linear(z, w["router.weight"]), dim=-1)
    expert = torch.arange(z.shape[0]) % E
    y = torch.zeros_like(z)
    for e in range(E):
        rows = expert == e
        inner = F.linear(z[rows], w[f"experts.{e}.fc1.weight"], w[f"experts.{e}.fc1.bias"])
        outer = F.linear(F.gelu(inner), w[f"experts.{e}.fc2.weight"], w[f"experts.{e}.fc2.bias"])
        y = y.index_put((rows,), outer)
    return h + (probs.gather(1, expert[:, None]) * y).view_as(h)


def reference_loss_of(w: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """The 1-process loss of step ``step``'s whole global batch (mean over every token)."""
    x, target = batch(step)
    per_token = torch.stack(
        [token_loss(_reference_forward(w, x[u]), target[u]) for u in range(UNITS)]
    )
    return reference_loss(per_token, torch.ones_like(per_token), per_token_loss=False)


@cache
def reference() -> Reference:
    """One process, the whole global batch of each step (mean over every token)."""
    return reference_run(dict(initial()), reference_loss_of)


def train_experts(layout: Layout) -> RankRun:
    """Runs on every rank: the layout's groups, the model loaded with ``initial()``, DDP,
    5 steps."""
    with collection(layout) as pgc:
        config = layout.config(sequence_parallel=layout.tp > 1)
        module = MoEModel(config, pgc)
        full = initial()
        load_weights(module, {n: full[module.global_name(n)] for n, _ in module.named_parameters()})
        ddp = DistributedDataParallel(config, ddp_config(layout), module, pg_collection=pgc)
        data = pgc.require("dp_cp_gtp_remat", "test")  # ranks that see different data
        shard, shards = mg.group_rank(data), mg.group_size(data)
        tp_rank, rows = mg.group_rank(module.tp), S // layout.tp

        def micro_loss(step: int, m: int, count: int) -> tuple[torch.Tensor, int]:
            x, target = batch(step)
            unit = shard * count + m
            mine = x[unit, tp_rank * rows : (tp_rank + 1) * rows]
            out = ddp(mine, first_token=tp_rank * rows * B)
            full_out = gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False, group=module.tp
            )
            per_token = token_loss(full_out, target[unit])
            return normalised(per_token, torch.ones_like(per_token), count, layout)

        return train(
            ddp,
            pgc,
            layout,
            micro_loss,
            UNITS // shards,
            rename=module.global_name,
            group_names=("ep", "expt_dp", "expt_tp", "gtp_remat", "expt_gtp_remat"),
        )


def _check_groups(layout: Layout, per_rank: list[RankRun]) -> None:
    """Which buffer each param is in, and which collectives reduced which grads."""
    for rank, run in enumerate(per_rank):
        g = run.groups
        where = f"{layout.describe()} rank {rank}"
        assert len(g["ep"]) == layout.ep, (where, g)
        assert len(g["expt_tp"]) == 1, (where, g)
        expert = {n for n in run.placement if n.startswith("experts.")}
        assert len(expert) == 4 * E // layout.ep, (where, sorted(expert))
        for name, (kind, ranks) in run.placement.items():
            want = ("expert", g["expt_dp"]) if name in expert else ("dense", g["dp_cp"])
            assert (kind, ranks) == want, (where, name, kind, ranks, "wanted", want)
        found = grad_reductions(run.records)
        required: set[Reduction] = set()
        sizes = {
            "expert": sum(run.local_numel[n] for n in expert),
            "dense": sum(v for n, v in run.local_numel.items() if n not in expert),
        }
        for kind, group in (("expert", g["expt_dp"]), ("dense", g["dp_cp"])):
            if len(group) > 1:
                required.add(buffer_reduction(run, layout, kind, group, sizes[kind], where))
        if layout.ep > 1:
            required.add(("all_to_all", None, g["ep"], "moe token counts"))
            required.add(("all_to_all", None, g["ep"], "tp all-to-all"))
        if layout.tp > 1:
            required.add(("all_reduce", "sum", g["tp"], "non-tensor-parallel grads"))
            sp = numel_by(run.records, "all_reduce", "non-tensor-parallel grads")
            assert sp == sum(run.local_numel[n] for n in SP_PARAMS), (where, sp)
        if layout.gtp > 1:
            required |= _gtp_collectives(run, expert, where)
        extra = {r for r in found - required if not (r[2] == g["tp"] and r[3].startswith("tp "))}
        assert required <= found, (where, "missing", required - found)
        assert not extra, (where, "unexpected", extra)


def _gtp_collectives(run: RankRun, expert: set[str], where: str) -> set[Reduction]:
    """Under gtp_remat: dense weights all-gathered and their wgrads reduce-scattered over
    ``gtp_remat``, expert weights over ``expt_gtp_remat``; the replicated params' grads
    averaged over the same groups (exactly the replicated elements of each kind)."""
    required: set[Reduction] = set()
    for kind, group in (
        ("dense", run.groups["gtp_remat"]),
        ("expert", run.groups["expt_gtp_remat"]),
    ):
        assert len(group) == 2, (where, kind, group)
        required |= {
            ("reduce_scatter", "sum", group, "gtp_remat wgrad reduce-scatter"),
            ("all_gather", None, group, "gtp_remat weight all-gather"),
            ("all_reduce", "avg", group, "replicated grads over gtp_remat"),
        }
        replicated = [
            n
            for n in run.local_numel
            if (n in expert) == (kind == "expert") and not n.endswith(("fc1.weight", "fc2.weight"))
        ]
        sent = numel_by(run.records, "all_reduce", "replicated grads", group)
        assert sent == sum(run.local_numel[n] for n in replicated), (where, kind, sent, replicated)
    return required


LAYOUTS = [
    Layout(2, ep=2),
    Layout(4, ep=2),
    Layout(2, tp=2, etp=1),
    Layout(4, tp=2, etp=1),
    Layout(4, tp=2, etp=1, ep=2),
    Layout(4, ep=2, gtp=2, egtp=2),
    Layout(4, ep=2, dist_opt=True),
    Layout(4, tp=2, etp=1, dist_opt=True),
    Layout(4, ep=2, cp=2),
    Layout(8, tp=2, etp=1, ep=2, cp=2),
]


@pytest.mark.parametrize(
    "layout", [pytest.param(x, id=x.describe().replace(" ", "-")) for x in LAYOUTS]
)
def test_expert_mlp_matches_one_process(rank_pools: RankPools, layout: Layout) -> None:
    per_rank = rank_pools.get(layout.world).run(train_experts, layout)
    _check_groups(layout, per_rank)
    compare(layout, per_rank, reference())
