"""Command-line flags of the demo, and the checks that turn them into a :class:`DemoConfig`.

Every check runs before any process is started (plain launch) or before any collective (under
``torchrun``), so a bad layout stops with one message instead of a hang.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from dtensor_moe import MoEConfig
from dtensor_moe.demo.model import ModelConfig

__all__ = [
    "DEFAULT_BUFFER_FACTOR",
    "EXCHANGES",
    "OPTIMIZERS",
    "OVERFLOW_POLICIES",
    "SCHEDULES",
    "DemoConfig",
    "LayoutError",
    "build_parser",
    "resolve_config",
]

DEFAULT_WORLD = 4  # processes of one pipeline stage (of the whole run without --pp)

# --schedule: torch.distributed.pipelining schedule, and how many stages each pp rank runs
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}

# --optimizer: one fused AdamW over every param, or Muon for the hidden matrices and routed
# experts with AdamW for the rest (dtensor_moe.optim.muon_param_groups)
OPTIMIZERS = ("adamw", "muon")

# --exchange: the expert-parallel exchange backend (parallelize_moe(..., exchange=)); "fixed" is
# dropless on fixed buffers with no host read (dtensor_moe/routed/fixed.py), sized by
# --buffer-factor; --overflow says what a step does when a buffer was too small
EXCHANGES = ("all_to_all", "all_gather", "fixed")
DEFAULT_BUFFER_FACTOR = 1.25
OVERFLOW_POLICIES = ("rerun", "strict")


class LayoutError(ValueError):
    """A flag combination the demo cannot run; the message names the values and the fix."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything one run needs, validated and identical on every rank."""

    world: int
    dp: int
    ep: int
    tp: int
    expert_tp: bool
    sequence_parallel: bool
    model: ModelConfig
    steps: int
    batch: int
    seq_len: int
    lr: float
    max_norm: float
    balance: bool
    bias_rate: float
    seed: int
    out: str
    compare_balance: bool
    compile: bool = False
    compile_backend: str = "inductor"
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    optimizer: str = "adamw"
    exchange: str = "all_to_all"
    buffer_factor: float | None = None  # with exchange "fixed" only
    overflow: str | None = None  # with exchange "fixed" only: "rerun" or "strict"

    @property
    def fixed(self) -> bool:
        """Whether the experts exchange rows on fixed buffers (``--exchange fixed``)."""
        return self.exchange == "fixed"

    @property
    def ep_ranks(self) -> int:
        """``P``: the ranks one expert exchange spans (ep, times tp under expert TP)."""
        return self.ep * (self.tp if self.expert_tp else 1)

    @property
    def routed_pairs(self) -> int:
        """``N``: the most (token, expert) rows one rank hands its exchange per forward (one
        micro-batch under ``--pp``): the tokens of the fullest tp rank times top-k, times tp
        under expert TP (each row goes to every tp slice of its expert). The fixed exchange
        sizes its buffers for it (Note [The agreed size] in ``dtensor_moe/routed/fixed.py``).
        Under sequence parallelism a tp rank routes its shard of every sequence (DTensor's
        ``Shard(1)``, the first shards one longer when tp does not divide the length);
        otherwise, or with a sequence shorter than tp, ``1/tp`` of the flattened tokens
        (Note [Token-parallel MoE] in ``dtensor_moe/parallel/token_parallel.py``)."""
        rows = self.batch // self.dp if self.pp == 1 else self.microbatch_size
        if self.sequence_parallel and self.seq_len >= self.tp:
            tokens = rows * -(-self.seq_len // self.tp)
        else:
            tokens = -(-rows * self.seq_len // self.tp)
        return tokens * self.model.moe.top_k * (self.tp if self.expert_tp else 1)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: ``pp`` times the stages each pp rank runs."""
        return self.pp * SCHEDULES[self.schedule] if self.pp > 1 else 1

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch of one pipeline (one dp rank of every stage)."""
        return self.batch // (self.dp * self.microbatches)

    def layout_line(self) -> str:
        sp = "on" if self.sequence_parallel and self.tp > 1 else "off"
        etp = self.tp if self.expert_tp else 1
        experts = f"ep={self.ep}  etp={etp}  edp={self.world // (self.pp * self.ep * etp)}"
        compiled = "  compiled blocks" if self.compile else ""
        if self.fixed:
            experts += (
                f"  exchange=fixed (buffer_factor {self.buffer_factor:g}, overflow {self.overflow})"
            )
        elif self.exchange != "all_to_all":
            experts += f"  exchange={self.exchange}"
        pipeline = (
            f"  pp={self.pp} ({self.schedule}, {self.num_stages} stages, "
            f"{self.microbatches} micro-batches)"
            if self.pp > 1
            else ""
        )
        return (
            f"world={self.world}{pipeline}  dense: dp={self.dp}  tp={self.tp}  sp={sp}  "
            f"experts: {experts}{compiled}"
        )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: x)`` unless the help text already explains a computed default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dtensor_moe.demo",
        description=(
            "Train a small MoE transformer language model on CPU under a parallel layout "
            "(FSDP2 over dp, tensor + sequence parallelism over tp, expert parallelism over "
            "ep), then rerun the same steps in one process and print the largest loss "
            "difference. Started plainly it launches --nproc gloo processes itself; under "
            "torchrun (single- or multi-node) it takes RANK/WORLD_SIZE/LOCAL_RANK from the "
            "environment and --nproc is not used."
        ),
        formatter_class=_HelpFormatter,
    )
    layout = parser.add_argument_group(
        "layout (pp * dp * tp must equal the number of processes; pp is 1 without --pp)"
    )
    layout.add_argument(
        "--nproc",
        type=int,
        default=None,
        help=f"processes to launch when not under torchrun "
        f"(default: pp * dp * tp when dp and tp are given, else pp * {DEFAULT_WORLD})",
    )
    layout.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel (FSDP2) degree of the dense params (default: processes // (pp * tp))",
    )
    layout.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel degree of attention, embeddings and LM head "
        "(default: 2 when the processes of a stage are even in number, else 1)",
    )
    layout.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree: the experts are split over this many ranks, and tokens "
        "move to them by all-to-all (default: tp, or 1 when tp does not divide --experts)",
    )
    layout.add_argument(
        "--expert-tp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also split every expert's hidden dim over the tp ranks (EP x TP; ep then divides "
        "dp). Off: EP borrows the tp ranks (ep a multiple of tp). Default: on only when ep "
        "is 1 and tp > 1",
    )
    layout.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sequence parallelism on the tp ranks (norms and residual stream "
        "sharded on the sequence dim; any --seq-len works)",
    )
    exchange = parser.add_argument_group(
        "expert exchange (how tokens travel to the experts of other ranks; needs --ep 2 or more)"
    )
    exchange.add_argument(
        "--exchange",
        choices=EXCHANGES,
        default="all_to_all",
        help="exchange backend of the expert-parallel layers (parallelize_moe(exchange=)): "
        "all_to_all sends each row to its expert's rank; all_gather gathers every token on "
        "every rank; fixed sends fixed-size buffers with no host read (dropless: a step whose "
        "rows did not fit is run again, see --overflow), so --compile compiles the experts "
        "with the rest of each block",
    )
    exchange.add_argument(
        "--buffer-factor",
        type=float,
        default=None,
        help="with --exchange fixed: rows per rank pair over the balanced share "
        "(tokens x top-k / ep ranks), >= 1.0 (default with --exchange fixed: "
        f"{DEFAULT_BUFFER_FACTOR})",
    )
    exchange.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default=None,
        help="with --exchange fixed, when rows did not fit a buffer: rerun runs the step's "
        "forward and backward again with a 1.5x larger buffer_factor (kept for later steps), "
        "before the optimizer step (dtensor_moe.routed.step_without_overflow); strict stops "
        "the run with the layer, rank pair and factor that would have held them "
        "(check_exchanges) (default with --exchange fixed: rerun)",
    )
    pipeline = parser.add_argument_group(
        "pipeline parallelism (torch.distributed.pipelining; each stage gets the layout above)"
    )
    pipeline.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages of consecutive ranks; the blocks are split evenly between them",
    )
    pipeline.add_argument(
        "--schedule",
        choices=tuple(SCHEDULES),
        default=None,
        help="pipeline schedule: ScheduleGPipe, Schedule1F1B, or ScheduleInterleaved1F1B with "
        "2 stages per pp rank (default with --pp: 1f1b)",
    )
    pipeline.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="micro-batches per step of each pipeline; --batch must be divisible by "
        "dp * microbatches (default with --pp: 2 * pp)",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--vocab", type=int, default=64, help="vocabulary size (Markov states)")
    model.add_argument("--dim", type=int, default=64, help="model width")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks")
    model.add_argument("--heads", type=int, default=4, help="attention heads (divisible by tp)")
    model.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    model.add_argument("--top-k", type=int, default=2, help="experts each token is sent to")
    model.add_argument(
        "--hidden", type=int, default=None, help="hidden width of each expert (default: 2 * dim)"
    )
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps")
    train.add_argument(
        "--batch", type=int, default=8, help="global batch in sequences (divisible by dp)"
    )
    train.add_argument(
        "--seq-len", type=int, default=64, help="tokens per sequence; need not be divisible by tp"
    )
    train.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw: one fused AdamW over every param. muon: dtensor_moe.optim.Muon for the "
        "hidden matrices and routed experts (adjust_lr_fn='match_rms_adamw', so it shares "
        "--lr) and a fused AdamW for embeddings, head, norms and router gates",
    )
    train.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="learning rate (AdamW's, and Muon's with --optimizer muon)",
    )
    train.add_argument(
        "--max-norm",
        type=float,
        default=1.0,
        help="clip the global grad norm to this (dtensor_moe.clip_grad_norm_)",
    )
    train.add_argument(
        "--balance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="auxiliary-loss-free load balancing (expert bias updated after "
        "every step by dtensor_moe.moe.update_expert_bias)",
    )
    train.add_argument(
        "--bias-rate", type=float, default=1e-3, help="step size of the expert-bias update"
    )
    train.add_argument(
        "--compare-balance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train one process with balancing switched the other way, to "
        "show its effect on the load imbalance",
    )
    train.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    train.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each transformer block of the distributed model (inductor), as "
        "torchtitan does; the parity reference stays eager (docs/parallelism.md, torch.compile)",
    )
    train.add_argument(
        "--compile-backend",
        choices=("inductor", "aot_eager", "eager"),
        default="inductor",
        help="torch.compile backend for --compile",
    )
    parser.add_argument(
        "--out", default="moe_demo_out", help="directory for metrics.json and training.png"
    )
    return parser


def _fail(message: str) -> None:
    raise LayoutError(message)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_positive(args: argparse.Namespace) -> None:
    for flag in (
        "nproc",
        "pp",
        "microbatches",
        "dp",
        "tp",
        "ep",
        "vocab",
        "dim",
        "layers",
        "heads",
        "experts",
        "top_k",
        "hidden",
        "steps",
        "batch",
        "seq_len",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("lr", "bias_rate"):
        if not getattr(args, flag) > 0:
            _fail(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if not args.max_norm > 0:
        _fail(f"--max-norm must be > 0, got {args.max_norm}")


def _resolve_degrees(args: argparse.Namespace, world: int, pp: int) -> tuple[int, int]:
    """``(dp, tp)`` from the flags and the process count; ``pp * dp * tp == world``."""
    if world % pp != 0:
        _fail(
            f"--pp {pp} does not divide the {world} processes; every stage holds processes / pp "
            f"of them (choose --pp in {{{_divisors(world)}}}, or {pp} * dp * tp processes)"
        )
    stage = world // pp
    tp = args.tp if args.tp is not None else (2 if stage % 2 == 0 else 1)
    fix = f"choose --tp in {{{_divisors(stage)}}} and --dp = {stage} // tp"
    where = f"{world} processes"
    if pp > 1:
        where = f"{stage} processes of each of the {pp} stages"
        fix += f", or --nproc {pp} * dp * tp"
    if args.dp is None and stage % tp != 0:
        _fail(f"--tp {tp} does not divide the {where}; {fix}")
    dp = args.dp if args.dp is not None else stage // tp
    if dp * tp != stage:
        if pp == 1:
            _fail(
                f"--dp {dp} x --tp {tp} = {dp * tp}, but there are {world} processes; dp * tp "
                f"must equal the number of processes: {fix}"
            )
        _fail(
            f"--dp {dp} x --tp {tp} = {dp * tp}, but there are {where}; pp * dp * tp "
            f"must equal the number of processes: {fix}"
        )
    return dp, tp


def _resolve_pipeline(args: argparse.Namespace, dp: int) -> tuple[str, int]:
    """``(schedule, microbatches)``; see docs/pipeline.md, Demo."""
    pp = args.pp
    if pp == 1:
        for flag, value in (("--schedule", args.schedule), ("--microbatches", args.microbatches)):
            if value is not None:
                _fail(f"{flag} {value} needs --pp 2 or more (pipeline parallelism); drop it")
        return "1f1b", 1
    schedule = args.schedule if args.schedule is not None else "1f1b"
    microbatches = args.microbatches if args.microbatches is not None else 2 * pp
    stages = pp * SCHEDULES[schedule]
    if args.layers % stages != 0:
        per_rank = f" ({SCHEDULES[schedule]} per pp rank)" if SCHEDULES[schedule] > 1 else ""
        _fail(
            f"--layers {args.layers} cannot be split evenly over the {stages} stages of --pp {pp} "
            f"--schedule {schedule}{per_rank}; choose --layers a multiple of {stages}"
        )
    if schedule == "1f1b" and microbatches < pp:
        _fail(
            f"--microbatches {microbatches} is fewer than the {pp} stages; Schedule1F1B needs at "
            f"least one per stage (choose --microbatches >= {pp})"
        )
    if schedule == "interleaved" and microbatches % pp != 0:
        _fail(
            f"--microbatches {microbatches} is not a multiple of --pp {pp}; "
            f"ScheduleInterleaved1F1B runs them in rounds of pp (choose a multiple of {pp})"
        )
    if args.batch % (dp * microbatches) != 0:
        _fail(
            f"--batch {args.batch} is not divisible by dp * microbatches = {dp} * {microbatches}; "
            f"each of the {dp} pipelines splits its batch / dp sequences into {microbatches} "
            f"micro-batches (choose --batch a multiple of {dp * microbatches}, or other "
            "--microbatches)"
        )
    if args.compile:
        _fail("--compile cannot be combined with --pp yet (the pipeline is run eagerly); drop one")
    return schedule, microbatches


def _check_model(args: argparse.Namespace, dp: int, tp: int) -> None:
    if args.dim % args.heads != 0 or (args.dim // args.heads) % 2 != 0:
        _fail(
            f"--dim {args.dim} must be an even multiple of --heads {args.heads} "
            "(rotary embeddings need an even head width)"
        )
    if args.heads % tp != 0:
        _fail(
            f"--heads {args.heads} is not divisible by --tp {tp}; each tp rank holds "
            f"heads / tp heads (choose --heads a multiple of {tp})"
        )
    if args.vocab % tp != 0:
        _fail(
            f"--vocab {args.vocab} is not divisible by --tp {tp}; the embedding and LM head "
            "are split by vocabulary rows"
        )
    if args.batch % dp != 0:
        _fail(
            f"--batch {args.batch} is not divisible by --dp {dp}; every data-parallel rank "
            f"takes batch / dp sequences (choose a multiple of {dp})"
        )
    if args.top_k > args.experts:
        _fail(f"--top-k {args.top_k} exceeds --experts {args.experts}")


def _expert_tp_for(args: argparse.Namespace, ep: int, tp: int) -> bool:
    """``--expert-tp`` as given, else its default for ``ep``: on only when ep is 1 and tp > 1."""
    return args.expert_tp if args.expert_tp is not None else (ep == 1 and tp > 1)


def _expert_problem(
    args: argparse.Namespace, ep: int, expert_tp: bool, dp: int, tp: int, hidden: int
) -> str | None:
    """Why ``--ep ep`` (with ``expert_tp``) cannot run with the other flags, or ``None``.

    The rules are those of the expert mesh (Note [MoE meshes] in
    ``dtensor_moe/parallel/mesh.py``) and of FSDP2's expert sharding (``fully_shard_moe``).
    """
    world = dp * tp
    if args.experts % ep != 0:
        return (
            f"--experts {args.experts} is not divisible by --ep {ep}; each ep rank holds "
            "experts / ep experts"
        )
    if (expert_tp or tp == 1) and dp % ep != 0:
        where = "with --expert-tp" if tp > 1 else "with --tp 1"
        return (
            f"--ep {ep} does not divide --dp {dp}; {where} the experts are split over "
            "data-parallel ranks"
        )
    if not expert_tp and tp > 1 and (ep % tp != 0 or world % ep != 0):
        return (
            f"--ep {ep} with --tp {tp}: EP borrows the tp ranks, so ep must be a multiple of tp "
            f"that divides the {world} processes"
        )
    etp = tp if expert_tp else 1
    if hidden % etp != 0:
        return f"--hidden {hidden} is not divisible by --tp {tp}, which --expert-tp splits it over"
    edp = world // (ep * etp)
    if (args.experts // ep) % edp != 0 and (hidden % edp != 0 or args.dim % edp != 0):
        return (
            f"FSDP2 splits the {args.experts // ep} experts per ep rank over edp={edp} ranks "
            f"by hidden unit, which needs --hidden {hidden} and --dim {args.dim} divisible by {edp}"
        )
    return None


def working_eps(args: argparse.Namespace, dp: int, tp: int, hidden: int) -> list[int]:
    """Every ``--ep`` that passes :func:`_expert_problem` with the other flags as given.

    ``--expert-tp`` keeps its value when it was given, and takes its default for each
    candidate otherwise; ep never exceeds the process count, so the search is complete.
    """
    return [
        ep
        for ep in range(1, dp * tp + 1)
        if _expert_problem(args, ep, _expert_tp_for(args, ep, tp), dp, tp, hidden) is None
    ]


def _ep_fix(args: argparse.Namespace, ep: int, dp: int, tp: int, hidden: int) -> str:
    """The fix for a rejected ``--ep``: the values that work, and ``--expert-tp`` if it helps."""
    fixes = []
    eps = working_eps(args, dp, tp, hidden)
    if eps:
        fixes.append(f"choose --ep in {{{', '.join(map(str, eps))}}}")
    expert_tp = _expert_tp_for(args, ep, tp)
    if tp > 1 and _expert_problem(args, ep, not expert_tp, dp, tp, hidden) is None:
        fixes.append(f"add --{'no-' if expert_tp else ''}expert-tp with --ep {ep}")
    if not fixes:
        return "no --ep works with the other flags as given; change --experts, --hidden or --dim"
    return " or ".join(fixes)


def _resolve_experts(args: argparse.Namespace, dp: int, tp: int, hidden: int) -> tuple[int, bool]:
    """``(ep, expert_tp)``; a rejected ep names the values that work (:func:`working_eps`)."""
    ep = args.ep if args.ep is not None else (tp if args.experts % tp == 0 else 1)
    expert_tp = _expert_tp_for(args, ep, tp)
    problem = _expert_problem(args, ep, expert_tp, dp, tp, hidden)
    if problem is not None:
        _fail(f"{problem}; {_ep_fix(args, ep, dp, tp, hidden)}")
    return ep, expert_tp


def _resolve_exchange(
    args: argparse.Namespace, dp: int, tp: int, ep: int, expert_tp: bool, hidden: int
) -> tuple[float | None, str | None]:
    """``(buffer_factor, overflow)`` for ``--exchange``: both ``None`` unless it is ``fixed``.

    The fixed exchange (``dtensor_moe/routed/fixed.py``) computes the experts with
    ``torch._grouped_mm`` only (aligned rows); that is checked here, before any process starts,
    rather than by a ``ValueError`` on every rank at the first forward.
    """
    fixed = args.exchange == "fixed"
    for flag, value in (("--buffer-factor", args.buffer_factor), ("--overflow", args.overflow)):
        if value is not None and not fixed:
            _fail(
                f"{flag} {value} needs --exchange fixed (only the fixed exchange has buffers), "
                f"got --exchange {args.exchange}; add --exchange fixed or drop {flag}"
            )
    no_exchange = ep == 1 and not (expert_tp and tp > 1)  # every rank holds every expert
    if args.exchange != "all_to_all" and (no_exchange or (fixed and ep == 1)):
        if args.ep is not None:
            why = "got --ep 1"
        else:
            why = (
                "ep is 1 here (--ep defaults to --tp, which is 1)"
                if tp == 1
                else f"ep is 1 here (--ep defaults to 1 when --tp {tp} does not divide "
                f"--experts {args.experts})"
            )
        eps = [e for e in working_eps(args, dp, tp, hidden) if e > 1]
        fix = (
            f"choose --ep in {{{', '.join(map(str, eps))}}}, or drop --exchange {args.exchange}"
            if eps
            else "no --ep of 2 or more works with the other flags as given: drop --exchange "
            f"{args.exchange}"
        )
        _fail(
            f"--exchange {args.exchange} needs expert parallelism (--ep 2 or more), but {why}; "
            f"{fix}"
        )
    if not fixed:
        return None, None
    factor = args.buffer_factor if args.buffer_factor is not None else DEFAULT_BUFFER_FACTOR
    if not (math.isfinite(factor) and factor >= 1.0):
        _fail(
            f"--buffer-factor must be a finite number >= 1.0 (rows per rank pair over the "
            f"balanced share), got {factor}; the default is {DEFAULT_BUFFER_FACTOR}"
        )
    etp = tp if expert_tp else 1
    if args.dim % 4 != 0 or (hidden // etp) % 4 != 0:
        per_rank = f" (--hidden / --tp {tp} under expert TP: {hidden // etp})" if etp > 1 else ""
        _fail(
            f"--exchange fixed computes the experts with torch._grouped_mm, which needs float32 "
            f"rows of a multiple of 16 bytes: --dim {args.dim} and --hidden {hidden}{per_rank} "
            "must be multiples of 4; choose them so, or --exchange all_to_all"
        )
    return float(factor), args.overflow if args.overflow is not None else "rerun"


def resolve_config(args: argparse.Namespace, world: int) -> DemoConfig:
    """Check the flags for ``world`` processes; :class:`LayoutError` names the first problem."""
    _check_positive(args)
    dp, tp = _resolve_degrees(args, world, args.pp)
    _check_model(args, dp, tp)
    schedule, microbatches = _resolve_pipeline(args, dp)
    hidden = args.hidden if args.hidden is not None else 2 * args.dim
    ep, expert_tp = _resolve_experts(args, dp, tp, hidden)
    buffer_factor, overflow = _resolve_exchange(args, dp, tp, ep, expert_tp, hidden)
    try:
        moe = MoEConfig(
            dim=args.dim,
            hidden_dim=hidden,
            num_experts=args.experts,
            top_k=args.top_k,
            use_expert_bias=args.balance,
        )
    except ValueError as err:
        raise LayoutError(str(err)) from None
    model = ModelConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, moe=moe
    )
    return DemoConfig(
        world=world,
        dp=dp,
        ep=ep,
        tp=tp,
        expert_tp=expert_tp,
        sequence_parallel=args.sp,
        model=model,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        max_norm=args.max_norm,
        balance=args.balance,
        bias_rate=args.bias_rate,
        seed=args.seed,
        out=args.out,
        compare_balance=args.compare_balance,
        compile=args.compile,
        compile_backend=args.compile_backend,
        pp=args.pp,
        schedule=schedule,
        microbatches=microbatches,
        optimizer=args.optimizer,
        exchange=args.exchange,
        buffer_factor=buffer_factor,
        overflow=overflow,
    )
