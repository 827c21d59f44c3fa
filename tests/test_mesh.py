"""A rank's GPU (parallel/mesh.py `local_gpu`): its LOCAL_RANK, or several ranks to a GPU when
$SWITCHYARD_RANKS_PER_GPU says so (the smoke suite's two-rank checks on one GPU); a rank left without a
GPU is refused naming the fix instead of failing later in a CUDA call. CUDA's device count is stood in."""

from __future__ import annotations

import pytest
import torch

from parallel.mesh import local_gpu


@pytest.mark.parametrize("local, per, gpus, want", [(0, None, 1, 0), (3, None, 8, 3), (1, "2", 1, 0), (3, "2", 2, 1)])
def test_a_rank_gets_its_gpu(monkeypatch: pytest.MonkeyPatch, local: int, per: str | None, gpus: int, want: int):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local))
    if per is None:
        monkeypatch.delenv("SWITCHYARD_RANKS_PER_GPU", raising=False)
    else:
        monkeypatch.setenv("SWITCHYARD_RANKS_PER_GPU", per)
    assert local_gpu() == want


def test_a_rank_without_a_gpu_is_refused_naming_the_fix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("SWITCHYARD_RANKS_PER_GPU", raising=False)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 has no GPU of its own: this node has 1; start torchrun with "
                                           r"--nproc-per-node 1 or fewer"):
        local_gpu()
