"""The hf_reward engine: a scalar reward model served on the bus, batched and padded, scoring
every prompt exactly as the same model does on that prompt alone.

The models are tiny sequence classifiers built from a config here (no download), with a word-level
tokenizer saved beside them. Every score is checked against a plain transformers forward over the
unpadded prompt: a batched forward that read a row at the wrong token or shifted its positions would
score the shorter rows differently. Position shifts only show on absolute positions (GPT-2): rotary
attention (llama) depends on relative positions alone, so a constant shift leaves it unchanged.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from engines.inference import ENGINES, ROLLOUT_ENGINES, make_engine
from engines.inference.base import SamplingParams
from engines.inference.hf_reward import HFRewardEngine
from rollout.bus import protocol as P
from rollout.bus.client import GenerateClient

VOCAB = 96
PAD = 0
WORDS = [f"w{i}" for i in range(VOCAB - 3)]
# six conversations of different lengths (1 to 41 tokens); one holds the pad token mid-way, which
# must not move where it is read
_WORDS = [[WORDS[(7 * i + 3 * k) % len(WORDS)] for k in range(n)] for i, n in enumerate((5, 17, 1, 41, 9, 26))]
_WORDS[4][2] = "<pad>"
TEXTS = [" ".join(words) for words in _WORDS]


@pytest.fixture(scope="module")
def reward_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama (rotary positions) or, with the param "gpt2", a 2-layer GPT-2 (absolute
    positions, which a left-padded forward without position ids would shift), each with a
    one-output score head, seeded, saved with its tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (GPT2Config, GPT2ForSequenceClassification, LlamaConfig, LlamaForSequenceClassification,
                              PreTrainedTokenizerFast)

    family = getattr(request, "param", "llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if family == "llama":
            model = LlamaForSequenceClassification(LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=128, num_labels=1, pad_token_id=PAD, eos_token_id=1))
        else:
            model = GPT2ForSequenceClassification(GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, num_labels=1, pad_token_id=PAD,
                eos_token_id=1, bos_token_id=1))
        with torch.no_grad():  # a head of std 1, not 0.02: scores of order 1 that differ from token to token
            model.score.weight.normal_(0.0, 1.0)
    model.eval()
    path = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(path)
    vocab = {"<pad>": PAD, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts(reward_model: Path) -> list[list[int]]:
    from engines.models import load_tokenizer

    tokenizer = load_tokenizer(str(reward_model))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert sorted(map(len, ids)) == [1, 5, 9, 17, 26, 41] and PAD in ids[4][1:-1] and 2 not in sum(ids, [])
    return ids


@pytest.fixture(scope="module")
def expected(reward_model: Path, prompts: list[list[int]]) -> list[float]:
    """Each prompt scored alone, unpadded, by the model loaded straight from its directory."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()
    with torch.no_grad():
        scores = [model(input_ids=torch.tensor([p])).logits[0, 0].item() for p in prompts]
    # the check has teeth: scores differ from one prompt to the next, and from what a row would get
    # read one token early (where a wrong pooling position lands)
    early = [model(input_ids=torch.tensor([p[:-1]])).logits[0, 0].item() for p in prompts if len(p) > 1]
    assert min(abs(a - b) for i, a in enumerate(scores) for b in scores[i + 1:]) > 1e-2
    assert min(abs(a - b) for a, b in zip([s for s, p in zip(scores, prompts) if len(p) > 1], early)) > 1e-2
    return scores


@pytest.mark.parametrize("reward_model", ["llama", "gpt2"], indirect=True)
def test_a_batch_of_six_scores_as_six_prompts_alone(reward_model, prompts, expected):
    """In process: the six requests arrive together and are scored in one right-padded forward."""
    forwards: list[list[int]] = []

    async def main() -> list[Any]:
        engine = make_engine("hf_reward", str(reward_model))
        assert isinstance(engine, HFRewardEngine)
        await engine.start()
        score = engine._score
        engine._score = lambda batch: (forwards.append([len(p) for p in batch]), score(batch))[1]  # type: ignore
        try:
            outs = await asyncio.gather(*(engine.generate(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)))
            stats = engine.stats()
            assert (stats.waiting, stats.running, stats.generated_tokens) == (0, 0, 0)
            assert stats.prompt_tokens == sum(map(len, prompts))
            with pytest.raises(RuntimeError, match="reward model, which takes no weight updates"):
                await engine.update_weights([("score.weight", torch.zeros(1, 32))])
            with pytest.raises(ValueError, match="level 2 discards the weights"):
                await engine.sleep(2)
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await engine.generate("bad", [5, VOCAB], SamplingParams())
            return outs
        finally:
            await engine.close()

    outs = asyncio.run(main())
    assert forwards == [[len(p) for p in prompts]]  # one forward held all six
    for out, want in zip(outs, expected):
        assert (out.token_ids, out.logprobs, out.finish_reason) == ([], [], "stop")
        assert out.score == pytest.approx(want, abs=1e-4)


def test_scores_over_the_bus_match_and_generations_carry_none(servers, reward_model, prompts, expected):
    """A real hf_reward server process and a real GenerateClient; an echo server's generations say None."""
    rm = servers(1, backend="hf_reward", model=str(reward_model))
    echo = servers(1, backend="echo", model="echo")

    async def main() -> tuple[list[Any], Any]:
        async with GenerateClient(rm.addresses) as client, GenerateClient(echo.addresses) as plain:
            await asyncio.gather(client.wait_ready(timeout_s=120), plain.wait_ready(timeout_s=60))
            results = await asyncio.gather(*(client.generate(p, {"max_tokens": 1}) for p in prompts))
            status = (await client.status(0)).stats
            assert status["requests"] == len(prompts) and status["prompt_tokens"] == sum(map(len, prompts))
            return results, await plain.generate([5, 6, 7], {"max_tokens": 3})

    try:
        results, generation = asyncio.run(main())
    except Exception:
        print(rm.logs())
        raise
    for r, want in zip(results, expected):
        assert (r.token_ids, r.logprobs, r.finish_reason) == ([], [], "stop")
        assert r.score == pytest.approx(want, abs=1e-4)
    assert generation.token_ids == [5, 6, 7] and generation.score is None


def test_score_on_the_wire_and_the_registry():
    """`score` rides in the Result header: a float or nil; a header without it (an older peer) is None."""
    r = P.decode([bytes(f) for f in P.Result(rid="r", finish_reason="stop", score=-1.25).encode()])
    assert isinstance(r, P.Result) and r.score == -1.25
    first, *arrays = [bytes(f) for f in P.Result(rid="r").encode()]
    head = msgpack.unpackb(first)
    assert head["score"] is None and P.decode([msgpack.packb(head), *arrays]).score is None
    del head["score"]
    assert P.decode([msgpack.packb(head), *arrays]).score is None
    for bad in ("0.5", True):
        with pytest.raises(P.ProtocolError, match="result.score must be float"):
            P.decode([msgpack.packb({**head, "score": bad}), *arrays])
    assert not ENGINES["hf_reward"].rollout and "hf_reward" not in ROLLOUT_ENGINES


def test_a_causal_lm_checkpoint_is_refused(tmp_path):
    """Loading a policy checkpoint as a reward model would score with a random head: refused by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, pad_token_id=PAD)).save_pretrained(tmp_path)

    async def main() -> None:
        engine = HFRewardEngine(str(tmp_path))
        try:
            await engine.start()
        finally:
            await engine.close()

    with pytest.raises(ValueError, match="not a reward model checkpoint.*score.weight"):
        asyncio.run(main())


def test_a_scalar_reward_model_scores_trajectories_through_the_bus(servers, reward_model):
    """`reward.model.kind: scalar`: each trajectory's conversation is scored by the hf_reward server and
    the score is its outcome, in place of the rule scorer's."""
    from transformers import AutoModelForSequenceClassification

    from agent.loop import AgentLoopOutput
    from agent.rewards.outcome import OutcomeScorer
    from engines.models import load_tokenizer

    rm = servers(1, backend="hf_reward", model=str(reward_model))
    tokenizer = load_tokenizer(str(reward_model))
    pairs = [(TEXTS[i], TEXTS[(i + 1) % len(TEXTS)]) for i in range(4)]  # (question, response)
    rows = [{"prompt": [{"role": "user", "content": q}]} for q, _ in pairs]
    outs = [AgentLoopOutput(prompt_ids=[3], response_ids=tokenizer(r, add_special_tokens=False)["input_ids"],
                            response_mask=[], response_logprobs=[], reward=0.0, num_turns=1, termination="stop",
                            session_id=f"s{i}") for i, (_, r) in enumerate(pairs)]
    for o in outs:
        o.response_mask, o.response_logprobs = [1] * len(o.response_ids), [0.0] * len(o.response_ids)

    async def main() -> None:
        scorer = OutcomeScorer({"model": dict(path=str(reward_model), kind="scalar", addresses=rm.addresses)})
        await scorer.start(timeout_s=120)
        try:
            await asyncio.gather(*(scorer.score(row, o, tokenizer) for row, o in zip(rows, outs)))
        finally:
            await scorer.close()

    asyncio.run(main())
    model = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()
    for (q, r), o in zip(pairs, outs):
        shown = tokenizer.decode(o.response_ids, skip_special_tokens=True)  # what the scorer reads (no <pad>)
        ids = tokenizer(f"{q}\n{shown}", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert o.reward == pytest.approx(want, abs=1e-4) and o.reward_extra["model"] == pytest.approx(want, abs=1e-4)
        assert o.reward_extra["rule"] == 0.0 and o.reward_extra["model_error"] == 0.0 and o.termination == "stop"
        assert o.turns[-1]["kind"] == "judge" and o.turns[-1]["score"] == pytest.approx(want, abs=1e-4)
