"""``python -m mc_train.check MODULE:FUNCTION --tp N --pp N --dp N [--sp] ...``: check a
model's layout against one process on CPU (``docs/check.md``). Exit status 0 only when
every parameter matches; 1 when one differs or a rank failed; 2 for a bad command line."""

from __future__ import annotations

import argparse
import json
import sys

from mc_groups.errors import InputTypeError, InputValueError
from mc_train.check import LOSSES, check_layout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m mc_train.check",
        description="Train a model at a parallel layout and in one process on CPU gloo "
        "ranks; report per parameter whether the layout trains it equally, and if not the "
        "pattern and likely cause.",
    )
    p.add_argument("model", help="MODULE:FUNCTION returning a fresh model with fixed weights")
    p.add_argument("--plan", help="MODULE:FUNCTION of the model returning the parallelize plan")
    p.add_argument("--batch", help="MODULE:FUNCTION of the step returning [B, S] token ids")
    p.add_argument("--forward", help="MODULE:FUNCTION, a mc_train.StageForward")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--dp", "data")):
        p.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (default 1)")
    p.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="sequence parallelism (default off; the plan defaults to sequence_parallel_plan)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--microbatches", type=int, help="per step and DP rank (default 2·pp)")
    p.add_argument(
        "--distributed-optimizer", action="store_true", help="shard the optimizer over DP"
    )
    p.add_argument("--no-overlap", action="store_true", help="reduce grads after backward")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, help="expert tensor-parallel size (default: --tp)")
    p.add_argument("--fsdp2", action="store_true", help="FSDP2 instead of mc DDP")
    p.add_argument("--loss", choices=LOSSES, default="auto", help="how logits are read")
    p.add_argument("--sequence-first", action="store_true", help="logits are [s, b, V]")
    p.add_argument("--after-parallelize", help="MODULE:FUNCTION hook(chunk, stage)")
    p.add_argument("--finalize", help="MODULE:FUNCTION run instead of finalize_model_grads")
    p.add_argument("--rtol", type=float, default=1e-4, help="gradient tolerance (1e-4)")
    p.add_argument("--json", help="write the report here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the check; print the report; the exit status (module notes)."""
    args = parse_args(argv)
    try:
        report = check_layout(
            args.model,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            sequence_parallel=args.sp,
            plan=args.plan,
            batch=args.batch,
            forward=args.forward,
            sequence_first=args.sequence_first,
            steps=args.steps,
            lr=args.lr,
            distributed_optimizer=args.distributed_optimizer,
            overlap=not args.no_overlap,
            microbatches=args.microbatches,
            loss=args.loss,
            data_parallel="fsdp2" if args.fsdp2 else "ddp",
            expert_parallel=args.ep,
            expert_tensor_parallel=args.etp,
            after_parallelize=args.after_parallelize,
            finalize=args.finalize,
            rtol=args.rtol,
        )
    except (InputValueError, InputTypeError) as err:
        print(f"python -m mc_train.check: error: {err}", file=sys.stderr)
        return 2
    print(report.text())
    print(f"({report.seconds:.1f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report.to_json(), out, indent=1)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
