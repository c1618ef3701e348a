"""Entry point: validate the flags, start the processes (or join torchrun's), run, report.

Note [Demo launch]
~~~~~~~~~~~~~~~~~~
- **Plain** ``python -m dtensor_moe.demo``: the flags are validated in this process, *before*
  any worker exists, then ``--nproc`` workers are started with ``torch.multiprocessing`` (fork
  on Linux, spawn elsewhere) on a free local port, each with ``RANK``/``WORLD_SIZE``/
  ``LOCAL_RANK`` set as torchrun would.
- **Under torchrun** (``RANK`` and ``WORLD_SIZE`` in the environment; single- or multi-node):
  every rank validates the same flags against ``WORLD_SIZE`` before ``init_process_group``, so a
  bad layout exits on every rank before any collective; only rank 0 prints the message.

Either way each worker then runs :func:`run_rank`: the distributed run; then rank 0 reruns the
same steps in one process (the parity reference) while rank 1 trains one process with load
balancing switched the other way; rank 0 gathers both and reports.

At the end, every rank waits at a barrier before destroying its process groups, as torch's own
distributed test base does before its teardown. Without it, the other ranks leave as soon as
their part of the final gather is done, while rank 0 is still reporting, and tear their gloo
connections down under it; a rank can then abort at teardown (SIGABRT, "terminate called
without an active exception") after a correct run. The barrier costs one collective. On an
error a rank skips it and destroys its groups at once; the launcher (torchrun, or
``torch.multiprocessing``) then stops the others.

Rank 0 (the global rank) prints the progress and the summary and writes ``--out``, on its own
node and relative to its working directory. Under torchrun's c10d rendezvous that may be any
node (ranks follow arrival order); a static rendezvous makes it ``--node-rank 0``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtensor_moe.demo.config import (
    DEFAULT_WORLD,
    DemoConfig,
    LayoutError,
    build_parser,
    resolve_config,
)
from dtensor_moe.demo.data import MarkovChain
from dtensor_moe.demo.layout import apply_layout, describe_layout, exchange_options
from dtensor_moe.demo.pipeline import Pipeline, full_params
from dtensor_moe.demo.report import (
    load_lines,
    progress_line,
    summarize,
    summary_lines,
    write_outputs,
)
from dtensor_moe.demo.train import (
    BufferOverflow,
    build_model,
    dynamo_graphs,
    optimizer_line,
    run_single_process,
    run_single_process_with_params,
    train,
)
from dtensor_moe.parallel import build_moe_meshes
from dtensor_moe.parallel.objects import all_gather_objects

__all__ = ["main", "run_rank"]

_SCHEDULE_NAMES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
}


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _plain_world(nproc: int | None, dp: int | None, tp: int | None, pp: int = 1) -> int:
    if nproc is not None:
        return nproc
    if dp is not None and tp is not None:
        return pp * dp * tp
    return pp * DEFAULT_WORLD


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code (0 ok, 1 parity failed, 2 bad flags)."""
    start = time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    torchrun = _under_torchrun()
    world = (
        int(os.environ["WORLD_SIZE"])
        if torchrun
        else _plain_world(args.nproc, args.dp, args.tp, max(args.pp, 1))
    )
    try:
        if torchrun and args.nproc is not None and args.nproc != world:
            raise LayoutError(
                f"--nproc {args.nproc} does not match torchrun's WORLD_SIZE={world}; under "
                "torchrun the process count comes from torchrun (drop --nproc)"
            )
        config = resolve_config(args, world)
    except LayoutError as err:
        if not torchrun or os.environ.get("RANK") == "0":
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if torchrun:
        return run_rank(config, start)
    return _launch(config, start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: DemoConfig, start: float) -> int:
    """Start ``config.world`` local gloo workers, wait for them, return rank 0's exit code."""
    method = "fork" if sys.platform == "linux" else "spawn"
    exit_code = mp.get_context(method).Value("i", 1)
    try:
        mp.start_processes(
            _worker,
            args=(config, start, _free_port(), exit_code),
            nprocs=config.world,
            start_method=method,
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        print(err, file=sys.stderr)
        return 1
    return exit_code.value


def _worker(rank: int, config: DemoConfig, start: float, port: int, exit_code) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(config.world),
    )
    code = run_rank(config, start)
    if rank == 0:
        exit_code.value = code


def run_rank(config: DemoConfig, start: float) -> int:
    """The body of one rank (process group from the environment); see Note [Demo launch]."""
    torch.set_num_threads(1)
    # The LM head's ColwiseParallel(use_local_output=True) returns DTensor.to_local(), a view,
    # and FSDP2 warns when its root returns a view: an in-place op on the logits would skip
    # FSDP2's pre-backward hook. The training step only reads them (cross-entropy).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo")
    try:
        code = _run(config, start)
        dist.barrier()  # leave together: see Note [Demo launch]
        return code
    finally:
        dist.destroy_process_group()


def _run(config: DemoConfig, start: float) -> int:
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    chain = MarkovChain.random(config.model.vocab_size, seed=config.seed)
    meshes = build_moe_meshes(
        pp=config.pp, dp=config.dp, ep=config.ep, tp=config.tp, expert_tp=config.expert_tp
    )
    pipeline = None
    if config.pp > 1:  # Note [Demo pipeline] in pipeline.py
        n_params = sum(p.numel() for p in build_model(config.model, config.seed).parameters())
        pipeline = Pipeline.build(config, meshes)
        model = pipeline.modules
    else:
        model = build_model(config.model, config.seed)
        n_params = sum(p.numel() for p in model.parameters())
        apply_layout(
            model, meshes, sequence_parallel=config.sequence_parallel,
            exchange=config.exchange, exchange_options=exchange_options(config),
        )  # fmt: skip
    if config.compile:
        for block in model.layers:  # in place: parameter names stay as they are
            block.compile(backend=config.compile_backend)
    mesh_lines = describe_layout(model)
    _print_header(say, config, n_params, mesh_lines, chain)
    try:
        records = train(
            model,
            config,
            chain,
            dp_rank=meshes.dense.get_coordinate()[0],
            dp_size=config.dp,
            group=dist.group.WORLD,
            on_step=lambda r: say(progress_line(r, config.steps), flush=True),
            pipeline=pipeline,
        )
    except BufferOverflow as err:  # raised on every rank alike: they all stop here
        if rank == 0:
            print(f"python -m dtensor_moe.demo: {err}; exit code 1", file=sys.stderr)
        return 1
    train_s = time.time() - start
    dynamo = dynamo_graphs() if config.compile else None  # before the (eager) reruns
    if records:
        say("\n".join(load_lines(records[-1])), flush=True)
    say(f"distributed run done; rerunning the {config.steps} steps in one process ...", flush=True)
    params = _gather_stage_params(model, meshes) if pipeline is not None else None
    runs, ref_params = _single_process_runs(config, chain, rank)
    if rank != 0:
        return 0
    runs["distributed"] = records
    param_diff = _max_param_diff(params, ref_params) if params is not None else None
    summary = summarize(
        runs, config, chain.entropy_rate(), max_param_diff=param_diff, dynamo=dynamo
    )
    wall = time.time() - start
    meta = {
        "layout": mesh_lines,
        "entropy_rate": chain.entropy_rate(),
        "wall_time_s": wall,
        "distributed_done_s": train_s,
    }
    if config.fixed:  # N and P of the buffer rule C = max(8, ceil(ceil(F * N / P) / 8) * 8)
        meta["fixed_exchange"] = {
            "routed_pairs_per_rank": config.routed_pairs,
            "ep_ranks": config.ep_ranks,
        }
    written = write_outputs(config.out, runs, summary, config, meta)
    say("\n".join(summary_lines(summary, config)))
    say(
        f"wrote {', '.join(written)}"
        + ("" if len(written) > 1 else ' (pip install "dtensor_moe[plot]" for training.png)')
    )
    say(f"wall time {wall:.1f} s (from the start of main, after the imports)")
    if not summary.parity_ok:
        print(
            "python -m dtensor_moe.demo: parity FAILED (see the parity line above); exit code 1",
            file=sys.stderr,
        )
        return 1
    return 0


def _gather_stage_params(model: torch.nn.Module, meshes) -> dict[str, torch.Tensor] | None:
    """Every param of every stage, whole, on rank 0 (``None`` elsewhere); every rank calls it.

    The first rank of each stage gathers its stage's params (a collective over the stage's
    meshes) and sends them to rank 0 with one object all-gather over all ranks.
    """
    params = full_params(model)
    first_of_stage = dist.get_rank() == meshes.stage_ranks[0]
    gathered = all_gather_objects(params if first_of_stage else None)
    if dist.get_rank() != 0:
        return None
    return {name: p for stage in gathered if stage is not None for name, p in stage.items()}


def _max_param_diff(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest ``|param - reference|`` over every element of every param (same names)."""
    if params.keys() != ref.keys():
        missing = sorted(ref.keys() ^ params.keys())
        raise RuntimeError(f"the pipeline stages and the reference differ in params: {missing}")
    return max(float((params[name] - ref[name]).abs().max()) for name in ref)


def _single_process_runs(
    config: DemoConfig, chain: MarkovChain, rank: int
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """Rank 0: the parity rerun (and its params after the last step); rank 1 (rank 0 on one
    process): the other balance setting."""
    world = dist.get_world_size()
    runs, ref_params = {}, None
    if rank == 0:
        runs["reference"], ref_params = run_single_process_with_params(
            config, chain, balance=config.balance
        )
    comparison_rank = 1 if world > 1 else 0
    comparison = None
    if config.compare_balance and rank == comparison_rank:
        comparison = run_single_process(config, chain, balance=not config.balance)
    if config.compare_balance:
        if world > 1:  # numpy-free (Note [Object collectives without numpy])
            gathered = all_gather_objects(comparison)  # every rank takes part
            comparison = gathered[comparison_rank] if rank == 0 else None
        if rank == 0:
            runs["comparison"] = comparison
    return runs, ref_params


def _print_header(
    say, config: DemoConfig, n_params: int, mesh_lines: list[str], chain: MarkovChain
) -> None:
    m = config.model
    say(
        f"dtensor_moe demo: {m.n_layers}-layer MoE transformer (dim {m.dim}, {m.n_heads} heads, "
        f"{m.moe.num_experts} experts, top-{m.moe.top_k}, vocab {m.vocab_size}; "
        f"{n_params / 1e6:.2f}M params) on {config.world} gloo processes"
    )
    say(f"layout: {config.layout_line()}")
    across = "the meshes"
    if config.pp > 1:
        per_stage, per_rank = m.n_layers // config.num_stages, config.num_stages // config.pp
        say(
            f"pipeline: {config.num_stages} stages of {per_stage} block(s), {per_rank} on each "
            f"of the {config.pp} groups of {config.world // config.pp} ranks; "
            f"{_SCHEDULE_NAMES[config.schedule]}, {config.microbatches} micro-batches of "
            f"{config.microbatch_size} sequence(s) per pipeline; the params of rank 0's "
            f"stage{'s' if per_rank > 1 else ''}:"
        )
        across = "the meshes and the stages (pp_mesh)"
    for line in mesh_lines:
        say(f"  params on {line}")
    say(
        f"{optimizer_line(config)}; dtensor_moe.clip_grad_norm_(max_norm={config.max_norm}) "
        f"across {across}; load balancing {'on' if config.balance else 'off'}"
    )
    say(
        f"data: Markov chain over {m.vocab_size} tokens, entropy rate {chain.entropy_rate():.4f} "
        f"nats/token (the best possible loss; uniform guessing gives "
        f"{torch.tensor(float(m.vocab_size)).log():.4f}); global batch {config.batch} x "
        f"{config.seq_len} tokens",
        flush=True,
    )
