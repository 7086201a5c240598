"""Loss masks with uneven token counts and the 1-process references of the per-token-loss
parity tests (``test_parity_per_token.py``, ``test_parity_vpp.py``).

Megatron's per-token loss (``calculate_per_token_loss=True``): every micro-batch returns
``Σ mask·CE`` (a sum, not a mean) and its token count ``Σ mask``; DDP sums grads over DP
without the 1/dp pre-scale, and ``finalize_model_grads(num_tokens=...)`` divides every grad
by the global count ``N = Σ_{dp·cp} Σ_microbatch Σ mask``. The step then minimises

    L_token = Σ_{all tokens} mask·CE / N

which is :func:`examples.gpt.reference_loss` with the mask over the whole batch. The
default normalisation (mean per micro-batch, then averaged over micro-batches and DP) is

    L_mb = 1/(dp·m) · Σ_microbatch (Σ_mb mask·CE / Σ_mb mask)

and differs from ``L_token`` whenever micro-batches hold different token counts, which the
mask below guarantees: row ``i`` of step ``t`` keeps its first
``n_i = s − ((5i + 3t) mod (s − 1))`` targets (the rest is "padding"), 2 to s tokens per
row; the global count changes from step to step too (93, 69, 75, 51, 72 at s = 16).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

from examples.gpt import (
    GPTConfig,
    ReferenceRun,
    init_full_weights,
    reference_loss,
    train_reference,
)
from integration_tests._common import CFG, GLOBAL_BATCH, SEED, SGD, STEPS, batch


def loss_mask(
    step: int, rows: int = GLOBAL_BATCH, seq_length: int = CFG.seq_length
) -> torch.Tensor:
    """``[rows, seq_length]`` float32 mask of step ``step``: row ``i`` keeps its first
    ``seq_length − ((5i + 3·step) mod (seq_length − 1))`` targets."""
    keep = [seq_length - (5 * i + 3 * step) % (seq_length - 1) for i in range(rows)]
    positions = torch.arange(seq_length)
    return torch.stack([(positions < n).float() for n in keep])


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the 1-process reference on one intra-op thread (restored after): its ops are
    tiny, and on this 2-core machine, shared with other test sessions, two spinning OpenMP
    threads made a 5-step reference of the 4-block GPT take 13 s instead of 0.3 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@cache
def full_weights_for(cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The initial weights of ``cfg``'s GPT (the integration tests' seed)."""
    return init_full_weights(cfg, SEED)


@cache
def plain_reference(cfg: GPTConfig) -> ReferenceRun:
    """``cfg``'s GPT trained on the whole batch, mean loss (no mask), 5 SGD steps."""
    with single_thread():
        return train_reference(full_weights_for(cfg), cfg, SGD, batch, STEPS)


@cache
def per_token_reference(cfg: GPTConfig) -> ReferenceRun:
    """``cfg``'s GPT trained on the whole batch with loss ``L_token`` (module notes)."""
    with single_thread():
        return train_reference(
            full_weights_for(cfg), cfg, SGD, batch, STEPS, lambda t: loss_mask(t, GLOBAL_BATCH)
        )


@cache
def microbatch_mean_reference(cfg: GPTConfig, groups: int) -> ReferenceRun:
    """``cfg``'s GPT trained with loss ``L_mb`` over ``groups`` = dp·m equal row groups: the
    normalisation a per-token run must *not* reproduce (the tests check it is far away)."""
    params = {k: v.clone().requires_grad_() for k, v in full_weights_for(cfg).items()}
    optimizer = SGD.build(list(params.values()))
    losses = []
    with single_thread():
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            parts = zip(batch(step).chunk(groups), loss_mask(step).chunk(groups), strict=True)
            loss = sum(reference_loss(params, cfg, t, m) for t, m in parts) / groups
            assert isinstance(loss, torch.Tensor)
            torch.autograd.backward(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
    return ReferenceRun(losses, {k: p.detach().clone() for k, p in params.items()})
