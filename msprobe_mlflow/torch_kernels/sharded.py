"""Statistics of sharded gradients (FSDP2's DTensors): those of the full gradient, without gathering it.

Each rank reduces its own shard to a few numbers per parameter (max, -min, the sum of squares, the L2 cumulative
counts and the number of NaNs), then one ``all_reduce`` with MAX and one with SUM per process group combine them:
the result equals what an unsharded run records, up to the order of the float additions in the norm. Directions
(L1/L2) are gathered as packed bits (1 bit per element, 1/32 of a float32 gradient), one ``all_gather`` per step,
and reassembled into the full parameter's bits on the writer thread, so they compare with an unsharded run's. MD5
(L0) needs every byte of the gradient: at L0 a sharded gradient is gathered (``full_tensor()``).

Every rank ends with the same full statistics, as under DDP; each rank the config's ``rank`` list selects writes
them to its ``rank{R}`` folder (``rank: [0]`` writes them once). Every rank must take part in the collectives,
whether it writes or not. Supported: DTensors sharded on one mesh dimension (FSDP2, HSDP's replicated dimension
is not reduced); plain tensors beside them are not reduced. FSDP1's gradients come as :class:`FlatPiece` objects (each
original parameter's piece of the flat shard, from :mod:`msprobe_mlflow.pytorch.fsdp1`): reduced the same way, their
sign bits gathered with each piece's start, since pieces begin anywhere in the flattened parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from msprobe_mlflow.layout import (CUMULATIVE_COUNTS, EXPONENT_COUNTS, EXTRA, EXTREMES, StatisticsLayout,
                                   packed_length)
from msprobe_mlflow.levels import Level, recorded_level
from msprobe_mlflow.torch_kernels.host_copy import start_host_copy
from msprobe_mlflow.torch_kernels.statistics import (StatisticsCache, _comparable, count_into, exponent_bins,
                                                     launch_step_statistics, pack_signs)
from msprobe_mlflow.records import StepRecord, record_from_statistics
from msprobe_mlflow.statistics_table import EXPONENT_BINS, Statistic, extra_statistics, float32_bounds


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def has_sharded(grads: list) -> bool:
    DTensor = _dtensor_type()
    kinds = {type(g) for g in grads}
    return any(issubclass(kind, FlatPiece) or (DTensor is not None and issubclass(kind, DTensor)) for kind in kinds)


@dataclass(frozen=True)
class FlatPiece:
    """An FSDP1 gradient: ``piece`` is elements ``[start, start + piece.numel())`` of the full gradient (``shape``)
    flattened, split over ``group`` (None: this rank holds it all). ``capacity`` is the most elements any rank's
    piece can hold, the same on every rank of the group."""

    piece: torch.Tensor
    shape: torch.Size
    start: int
    capacity: int
    group: object = None

    @property
    def dtype(self) -> torch.dtype:
        return self.piece.dtype

    def stand_in(self) -> torch.Tensor:
        """A tensor of the full gradient's shape and dtype, no storage: what the layout and record need."""
        return torch.empty(self.shape, dtype=self.piece.dtype, device="meta")


@dataclass(frozen=True)
class _Sharding:
    """How a gradient is split: along tensor ``dim`` over ``group`` (None: not split, this rank holds it all)."""

    group: object = None
    dim: int = 0

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def shard_shape(self, shape: torch.Size, index: int) -> list[int]:
        """The shape of group rank ``index``'s shard: ``torch.chunk``'s split along ``dim``, as DTensor's ``Shard``."""
        if self.group is None:
            return list(shape)
        length, shard = shape[self.dim], list(shape)
        chunk = -(-length // self.world)
        shard[self.dim] = max(0, min(chunk, length - chunk * index))
        return shard


def _sharding(grad: torch.Tensor, name: str) -> _Sharding:
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(grad, DTensor):
        return _Sharding()
    sharded = [(mesh_dim, p) for mesh_dim, p in enumerate(grad.placements) if p.is_shard()]
    if any(p.is_partial() for p in grad.placements):
        raise ValueError(f"gradient of {name!r} is a partial (not yet reduced) DTensor, placements "
                         f"{grad.placements}; expected Shard or Replicate placements")
    if len(sharded) > 1:
        raise NotImplementedError(f"gradient of {name!r} is sharded on {len(sharded)} mesh dimensions "
                                  f"({grad.placements}); one sharded dimension (FSDP2, HSDP) is supported")
    if not sharded:
        return _Sharding()
    mesh_dim, placement = sharded[0]
    return _Sharding(grad.device_mesh.get_group(mesh_dim), placement.dim)


def launch_sharded_statistics(names: list[str], grads: list[torch.Tensor], *, rank: int, step: int,
                              level: str | Level, bounds: tuple, checksum: str = "md5", directions: bool = True,
                              extra=(), cache: StatisticsCache | None = None) -> Callable[[], StepRecord]:
    """Like :func:`~msprobe_mlflow.torch_kernels.statistics.launch_step_statistics`, for gradients of which some are
    DTensors: the record holds each full gradient's statistics. A collective: every rank of each gradient's
    process group must call it, with the same parameters in the same order."""
    level = recorded_level(level)
    if level.has_md5:
        full = [_gather_flat(g) if isinstance(g, FlatPiece) else
                g.full_tensor() if isinstance(g, _dtensor_type()) else g for g in grads]
        return launch_step_statistics(names, full, rank=rank, step=step, level=level, bounds=bounds,
                                      checksum=checksum, directions=directions, extra=extra, cache=cache)
    shardings = [g if isinstance(g, FlatPiece) else _sharding(g, n) for g, n in zip(grads, names)]
    locals_ = [g.piece if isinstance(g, FlatPiece) else g.to_local() if isinstance(g, _dtensor_type()) else g
               for g in grads]
    grads = [g.stand_in() if isinstance(g, FlatPiece) else g for g in grads]
    groups: dict[object, list[int]] = {}  # FSDP1's pieces and DTensors' shards of one group apart
    for index, sharding in enumerate(shardings):
        groups.setdefault((isinstance(sharding, FlatPiece), sharding.group), []).append(index)
    order = [i for members in groups.values() for i in members]  # each group's rows contiguous
    bounds32, statistics = float32_bounds(bounds), extra_statistics(extra)
    extremes, sums = _partials([locals_[i] for i in order], bounds32, level, statistics)
    start, gathered = 0, []
    for group, members in groups.items():
        rows = slice(start, start + len(members))
        start += len(members)
        if group[1] is not None:
            dist.all_reduce(extremes[rows], op=dist.ReduceOp.MAX, group=group[1])
            dist.all_reduce(sums[rows], op=dist.ReduceOp.SUM, group=group[1])
        if level.has_directions and directions:
            gathered.append(_gather_flat_signs([shardings[i] for i in members]) if group[0] else
                            _gather_signs([(locals_[i], grads[i].shape, shardings[i]) for i in members]))
    statistics_host = start_host_copy(_full_statistics(extremes, sums, [grads[i] for i in order], level, bounds32,
                                                       statistics))
    signs_host = [(members, start_host_copy(bits), assemble) for members, (bits, assemble)
                  in zip(groups.values(), gathered)]

    def resolve() -> StepRecord:
        layout = StatisticsLayout(level, bounds32, [g.numel() for g in grads], extra=extra)
        signs = {}
        for members, bits, assemble in signs_host:
            signs.update(zip(members, assemble(bits())))
        ordered_signs = np.concatenate([np.zeros(0, np.uint8), *(signs[i] for i in order)]) if signs else None
        statistics, packed, _ = layout.merge([(order, (statistics_host(), ordered_signs, None))])
        return record_from_statistics(rank=rank, step=step, level=level, bounds=bounds, names=names,
                                      shapes=[g.shape for g in grads], statistics=statistics, signs=packed,
                                      directions=directions, extra=extra)

    return resolve


def _partials(shards: list[torch.Tensor], bounds32, level: Level, extra: tuple[Statistic, ...] = ()
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per shard, ``(max, -min, extra maxima or -minima...)`` (reduced with MAX) and ``(sum of squares, [counts
    x <= b..., x == 0], [exponent counts...], extra sums..., NaN flags of the extra maxima and minima..., +0.0s,
    -0.0s, NaNs)`` (reduced with SUM), float64 on the shards' device. An empty shard gives ``-inf`` extremes and
    zeros."""
    extremes, sums = [], []
    for shard in shards:
        values = _comparable(shard)
        norm = torch.linalg.vector_norm(shard, dtype=None if values is shard else torch.float32)  # not yet rounded
        mapped = [s.element(values).double() for s in extra]
        added = [m.sum() for m, s in zip(mapped, extra) if s.reduction == "sum"]
        nowhere = torch.full((), -math.inf, dtype=torch.float64, device=shard.device)  # an empty shard's
        largest = [nowhere if not values.numel() else m.amax() if s.reduction == "max" else -m.amin()
                   for m, s in zip(mapped, extra) if s.reduction != "sum"]
        if values.numel():
            minimum, maximum = torch.aminmax(shard)
            extremes.append(torch.stack([maximum.float().double(), -minimum.float().double(),
                                         *(torch.where(v.isnan(), nowhere, v) for v in largest)]))
        else:
            extremes.append(torch.stack([nowhere, nowhere, *largest]))
        counts = [(values <= float(b)).sum() for b in bounds32] + [(values == 0).sum()] if level.has_buckets else []
        exponents = count_into(values.new_zeros(EXPONENT_BINS, dtype=torch.int64), exponent_bins(values)) \
            if level.has_exponents else values.new_zeros(0, dtype=torch.int64)
        sums.append(torch.cat([torch.stack([norm.double() ** 2, *[c.double() for c in counts]]), exponents.double(),
                               torch.stack([*added, *(v.isnan().double() for v in largest), *_signed_zeros(values),
                                            values.isnan().sum().double()])]))
    return torch.stack(extremes), torch.stack(sums)


def _signed_zeros(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The numbers of +0.0 and of -0.0 elements (``aminmax`` does not order them; the record does)."""
    zeros = values == 0
    negative = (zeros & values.signbit()).sum().double()
    return zeros.sum().double() - negative, negative


def _full_statistics(extremes: torch.Tensor, sums: torch.Tensor, grads: list[torch.Tensor], level: Level,
                     bounds32, extra: tuple[Statistic, ...] = ()) -> torch.Tensor:
    """The layout's flat vector from the reduced partials: max and min NaN where a NaN was seen (as
    ``aminmax`` over the full gradient gives) or the parameter is empty, a zero max +0.0 and a zero min -0.0 when
    the gradient holds one (as the unsharded paths order them); the norm rounded as the unsharded path rounds it
    (to the gradient's dtype when narrower, then to float32)."""
    layout = StatisticsLayout(level, bounds32, [g.numel() for g in grads], extra=[s.name for s in extra])
    undefined = (sums[:, -1] > 0) | (extremes[:, 0] == -math.inf)
    nan = torch.full_like(extremes[:, 0], math.nan)
    positive_zeros, negative_zeros = sums[:, -3] > 0, sums[:, -2] > 0
    zero = torch.zeros_like(nan)
    maximum = torch.where(extremes[:, 0] == 0, torch.where(positive_zeros, zero, -zero), extremes[:, 0])
    minimum = torch.where(extremes[:, 1] == 0, torch.where(negative_zeros, -zero, zero), -extremes[:, 1])
    maximum, minimum = torch.where(undefined, nan, maximum), torch.where(undefined, nan, minimum)
    norm = sums[:, 0].sqrt()
    narrow = [(i, g.dtype) for i, g in enumerate(grads) if g.dtype not in (torch.float32, torch.float64)]
    if len(narrow) == len(grads) and len({dtype for _, dtype in narrow}) == 1:  # one kernel for a bf16 model
        norm = norm.to(narrow[0][1])
    else:
        norm = norm.clone()
        for i, dtype in narrow:
            norm[i:i + 1] = norm[i:i + 1].to(dtype).double()
    norm = norm.float().double()
    rows = torch.stack([maximum, minimum, norm], dim=1)
    added = sum(s.reduction == "sum" for s in extra)
    buckets = len(bounds32) + 1 if layout.level.has_buckets else 0
    counted = sums.shape[1] - 4 - len(extra)  # the bucket, zero and exponent counts
    extras = _extra_columns(extremes[:, 2:], sums[:, 1 + counted:1 + counted + added],
                            sums[:, 1 + counted + added:-3], extra)
    return torch.cat(layout.in_order({EXTREMES: rows, CUMULATIVE_COUNTS: sums[:, 1:1 + buckets],
                                      EXPONENT_COUNTS: sums[:, 1 + buckets:1 + counted], EXTRA: extras}))


def _extra_columns(largest: torch.Tensor, added: torch.Tensor, nan_flags: torch.Tensor,
                   extra: tuple[Statistic, ...]) -> torch.Tensor:
    """The extra statistics' values, in their order, from the reduced partials: sums as they are; maxima (minima
    negated back) NaN where a shard's was NaN or every shard was empty."""
    sums, extremes, columns = iter(added.T), iter(zip(largest.T, nan_flags.T)), []
    for statistic in extra:
        if statistic.reduction == "sum":
            columns.append(next(sums))
            continue
        value, flag = next(extremes)
        signed = value if statistic.reduction == "max" else -value
        columns.append(torch.where((flag > 0) | (value == -math.inf), math.nan, signed))
    return torch.stack(columns, dim=1) if columns else added


def _gather_signs(members: list[tuple[torch.Tensor, torch.Size, _Sharding]]):
    """Each shard's packed ``> 0`` bits, padded to the longest shard's, gathered from every rank of the members'
    group (one ``all_gather``; none for gradients not split), and the host function that reassembles them into each
    full parameter's packed bits."""
    group, world = members[0][2].group, members[0][2].world  # one group; each member has its own sharded dim
    widths, padded = [], []
    for local, shape, sharding in members:
        width = max(packed_length(math.prod(sharding.shard_shape(shape, r))) for r in range(world))
        bits = pack_signs([local])
        padded.append(torch.cat([bits, bits.new_zeros(width - bits.numel())]))
        widths.append(width)
    everyone = _all_gather(torch.cat(padded), group, world)

    def assemble(host: np.ndarray) -> list[np.ndarray]:
        per_rank, full, offset = host.reshape(world, -1), [], 0
        for (_, shape, sharding), width in zip(members, widths):
            pieces = []
            for r in range(world):
                shard_shape = sharding.shard_shape(shape, r)
                bits = np.unpackbits(per_rank[r, offset:offset + width], count=math.prod(shard_shape))
                pieces.append(bits.reshape(shard_shape))
            joined = pieces[0] if world == 1 else np.concatenate(pieces, axis=sharding.dim)
            full.append(np.packbits(joined.reshape(-1)))
            offset += width
        return full
    return everyone, assemble


def _all_gather(mine: torch.Tensor, group, world: int) -> torch.Tensor:
    """Every rank's ``mine`` (the same length on each), concatenated in group rank order: one collective."""
    if world == 1:
        return mine
    everyone = mine.new_empty(world * mine.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its newer name
    gather(everyone, mine, group=group)
    return everyone


_HEADER = 16  # bytes before each piece's bits: its start and its length, int64 each


def _gather_flat_signs(pieces: list[FlatPiece]):
    """Like :func:`_gather_signs` for FSDP1's pieces, which start anywhere in the flattened gradient (not on a
    byte): each piece's start and length travel as a header before its bits, padded to its capacity."""
    group = pieces[0].group
    world = 1 if group is None else dist.get_world_size(group)
    widths, padded = [], []
    headers = torch.tensor([[flat.start, flat.piece.numel()] for flat in pieces], dtype=torch.int64)
    headers = headers.view(torch.uint8).to(pieces[0].piece.device)  # one copy to the device per step, not per piece
    for flat, header in zip(pieces, headers):
        width = _HEADER + packed_length(min(flat.capacity, math.prod(flat.shape)))
        row = torch.cat([header, pack_signs([flat.piece])])
        padded.append(torch.cat([row, row.new_zeros(width - row.numel())]))
        widths.append(width)
    everyone = _all_gather(torch.cat(padded), group, world)

    def assemble(host: np.ndarray) -> list[np.ndarray]:
        per_rank, full, offset = host.reshape(world, -1), [], 0
        for flat, width in zip(pieces, widths):
            joined = np.zeros(math.prod(flat.shape), np.uint8)
            for r in range(world):
                start, length = (int(v) for v in per_rank[r, offset:offset + _HEADER].copy().view(np.int64))
                packed = per_rank[r, offset + _HEADER:offset + width]
                joined[start:start + length] = np.unpackbits(packed, count=length)
            full.append(np.packbits(joined))
            offset += width
        return full
    return everyone, assemble


def _gather_flat(flat: FlatPiece) -> torch.Tensor:
    """The full gradient from every rank's piece (for MD5, which needs every byte): one ``all_gather`` of the
    pieces padded to their capacity, one of their starts and lengths."""
    if flat.group is None:
        return flat.piece.reshape(flat.shape)
    world = dist.get_world_size(flat.group)
    padded = torch.cat([flat.piece, flat.piece.new_zeros(flat.capacity - flat.piece.numel())])
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=flat.group)
    place = torch.tensor([flat.start, flat.piece.numel()], dtype=torch.int64, device=padded.device)
    places = [torch.empty_like(place) for _ in range(world)]
    dist.all_gather(places, place, group=flat.group)
    full = flat.piece.new_zeros(math.prod(flat.shape))
    for piece, (start, length) in zip(pieces, (p.tolist() for p in places)):
        full[start:start + length] = piece[:length]
    return full.reshape(flat.shape)
