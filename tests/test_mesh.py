"""A rank's GPU (parallel/mesh.py `local_gpu`): its LOCAL_RANK, or several ranks to a GPU when
$SWITCHYARD_RANKS_PER_GPU says so (the smoke suite's two-rank checks on one GPU); a rank left without a
GPU is refused naming the fix instead of failing later in a CUDA call. CUDA's device count is stood in.
Where point-to-point tensors travel (`transfer_device`): the GPU only where NCCL carries CUDA tensors;
gloo's send/recv of device memory fails (writev: Bad address, seen on an H200 with two ranks on one GPU)."""

from __future__ import annotations

import pytest
import torch

import torch.distributed as dist

from parallel.mesh import cuda_backend, local_gpu, transfer_device


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


@pytest.mark.parametrize("backend, want", [("nccl", "nccl"), ("gloo", "gloo"), ("cpu:gloo,cuda:nccl", "nccl"),
                                           ("cpu:gloo,cuda:gloo", "gloo"), ("cpu:gloo", "")])
def test_the_backend_of_cuda_tensors(backend: str, want: str):
    assert cuda_backend(backend) == want


@pytest.mark.parametrize("backend, on_gpu", [("cpu:gloo,cuda:nccl", True), ("cpu:gloo,cuda:gloo", False), ("gloo", False)])
def test_tensors_travel_on_the_gpu_only_under_nccl(monkeypatch: pytest.MonkeyPatch, backend: str, on_gpu: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert transfer_device() == (torch.device("cuda", 0) if on_gpu else None)


def test_tensors_travel_on_the_host_without_cuda():
    assert transfer_device() is None  # torch.cuda.is_available() is False here; no process group is asked
