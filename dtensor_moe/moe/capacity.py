"""Expert capacity and token dropping (``MoEConfig.capacity_factor``, ``capacity_per_expert``).

Shape legend:
    T  tokens of the batch one forward routes (all tp ranks' tokens under token parallelism)
    K  experts per token        E  routed experts        N  ``T * K`` (token, expert) pairs

Note [Expert capacity]
~~~~~~~~~~~~~~~~~~~~~~
With ``capacity_factor = f`` each expert takes at most ``C = ceil(f * T * K / E)`` of the
(token, expert) pairs of one forward's batch (rounded up to ``pad_multiple`` with
``pad_to_capacity``); with ``capacity_per_expert = c`` it takes at most ``C = c`` pairs (rounded
up alike), whatever the batch. ``T`` is the batch the layer sees as a whole, which is what a
single device running that batch sees:

* one process, and data or expert parallelism over data ranks: the rank's own micro-batch
  (capacity is per rank, as in Megatron-Core), so a rank drops exactly the pairs a single
  device drops for that micro-batch;
* tensor or sequence parallelism (:class:`~dtensor_moe.parallel.PrepareMoEInput`): the tp
  group's whole batch, not one rank's shard. The ranks of the group all-gather their routing
  table (the selected ids and combine weights, ``T * K`` values each, no gradient: one
  all-gather on the tp mesh per forward), apply the single-device rule to the whole table in
  global token order, and keep their own rows. The same pairs are dropped as on a single
  device, for uneven shards and batch > 1 too.

Which pairs an over-subscribed expert keeps (``drop_policy``):

* ``"probs"``: its ``C`` pairs of highest combine weight (the routed score after ``route_norm``
  and ``route_scale``, in float32); equal weights keep the earlier token;
* ``"position"``: its first ``C`` pairs in token order (the earliest tokens).

A dropped pair is not sent to its expert: the token gets no output from that expert and no
gradient through it (neither to the token nor to its score), as if it had not selected the
expert; its other experts, the shared experts and the residual still apply. The router losses
and ``tokens_per_expert`` use the selection before the drop (what the router asked for); the
dropped pairs are counted per expert in the router's ``dropped_per_expert`` and reported by
:func:`~dtensor_moe.moe.load_stats`.

The exchange receives dropped pairs as expert id ``E`` (one past the last expert) and a
:class:`Capacity`. Without ``pad_to_capacity`` the routed buffer holds only the kept pairs: its
length is data, read on the host once per forward (the expert-parallel exchange reads its
sizes anyway). With ``pad_to_capacity`` every expert's group is exactly ``C`` rows, zero-padded:
every shape is known before the step, no count is read on the host, and the expert-parallel
exchange needs neither the count exchange nor a host read (the sync-free path, Note [Static
exchange at capacity] in ``dtensor_moe/routed/all_to_all.py``). Padding rows are zeros, which
the experts map to zeros and which give no gradient.
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import math

import torch

from dtensor_moe.routed.layouts import Capacity

__all__ = ["Capacity", "capacity_keep", "expert_capacity"]


def expert_capacity(
    num_tokens: int, *, top_k: int, num_experts: int, factor: float, multiple: int = 1
) -> int:
    """``C = ceil(factor * num_tokens * top_k / num_experts)``, rounded up to ``multiple``.

    Exact for the factors people use: the product is rounded to 9 decimals before the ceiling,
    so that ``1.1 * 10 * 1 / 11`` is 1 and not 2 from the binary ``1.1`` being a little above
    1.1. A positive product below that rounding (a factor such as ``1e-12``) still gives 1, as
    the ceiling does, never 0. Plain float arithmetic, which ``torch.compile`` traces.
    """
    raw = factor * num_tokens * top_k / num_experts
    per_expert = math.ceil(round(raw, 9))
    if per_expert == 0 and raw > 0:  # rounded to 0, but ceil of a positive number is >= 1
        per_expert = 1
    return round_up(per_expert, multiple)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def capacity_keep(
    topk_ids_TK: torch.Tensor,
    topk_scores_TK: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    capacity: int,
    policy: str,
) -> torch.Tensor:
    """Which (token, expert) pairs their expert keeps (bool ``(T, K)``); Note [Expert capacity].

    ``counts_E``: the pairs of ``topk_ids_TK`` per expert (the router's ``expert_counts``).
    Static shapes throughout (sorts and gathers), no host read: traces under
    ``torch.compile``. ``topk_scores_TK`` is read only for ``policy="probs"``.
    """
    T, K = topk_ids_TK.shape
    ids_N = topk_ids_TK.reshape(-1)
    N = ids_N.numel()
    if policy == "probs":
        # best score first (stable: equal scores keep token order), then grouped by expert
        by_score_N = torch.argsort(-topk_scores_TK.detach().float().reshape(-1), stable=True)
        order_N = by_score_N.index_select(0, torch.argsort(ids_N[by_score_N], stable=True))
    else:
        order_N = torch.argsort(ids_N, stable=True)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_ids_N = ids_N.index_select(0, order_N)
    rank_N = torch.arange(N, device=ids_N.device) - starts_E.index_select(0, sorted_ids_N)
    keep_N = torch.empty(N, dtype=torch.bool, device=ids_N.device)
    keep_N.index_put_((order_N,), rank_N < capacity)
    return keep_N.view(T, K)
