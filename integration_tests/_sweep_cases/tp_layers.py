"""mc-tp-layers: the Column/Row/VocabParallel layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from integration_tests._sweep_cases.base import (
    HUGE,
    Ctx,
    Opaque,
    T,
    arg,
    column,
    embedding,
    mg,
    misuse,
    row,
    tp_config,
    tpl,
)


def _logits() -> torch.Tensor:
    return torch.zeros(3, 8, requires_grad=True)


class _NS:
    """A config whose ``params_dtype`` is the bad value (everything else valid)."""

    sequence_parallel = False
    use_cpu_initialization = True
    perform_initialization = True
    gradient_accumulation_fusion = False
    defer_embedding_wgrad_compute = False
    wgrad_deferral_limit = 0
    expert_model_parallel_size = 1
    tensor_model_parallel_size = 1
    expert_tensor_parallel_size = None
    gtp_remat_size = 1
    calculate_per_token_loss = False

    def __init__(self, params_dtype: object) -> None:
        self.params_dtype = params_dtype


_COLUMN_FLAGS = (
    "bias",
    "gather_output",
    "keep_master_weight_for_test",
    "skip_bias_add",
    "skip_weight_param_allocation",
    "is_expert",
    "disable_grad_reduce",
)
_ROW_FLAGS = (
    "bias",
    "input_is_parallel",
    "skip_bias_add",
    "keep_master_weight_for_test",
    "is_expert",
)


def _layer_slots() -> None:
    for name in _COLUMN_FLAGS:
        arg(T, f"ColumnParallelLinear({name}=)", "flag", lambda c, v, n=name: column(c, **{n: v}))
    for name in _ROW_FLAGS:
        good = name == "input_is_parallel"
        arg(
            T,
            f"RowParallelLinear({name}=)",
            "flag",
            lambda c, v, n=name: row(c, **{n: v}),
            good=good,
        )
    for factory, layer in ((column, "ColumnParallelLinear"), (row, "RowParallelLinear")):
        f: Any = factory
        for name in ("input_size", "output_size", "stride"):
            arg(
                T,
                f"{layer}({name}=)",
                "size",
                lambda c, v, n=name, f=f: f(c, **{n: v}),
                values=(HUGE,) if name != "stride" else (),
            )
        arg(
            T,
            f"{layer}(config=)",
            "misuse",
            lambda c, v, f=f: f(c, config=v),
            ("config",),
            values=(None, "x", Opaque()),
            only=True,
            good=tp_config(),
        )
        arg(
            T,
            f"{layer}(init_method=)",
            "misuse",
            lambda c, v, f=f: f(c, init_method=v),
            ("init_method",),
            values=(None, "xavier", 3),
            only=True,
            good=nn.init.zeros_,
        )
        arg(T, f"{layer}(tp_group=)", "opt_group", lambda c, v, f=f: f(c, tp_group=v))
        arg(
            T,
            f"{layer}(pg_collection=)",
            "collection",
            lambda c, v, f=f: f(c, pg_collection=v),
            ("pg_collection",),
        )
        arg(
            T,
            f"{layer}(rng_tracker=)",
            "misuse",
            lambda c, v, f=f: f(c, rng_tracker=v),
            ("rng_tracker",),
            values=("x", 3),
            only=True,
            good=None,
        )
        arg(T, f"{layer}(device=)", "device", lambda c, v, f=f: f(c, device=v))
        arg(T, f"{layer}(name=)", "opt_text", lambda c, v, f=f: f(c, name=v))
        arg(
            T,
            f"{layer}(tp_comm_buffer_name=)",
            "opt_text",
            lambda c, v, f=f: f(c, tp_comm_buffer_name=v),
        )
        arg(
            T,
            f"{layer}(config.params_dtype=)",
            "misuse",
            lambda c, v, f=f: f(c, config=_NS(v)),
            ("params_dtype",),
            values=(torch.int64, "float32"),
            only=True,
            good=torch.float32,
        )
    arg(
        T,
        "ColumnParallelLinear(output_dtype=)",
        "opt_dtype",
        lambda c, v: column(c, output_dtype=v),
    )
    arg(
        T,
        "ColumnParallelLinear(embedding_activation_buffer=)",
        "misuse",
        lambda c, v: column(c, embedding_activation_buffer=v),
        ("embedding_activation_buffer",),
        values=("x", 3),
        only=True,
        good=None,
    )
    arg(
        T,
        "ColumnParallelLinear(grad_output_buffer=)",
        "misuse",
        lambda c, v: column(c, grad_output_buffer=v),
        ("grad_output_buffer",),
        values=("x", 3),
        only=True,
        good=None,
    )
    for name in ("num_embeddings", "embedding_dim"):
        arg(
            T,
            f"VocabParallelEmbedding({name}=)",
            "size",
            lambda c, v, n=name: embedding(c, **{n: v}),
            values=(HUGE,),
        )
    arg(
        T,
        "VocabParallelEmbedding(reduce_scatter_embeddings=)",
        "flag",
        lambda c, v: embedding(c, reduce_scatter_embeddings=v),
    )
    arg(
        T,
        "VocabParallelEmbedding(init_method=)",
        "misuse",
        lambda c, v: embedding(c, init_method=v),
        ("init_method",),
        values=(None, "x"),
        only=True,
        good=nn.init.zeros_,
    )
    arg(T, "VocabParallelEmbedding(tp_group=)", "opt_group", lambda c, v: embedding(c, tp_group=v))
    arg(T, "VocabParallelEmbedding(device=)", "device", lambda c, v: embedding(c, device=v))
    # forward calls
    arg(
        T,
        "ColumnParallelLinear.forward(input_=)",
        "tensor",
        lambda c, v: column(c)(v),
        ("input",),
        values=(torch.ones(2, 5), torch.ones(4), torch.ones(2, 4, dtype=torch.int64)),
        good=torch.ones(2, 4),
    )
    arg(
        T,
        "ColumnParallelLinear.forward(weight=)",
        "misuse",
        lambda c, v: column(c, skip_weight_param_allocation=True)(torch.ones(2, 4), weight=v),
        ("weight",),
        values=(None, "x", torch.ones(6, 5)),
        only=True,
        good=torch.ones(6, 4),
    )
    arg(
        T,
        "RowParallelLinear.forward(input_=)",
        "tensor",
        lambda c, v: row(c)(v),
        ("input",),
        values=(torch.ones(2, 5), torch.ones(6), torch.ones(2, 6, dtype=torch.int64)),
        good=torch.ones(2, 6),
    )
    ids = torch.tensor
    arg(
        T,
        "VocabParallelEmbedding.forward(input_=)",
        "misuse",
        lambda c, v: embedding(c)(v),
        ("input", "ids", "num_embeddings", "vocab"),
        values=(None, ids([8]), ids([-1]), ids([100]), ids([1.0]), [1]),
        only=True,
        good=ids([1]),
    )
    ce = tpl.vocab_parallel_cross_entropy
    logits = _logits
    arg(
        T,
        "vocab_parallel_cross_entropy(vocab_parallel_logits=)",
        "tensor",
        lambda c, v: ce(v, ids([0, 1, 2]), tp_group=c.world_group),
        ("logits",),
        values=(torch.zeros(3, 8, dtype=torch.int64), torch.zeros(2, 8)),
        good=torch.zeros(3, 8),
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(target=)",
        "tensor",
        lambda c, v: ce(logits(), v, tp_group=c.world_group),
        ("target",),
        values=(ids([0, 1, 8]), ids([0, 1, -1]), ids([0, 1, -100]), ids([0.0, 1.0, 2.0]), ids([0])),
        good=ids([0, 1, 2]),
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(label_smoothing=)",
        "real",
        lambda c, v: ce(logits(), ids([0, 1, 2]), v, tp_group=c.world_group),
        ("label_smoothing",),
        values=(-0.1, 1.0),
        good=0.1,
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(vocab_size=)",
        "size",
        lambda c, v: ce(logits(), ids([0, 1, 2]), tp_group=c.world_group, vocab_size=v),
        ("vocab_size",),
        values=(16, 4),
        good=8,
    )
    arg(
        T,
        "vocab_parallel_cross_entropy(tp_group=)",
        "opt_group",
        lambda c, v: ce(logits(), ids([0, 1, 2]), tp_group=v),
    )
    misuse(T, "layer forward after destroy_model_parallel", _layer_after_destroy, ("destroy",))


def _layer_after_destroy(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    layer = column(ctx, pg_collection=pgc)
    mg.destroy_model_parallel(pgc)
    layer(torch.ones(2, 4, requires_grad=True))[0].sum().backward()
