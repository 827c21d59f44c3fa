"""Rollout -> trainer handoff: each data-parallel rank receives only its own rows, as tensors.

Rank 0 holds the step's whole batch (its agent workers built it). It cuts the batch into one
shard per data-parallel replica at GRPO group boundaries (`group_shards`), packs each shard's
tensors into one flat byte buffer and sends every rank the buffer of its replica, point to point
(gloo for CPU tensors, NCCL for CUDA ones). Only the shapes travel as a (tiny) pickled header.
The per-row Python lists (turns, termination, request ids) stay on rank 0, where the step's
metrics and traces are made; other ranks' shards carry empty placeholders for them.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from engines.training.batch import TENSOR_FIELDS, Batch, group_shards
from rollout.weights.codec import tensor_from_raw, tensor_to_raw


def _pixel_fields(batch: Batch) -> dict[str, torch.Tensor]:
    """A batch's images as two tensors: images per row, and every row's pixel values in order."""
    if not batch.pixel_values:
        return {}
    found = [pv for pv in batch.pixel_values if pv is not None]
    counts = torch.tensor([0 if pv is None else len(pv) for pv in batch.pixel_values], dtype=torch.long)
    return {"pixel_counts": counts, "pixel_values": torch.cat(found) if found else torch.zeros(0, 1, 1, 1)}


def pack(batch: Batch) -> tuple[torch.Tensor, list[tuple[str, str, list[int]]]]:
    """A shard's tensors as one flat uint8 tensor, and the (name, dtype, shape) to unpack it
    (each tensor's bytes as `weight_sync.tensor_to_raw` gives them); the rows' images too."""
    parts, layout = [], []
    fields = {name: getattr(batch, name) for name in TENSOR_FIELDS}
    for name, tensor in {**fields, **_pixel_fields(batch)}.items():
        raw, dtype, shape = tensor_to_raw(tensor)
        parts.append(raw)
        layout.append((name, dtype, shape))
    return torch.cat(parts), layout


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * getattr(torch, dtype).itemsize


def unpack(flat: torch.Tensor, layout: list[tuple[str, str, list[int]]], global_size: int) -> Batch:
    """Undo `pack`: a shard whose per-row lists are placeholders (they stay on rank 0)."""
    tensors, at = {}, 0
    for name, dtype, shape in layout:
        size = _nbytes(dtype, shape)
        tensors[name] = tensor_from_raw(flat[at:at + size].clone(), dtype, shape, name)  # clone: aligned for view
        at += size
    n = int(tensors["prompts"].shape[0])
    pixels: list[torch.Tensor | None] = []
    if "pixel_counts" in tensors:
        counts, flat_pv = tensors.pop("pixel_counts").tolist(), tensors.pop("pixel_values")
        sizes = [c for c in counts if c]
        parts = iter(flat_pv.split(sizes) if sizes else ())
        pixels = [next(parts) if c else None for c in counts]
    return Batch(**tensors, pixel_values=pixels, num_turns=[0] * n, termination=[""] * n, weight_versions=[[] for _ in range(n)],
                 reward_extra={}, request_ids=[[] for _ in range(n)], session_ids=[""] * n, errors=[""] * n,
                 turns=[[] for _ in range(n)], global_size=global_size)


def hand_out(batch: Batch | None, replica_of: list[int], rank: int, device: torch.device | None = None
             ) -> tuple[Batch, dict[str, float]]:
    """Every rank calls this; rank 0 passes the whole batch. `replica_of[r]` is rank r's data-
    parallel index (ranks of one replica, e.g. its tensor/pipeline ranks, get the same shard).
    Returns this rank's shard and the handoff's cost as metrics (rank 0's view)."""
    t0 = time.perf_counter()
    replicas = max(replica_of) + 1
    header: list[Any] = [None]
    if rank == 0:
        assert batch is not None
        shards = [batch.shard(rows) for rows in group_shards(batch.group_index, replicas)]
        packed = [pack(s) for s in shards]
        header = [(len(batch), [layout for _, layout in packed])]
    dist.broadcast_object_list(header, src=0)
    total, layouts = header[0]
    mine = replica_of[rank]
    if rank == 0:
        sends = []
        for r, replica in enumerate(replica_of):
            if r != 0:
                flat = packed[replica][0]
                sends.append(dist.isend(flat.to(device) if device is not None else flat, dst=r))
        for s in sends:
            s.wait()
        sent = sum(int(packed[replica][0].numel()) for replica in replica_of[1:])
        rows_sent = sum(len(shards[replica]) for replica in replica_of[1:])
        return shards[mine], {"handoff/seconds": time.perf_counter() - t0, "handoff/bytes_sent": float(sent),
                              "handoff/rows_sent": float(rows_sent), "handoff/rows_local": float(len(shards[mine])),
                              "handoff/replicas": float(replicas)}
    size = sum(_nbytes(dtype, shape) for _, dtype, shape in layouts[mine])
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    dist.recv(buf, src=0)
    return unpack(buf.cpu(), layouts[mine], total), {}
