"""Steps 6 and 7: tied word-embedding and position-embedding grads across pipeline stages.

Localizes the choice of chunk (``model[0]`` on the first stage, ``model[-1]`` on the last,
with virtual chunks), both ways of naming the shared weight (Megatron's
``shared_embedding_or_output_weight()`` and mc's ``shared_embedding`` param mark), the skip
for frozen or unshared weights and for ranks outside the group, unwrapping ``.module``, and
the position-embedding group. Grads are ``1 + 10·pp_rank + chunk_index``: small integers,
compared exactly.
"""

from __future__ import annotations

from typing import Any

import torch

import mc_groups as mg
from mc_finalize import (
    _allreduce_embedding_grad,
    _allreduce_position_embedding_grads,
    _allreduce_word_embedding_grads,
    _get_position_embedding_weight,
    _get_shared_word_embedding_weight,
)
from mc_finalize_tests._helpers import Cfg, Chunk, add_param, extra_group, first, layout, records
from mc_groups.collection import set_default_collection
from mc_groups.testing import RankPools

LABEL = "embedding grads"


class LanguageChunk(Chunk):
    """Megatron-style chunk: ``pre_process`` / ``post_process`` and a shared weight getter."""

    def __init__(self, cfg: Cfg, stage: int, stages: int, index: int, chunks: int) -> None:
        super().__init__(cfg)
        self.pre_process = stage == 0 and index == 0
        self.post_process = stage == stages - 1 and index == chunks - 1
        self.share_embeddings_and_output_weights = True
        value = 1 + 10 * stage + index
        self.weight: torch.nn.Parameter | None = None
        if self.pre_process or self.post_process:
            self.weight = add_param(self, "embedding.word_embeddings.weight", value)
        add_param(self, "other.weight", value)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        return self.weight


class Wrapper(Chunk):
    """A DDP-like wrapper holding the model in ``.module``."""

    def __init__(self, inner: Chunk) -> None:
        super().__init__(inner.config)
        self.module = inner


def _stage_chunks(pgc: mg.ProcessGroupCollection, chunks: int) -> list[LanguageChunk]:
    assert pgc.pp is not None
    stage, stages = pgc.pp.rank(), pgc.pp.size()
    return [LanguageChunk(Cfg(), stage, stages, i, chunks) for i in range(chunks)]


def _word(chunks: list[LanguageChunk]) -> list[float]:
    return [first(c.weight) for c in chunks if c.weight is not None]


def _pp2_virtual() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2) as pgc:
        chunks = _stage_chunks(pgc, 2)
        with mg.record_collectives() as log:
            _allreduce_word_embedding_grads(chunks, Cfg(), pgc.embd, pgc.pp)
        out["shared"] = {"word": _word(chunks), "log": records(log)}

        frozen = _stage_chunks(pgc, 2)
        for chunk in frozen:
            if chunk.weight is not None:
                chunk.weight.main_grad = None  # type: ignore[attr-defined]
        unshared = _stage_chunks(pgc, 2)
        for chunk in unshared:
            chunk.share_embeddings_and_output_weights = False
        with mg.record_collectives() as log:
            _allreduce_word_embedding_grads(frozen, Cfg(), pgc.embd, pgc.pp)
            _allreduce_word_embedding_grads(unshared, Cfg(), pgc.embd, pgc.pp)
        out["skipped"] = {"unshared": _word(unshared), "log": len(log)}

        marked = _marked_chunks(pgc)
        set_default_collection(pgc)
        with mg.record_collectives() as log:
            _allreduce_word_embedding_grads(marked, Cfg())  # groups from the default
        out["marked"] = {"values": [first(p) for c in marked for p in c.parameters()]}
        out["marked"]["log"] = records(log)
    return out


def _marked_chunks(pgc: mg.ProcessGroupCollection) -> list[Chunk]:
    """mc-style: no share_embeddings_* attributes, the weight marked ``shared_embedding``."""
    assert pgc.pp is not None
    stage = pgc.pp.rank()
    chunks: list[Chunk] = []
    for index in range(2):
        inner = Chunk(Cfg())
        holds = (stage, index) in {(0, 0), (1, 1)}
        add_param(inner, "emb.weight", 1 + 10 * stage + index, shared_embedding=holds)
        chunks.append(Wrapper(inner))
    return chunks


def test_pp2_tied_embedding_with_virtual_chunks(rank_pools: RankPools) -> None:
    # First stage: chunk 0 holds the input embedding (grad 1); last stage: chunk 1 holds the
    # output weight (grad 1 + 10 + 1 = 12). Both end with 13.
    outs = rank_pools.get(2).run(_pp2_virtual)
    for out in outs:
        assert out["shared"]["word"] == [13.0]
        assert out["shared"]["log"] == [("all_reduce", "sum", (0, 1), "float32", 3, LABEL)]
        assert out["skipped"]["log"] == 0  # frozen (grad None) and unshared: no collective
        assert out["marked"]["log"] == [("all_reduce", "sum", (0, 1), "float32", 3, LABEL)]
    assert [out["skipped"]["unshared"] for out in outs] == [[1.0], [12.0]]
    # Marked: rank 0 reduces chunk 0 (1 → 13) and leaves chunk 1 (2); rank 1 leaves chunk 0
    # (11) and reduces chunk 1 (12 → 13).
    assert [out["marked"]["values"] for out in outs] == [[13.0, 2.0], [11.0, 13.0]]


def _pp4_middle_stages() -> dict[str, Any]:
    with layout(pipeline_model_parallel_size=4) as pgc:
        chunks = _stage_chunks(pgc, 1)
        with mg.record_collectives() as log:
            _allreduce_word_embedding_grads(chunks, Cfg(), pgc.embd, pgc.pp)
        return {"word": _word(chunks), "log": records(log), "in_embd": pgc.embd is not None}


def test_pp4_only_first_and_last_stage_reduce(rank_pools: RankPools) -> None:
    # Stage 0 grad 1, stage 3 grad 31: both 32; stages 1 and 2 hold no copy and do nothing.
    outs = rank_pools.get(4).run(_pp4_middle_stages)
    for r in (0, 3):
        assert outs[r]["word"] == [32.0]
        assert outs[r]["log"] == [("all_reduce", "sum", (0, 3), "float32", 3, LABEL)]
    for r in (1, 2):
        assert outs[r] == {"word": [], "log": [], "in_embd": False}


class PositionChunk(Chunk):
    def __init__(self, value: float, with_embedding: bool = True) -> None:
        super().__init__(Cfg())
        self.pre_process = True
        if with_embedding:
            self.position_embeddings = torch.nn.Embedding(4, 2)
            self.position_embeddings.weight.main_grad = torch.full((4, 2), float(value))  # type: ignore[attr-defined]


def _position_embedding() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(pipeline_model_parallel_size=2) as pgc, extra_group([0, 1]) as pos_group:
        assert pgc.pp is not None
        chunk = PositionChunk(1 + 10 * pgc.pp.rank())
        with mg.record_collectives() as log:
            _allreduce_position_embedding_grads([chunk], Cfg(), pos_group, pgc.pp)
            _allreduce_position_embedding_grads([chunk], Cfg(), None, pgc.pp)  # not a member
            _allreduce_position_embedding_grads([chunk], Cfg(), pgc.pos_embd, pgc.pp)  # size 1
        out["value"] = first(_get_position_embedding_weight(chunk))
        out["log"] = records(log)
        with mg.record_collectives() as log:
            try:
                _allreduce_position_embedding_grads(
                    [PositionChunk(0.0, with_embedding=False)], Cfg(), pos_group, pgc.pp
                )
                out["missing"] = "no error"
            except ValueError as err:
                out["missing"] = str(err)
            try:
                _allreduce_embedding_grad([chunk], pos_group, None, _get_position_embedding_weight)
                out["no_pp"] = "no error"
            except ValueError as err:
                out["no_pp"] = str(err)
        out["error_log"] = len(log)
    return out


def test_position_embedding_group(rank_pools: RankPools) -> None:
    # Grads 1 (stage 0) and 11 (stage 1) → 12 on both; only the two-rank group communicates.
    for out in rank_pools.get(2).run(_position_embedding):
        assert out["value"] == 12.0
        assert out["log"] == [("all_reduce", "sum", (0, 1), "float32", 8, LABEL)]
        assert "has no position_embeddings.weight" in out["missing"]
        assert "needs pp_group" in out["no_pp"]
        assert out["error_log"] == 0


def test_word_embedding_getter_without_processes() -> None:
    chunk = LanguageChunk(Cfg(), stage=0, stages=2, index=0, chunks=1)
    assert _get_shared_word_embedding_weight(chunk, Cfg()) is chunk.weight
    chunk.share_embeddings_and_output_weights = False
    assert _get_shared_word_embedding_weight(chunk, Cfg()) is None
    # MTP layers keep a copy of the embedding even without tying.
    assert _get_shared_word_embedding_weight(chunk, Cfg(mtp_num_layers=1)) is chunk.weight
    plain = Chunk(Cfg())
    add_param(plain, "a.weight", 1.0)
    marked = add_param(plain, "b.weight", 1.0, shared_embedding=True)
    assert _get_shared_word_embedding_weight(plain, Cfg()) is marked
