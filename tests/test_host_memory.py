"""parallel/host.py: a CPU trainer keeps freed memory for its next micro-batch (glibc's mallopt), and the
actor applies it unless `actor.retain_freed_memory=false`; an engine server gives it back. Each case
runs in a fresh process, since the setting is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# RSS before and after freeing a 256 MiB tensor (bytes), after `setup` ran
PROBE = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch
{setup}
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
x = torch.ones(64 << 20)
held = rss()
del x
print(json.dumps({{"applied": globals().get("applied"), "held": held, "freed": rss()}}))
"""


def _probe(setup: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), setup=setup)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc are Linux's")


def test_freed_memory_stays_in_the_process_only_when_retained():
    default = _probe("")
    kept = _probe("from parallel.host import retain_freed_memory\napplied = retain_freed_memory()")
    assert default["held"] - default["freed"] > 200 << 20  # glibc unmapped the 256 MiB block at once
    assert kept["applied"] is True
    assert kept["held"] - kept["freed"] < 16 << 20  # kept for the next allocation of that size


@pytest.mark.parametrize("retain", [True, False])
def test_the_cpu_actor_applies_it_unless_turned_off(retain):
    setup = (f"from engines.models import resolve_model\nfrom engines.training.config import ActorConfig\n"
             f"from engines.training.torch_actor import TorchActor\n"
             f"TorchActor(ActorConfig(retain_freed_memory={retain}), str(resolve_model('tiny-llama')), progress=False)")
    got = _probe(setup)
    released = got["held"] - got["freed"]
    assert (released < 16 << 20) if retain else (released > 200 << 20), got


# freed memory kept, then an update: the actor hands what was kept back when the update ends
UPDATE = """
import json, os, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "benchmarks"))
import torch
from engines.training.losses import LossConfig
from engines.models import resolve_model
from engines.training.config import ActorConfig
from engines.training.torch_actor import TorchActor
from micro_batches import demo_batch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
actor = TorchActor(ActorConfig(lr=1e-6, micro_batch_size=4), str(resolve_model("tiny-llama")), progress=False)
actor._retaining = {release}
batch = demo_batch(int(actor.module.config.vocab_size), 4)
advantages = torch.randn(len(batch))[:, None] * batch.response_mask
actor.update(batch, advantages, None, None, LossConfig())  # what the first update keeps for good (optimizer
x = torch.ones(64 << 20)                                     # state, kernel caches) is not counted below
del x
kept = rss()
actor.update(batch, advantages, None, None, LossConfig())
print(json.dumps({{"kept": kept, "after": rss()}}))
"""


@pytest.mark.parametrize("release", [True, False])
def test_the_actor_hands_kept_memory_back_when_an_update_ends(release):
    """Retained through an update, not for good: a long run's one long batch does not raise the
    trainer's RSS between steps for the rest of the run."""
    out = subprocess.run([sys.executable, "-c", UPDATE.format(root=str(ROOT), release=release)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    given_back = got["kept"] - got["after"]
    assert (given_back > 200 << 20) if release else (given_back < 64 << 20), got  # the 256 MiB block's pages


# An engine step's pattern: a large block freed (glibc's dynamic thresholds rise with it: mmap to its
# 16 MiB, trim to twice that), then 64 MiB of mid-sized blocks from the heap, freed: by default the heap
# keeps up to 32 MiB of them (measured: 33 of 64 MiB given back)
HOLES = """
import json, os, sys
sys.path.insert(0, {root!r})
{setup}
import torch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
big = torch.ones(4 << 20)
del big
blocks = [torch.ones(256 << 10) for _ in range(64)]
held = rss()
del blocks
print(json.dumps({{"applied": globals().get("applied"), "held": held, "freed": rss(),
                  "caches": [os.environ.get(k) for k in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")]}}))
"""


def test_an_engine_server_gives_freed_blocks_back_and_caps_the_shape_caches():
    def run(setup: str) -> dict:
        out = subprocess.run([sys.executable, "-c", HOLES.format(root=str(ROOT), setup=setup)], capture_output=True,
                             text=True, timeout=300, env={k: v for k, v in os.environ.items()
                                                          if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    default = run("")
    bounded = run("from parallel.host import bound_freed_memory\napplied = bound_freed_memory()")
    assert default["held"] - default["freed"] < 48 << 20, default  # 64 MiB freed, at least 16 kept
    assert bounded["applied"] is True and bounded["held"] - bounded["freed"] > 60 << 20, bounded  # all unmapped
    assert default["caches"] == [None, None] and bounded["caches"] == ["16", "64"]


def test_the_transformers_engines_servers_bound_their_heap():
    from engines.inference import ENGINES

    assert {name for name, spec in ENGINES.items() if spec.bounded_heap} == {"hf", "hf_reward"}
    assert "bound_freed_memory()" in (ROOT / "rollout/bus/server.py").read_text()
