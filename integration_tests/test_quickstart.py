"""The README's example runs as printed and trains.

Localizes: the README code block is ``examples/quickstart.py`` verbatim (so the README cannot
drift from working code), and ``train`` runs on 4 gloo ranks (TP=2 × DP=2, distributed
optimizer, overlap): tensor-parallel peers see bit-identical losses (same data, reduced
activations), data-parallel ranks differ (their own batches), and the loss falls every step.
Parity with a 1-process run is the GPT integration tests' job.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from examples import quickstart
from mc_groups.testing import RankPools

ROOT = Path(__file__).resolve().parents[1]


def _readme_block() -> list[str]:
    source = (ROOT / "examples" / "quickstart.py").read_text().splitlines()
    start = source.index("# --8<-- [start:readme]") + 1
    end = source.index("# --8<-- [end:readme]")
    return source[start:end]


def test_readme_shows_the_example_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    block = "\n".join(_readme_block()).rstrip()
    assert block in readme


def test_quickstart_trains_on_four_ranks(rank_pools: RankPools) -> None:
    losses = rank_pools.get(4).run(quickstart.train)
    # rank = tp + 2·dp: ranks 0, 1 share dp rank 0; ranks 2, 3 share dp rank 1
    assert losses[0] == losses[1]
    assert losses[2] == losses[3]
    assert losses[0] != losses[2]
    for per_rank in losses:
        assert all(b < a for a, b in itertools.pairwise(per_rank))
