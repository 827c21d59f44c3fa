"""launch/data: row files round trip, validation names row and key, RowStream resumes exactly,
GSM8K conversion, the arithmetic task, and SFT traces that match tool_agent's trajectories."""

from __future__ import annotations

import asyncio
import itertools
import json
import importlib.util
import random
import re
from pathlib import Path
from typing import Any

import pytest

from agent.chat import ChatEncoder
from agent.loop import AgentContext, AgentLoopRegistry
from agent.parsers import get_tool_parser
from agent.rewards import rule_reward
from agent.tool_agent import ToolAgentLoop
from agent.tools.calculator import CalculatorTool, safe_eval
from agent.tools.registry import load_tools
from launch.data import rows_from_source
from launch.data.arithmetic import ArithmeticConfig, arithmetic_rows, generate_problems
from launch.data.arithmetic import main as arithmetic_main
from launch.data.gsm8k import gsm8k_rows, read_gsm8k
from launch.data.gsm8k import main as gsm8k_main
from launch.data.rows import RowError, RowStream, load_rows, save_rows, validate_rows
from launch.data.sft import (IGNORE_INDEX, TraceError, build_sft_examples, calculator_result, encode_sft_example,
                             encoder_for_row, final_answer_text, sft_batches, trace_messages)
from rollout.bus.client import GenerateResult
from scoring import with_outcome

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
TOOLS_YAML = ROOT / "launch" / "configs" / "tools_calculator.yaml"
AGENTS = AgentLoopRegistry().names
HAVE_PYARROW = importlib.util.find_spec("pyarrow") is not None
JANET = {"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast and bakes with four. She "
                     "sells the rest for $2 each. How much does she make every day?",
         "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18"}


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from engines.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))


def _rows() -> list[dict[str, Any]]:
    """Rows that differ in their keys: what trips up one-schema formats like parquet."""
    rows = arithmetic_rows(3, "train", seed=1)
    rows[1]["interaction_kwargs"] = {"name": "gsm8k", "ground_truth": "5"}
    rows[2]["prompt"].append({"role": "assistant", "content": "Let me think."})
    rows[2]["prompt"].append({"role": "user", "content": "Go on."})
    rows[0]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"] = {"create_kwargs": {"ground_truth": 1.5}}
    return rows


# ---------------------------------------------------------------- files and validation

@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_formats_round_trip(tmp_path: Path, suffix: str) -> None:
    if suffix == ".parquet" and not HAVE_PYARROW:
        pytest.skip("parquet support needs pyarrow, which is not installed")
    rows = _rows()
    assert load_rows(str(save_rows(rows, str(tmp_path / f"rows{suffix}")))) == rows


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.csv.*\.jsonl"):
        load_rows(str(tmp_path / "rows.csv"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": []}\n\n{"prompt": [}\n')
    with pytest.raises(RowError, match=r"bad.jsonl:3"):
        load_rows(str(bad))
    (tmp_path / "obj.json").write_text('{"prompt": []}')
    with pytest.raises(RowError, match="list of rows"):
        load_rows(str(tmp_path / "obj.json"))


def test_validate_accepts_generated_rows() -> None:
    validate_rows(_rows(), AGENTS, {"calculator", "calc_gsm8k_reward"}, {"gsm8k"})
    validate_rows(_rows(), None, None)  # None skips the name checks


@pytest.mark.parametrize("edit, pattern", [
    (lambda r: r.pop("prompt"), r"row 2: key 'prompt' must be a non-empty list"),
    (lambda r: r.update(prompt=[]), r"row 2: key 'prompt' must be a non-empty list"),
    (lambda r: r["prompt"].append({"role": "robot", "content": "x"}), r"row 2: key 'prompt\[2\]\.role' is 'robot'"),
    (lambda r: r["prompt"].append({"role": "system", "content": "x"}), r"row 2: key 'prompt\[2\]\.role' is 'system'"),
    (lambda r: r["prompt"].__setitem__(1, {"role": "user", "content": None}), r"row 2: key 'prompt\[1\]\.content'"),
    (lambda r: r["prompt"].pop(1), r"row 2: key 'prompt' has no user message"),
    (lambda r: r.update(agent_name="tool_agnet"), r"row 2: key 'agent_name' is 'tool_agnet'; known: \["),
    (lambda r: r["extra_info"]["tools_kwargs"].update(calculater={}),
     r"row 2: key 'extra_info.tools_kwargs.calculater' names tool 'calculater'"),
    (lambda r: r["extra_info"]["tools"].append("python"), r"row 2: key 'extra_info.tools\[1\]' names tool 'python'"),
    (lambda r: r["reward_model"].pop("ground_truth"), r"row 2: key 'reward_model.ground_truth' is missing"),
    (lambda r: r.update(interaction_kwargs={"name": "tutor"}), r"row 2: key 'interaction_kwargs.name' is 'tutor'"),
])
def test_validation_names_row_and_key(edit: Any, pattern: str) -> None:
    rows = arithmetic_rows(4, "train")
    edit(rows[2])
    with pytest.raises(RowError, match=pattern):
        validate_rows(rows, AGENTS, {"calculator"}, {"gsm8k"})


def test_verl_tool_agent_rows_validate_as_verl_treats_them(capsys) -> None:
    """A row as verl's gsm8k_tool_agent_loop preprocessing writes it: interaction kwargs inside
    extra_info, with query and ground_truth and no name."""
    row = {"data_source": "openai/gsm8k", "agent_name": "tool_agent", "ability": "math",
           "prompt": [{"role": "system", "content": "You are a math expert."}, {"role": "user", "content": "1+1?"}],
           "reward_model": {"style": "rule", "ground_truth": "2"},
           "extra_info": {"split": "train", "index": 0, "answer": "#### 2", "question": "1+1?", "need_tools_kwargs": True,
                          "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "2"}}},
                          "interaction_kwargs": {"query": "1+1?", "ground_truth": "2"}}}
    validate_rows([row], AGENTS, {"calc_gsm8k_reward"}, [])  # no interaction loaded: ignored, with one notice
    assert "1 row(s) carry interaction_kwargs but no interaction is loaded" in capsys.readouterr().err
    validate_rows([row], AGENTS, {"calc_gsm8k_reward"}, {"gsm8k"})  # the only one loaded is the one
    assert capsys.readouterr().err == ""
    with pytest.raises(RowError, match=r"row 0: key 'interaction_kwargs' has no 'name' and 2 interactions"):
        validate_rows([row], AGENTS, {"calc_gsm8k_reward"}, {"gsm8k", "tutor"})


def test_validation_reports_several_rows() -> None:
    rows = arithmetic_rows(5, "train")
    rows[0]["agent_name"] = rows[3]["agent_name"] = "nope"
    with pytest.raises(RowError, match=r"(?s)row 0: key 'agent_name'.*row 3: key 'agent_name'") as e:
        validate_rows(rows, AGENTS, {"calculator"})
    assert "row 1" not in str(e.value)
    with pytest.raises(RowError, match="no rows"):
        validate_rows([], AGENTS, {"calculator"})


# ---------------------------------------------------------------- RowStream

def _ids(batch: list[dict[str, Any]]) -> list[int]:
    return [r["i"] for r in batch]


@pytest.mark.parametrize("stop_after", [2, 3, 4, 7])  # mid-epoch, right before and on the epoch boundary
def test_rowstream_resume_continues_exactly(stop_after: int) -> None:
    rows = [{"i": i} for i in range(10)]
    straight = RowStream(rows, seed=7)
    expected = [_ids(straight.next_batch(3)) for _ in range(12)]  # 36 rows: 3.6 epochs

    first = RowStream(rows, seed=7)
    got = [_ids(first.next_batch(3)) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = RowStream(rows, seed=7)
    resumed.load_state_dict(state)
    assert resumed.position == first.position == (stop_after * 3 // 10, stop_after * 3 % 10)
    got += [_ids(resumed.next_batch(3)) for _ in range(12 - stop_after)]
    assert got == expected

    flat = list(itertools.chain.from_iterable(expected))
    epochs = [flat[i:i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch: every row exactly once
    assert len({tuple(e) for e in epochs}) == 3  # and a fresh order per epoch


def test_rowstream_seed_shuffle_and_mismatch() -> None:
    rows = [{"i": i} for i in range(20)]
    assert _ids(RowStream(rows, seed=1).next_batch(20)) != _ids(RowStream(rows, seed=2).next_batch(20))
    assert _ids(RowStream(rows, shuffle=False).next_batch(25)) == list(range(20)) + list(range(5))
    state = RowStream(rows, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_rows=20 but this run has num_rows=19"):
        RowStream(rows[:19], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this run has seed=3"):
        RowStream(rows, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="k=0"):
        RowStream(rows).next_batch(0)


# ---------------------------------------------------------------- GSM8K

@pytest.mark.skipif(not GSM8K.exists(), reason=f"GSM8K test split not found at {GSM8K}")
def test_gsm8k_conversion_and_cli(tmp_path: Path) -> None:
    records = read_gsm8k(str(GSM8K), "test")
    rows = gsm8k_rows(records, "test", interaction="gsm8k")
    assert len(rows) == len(records) == 1319
    validate_rows(rows, AGENTS, {"calculator"}, {"gsm8k"})
    r = rows[0]
    assert r["agent_name"] == "tool_agent" and r["data_source"] == "openai/gsm8k"
    assert r["reward_model"] == {"style": "rule", "ground_truth": "18"}
    assert r["extra_info"]["split"] == "test" and r["extra_info"]["index"] == 0
    assert r["extra_info"]["solution"] == records[0]["answer"] and r["extra_info"]["tools"] == ["calculator"]
    assert r["interaction_kwargs"] == {"name": "gsm8k", "ground_truth": "18"}
    assert r["prompt"][1] == {"role": "user", "content": records[0]["question"]}
    assert "<tool_call>" in r["prompt"][0]["content"] and "####" in r["prompt"][0]["content"]
    assert rule_reward(r, "She makes 18 dollars.\n#### 18") == 1.0 and rule_reward(r, "#### 17") == 0.0
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", x["reward_model"]["ground_truth"]) for x in rows)  # commas gone

    for suffix in (".jsonl", ".parquet") if HAVE_PYARROW else (".jsonl",):
        out = tmp_path / f"gsm8k{suffix}"
        gsm8k_main(["--input", str(GSM8K), "--output", str(out), "--limit", "50"])
        assert load_rows(str(out)) == gsm8k_rows(records[:50], "test")  # split inferred from the file name
    assert rows_from_source(str(GSM8K), "test", n=5) == gsm8k_rows(records[:5], "test")


def test_gsm8k_sources_fail_with_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pass a local GSM8K jsonl"):
        read_gsm8k(str(tmp_path / "nope.jsonl"))
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="`datasets`.*local GSM8K jsonl path"):
            read_gsm8k("openai/gsm8k", "test")
    with pytest.raises(ValueError, match=r"record 0: .*no '#### <number>'"):
        gsm8k_rows([{"question": "q", "answer": "no final line"}], "test")


# ---------------------------------------------------------------- arithmetic

def test_arithmetic_deterministic_disjoint_and_scored() -> None:
    train, test = arithmetic_rows(400, "train", seed=3), arithmetic_rows(100, "test", seed=3)
    assert train == arithmetic_rows(400, "train", seed=3)
    assert train != arithmetic_rows(400, "train", seed=4)
    assert arithmetic_rows(50, "train", seed=3) == train[:50]  # a prefix: sizes do not reshuffle
    exprs = {"train": [r["extra_info"]["expression"] for r in train],
             "test": [r["extra_info"]["expression"] for r in test]}
    assert not set(exprs["train"]) & set(exprs["test"])
    assert len(set(exprs["train"])) == 400
    validate_rows(train + test, AGENTS, {"calculator"})
    for r in train + test:
        expr, text, gt = r["extra_info"]["expression"], r["prompt"][1]["content"], r["reward_model"]["ground_truth"]
        assert gt == str(safe_eval(expr)) and int(gt) >= 0
        # learnable: the expression's numbers appear in the text in order, and 2-3 operators
        assert re.findall(r"\d+", text) == re.findall(r"\d+", expr), (text, expr)
        assert 2 <= len(re.findall(r"[-+*]", expr)) <= 3
        assert rule_reward(r, final_answer_text(gt)) == 1.0
        assert rule_reward(r, final_answer_text(str(int(gt) + 1))) == 0.0
    assert any("*" in e for e in exprs["train"]) and any("-" in e for e in exprs["train"])


def test_arithmetic_knobs_and_errors(tmp_path: Path) -> None:
    cfg = ArithmeticConfig(min_value=5, max_value=9, min_ops=1, max_ops=1)
    for p in generate_problems(30, "train", cfg=cfg):
        assert len(re.findall(r"[-+*]", p.expression)) == 1
        assert all(5 <= int(n) <= 9 for n in re.findall(r"\d+", p.expression))
    with pytest.raises(ValueError, match=r"found only \d+ distinct train problems of the 500"):
        generate_problems(500, "train", cfg=cfg)  # 5 * 5 * 2 expressions exist
    with pytest.raises(ValueError, match="min_ops <= max_ops, got 3..2"):
        ArithmeticConfig(min_ops=3, max_ops=2)
    out = tmp_path / "a.jsonl"
    arithmetic_main(["--n", "20", "--split", "test", "--seed", "5", "--output", str(out), "--max-value", "20"])
    assert load_rows(str(out)) == arithmetic_rows(20, "test", 5, ArithmeticConfig(max_value=20))
    # what a config's data source string means: generated rows, or a rows file loaded unchanged
    assert rows_from_source("arithmetic", "test", n=20, seed=5, arithmetic=ArithmeticConfig(max_value=20)) \
        == load_rows(str(out)) == rows_from_source(str(out))
    assert rows_from_source(str(out), n=3) == load_rows(str(out))[:3]


# ---------------------------------------------------------------- SFT traces

def _segments(ids: list[int], labels: list[int]) -> list[list[int]]:
    """Runs of consecutive trained (label != -100) tokens."""
    runs, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("which", ["arithmetic", "gsm8k"])
def test_sft_example_matches_template_and_parser(tok: Any, which: str) -> None:
    row = arithmetic_rows(1, "train", seed=9)[0] if which == "arithmetic" else gsm8k_rows([JANET], "test")[0]
    messages = trace_messages(row)
    assistants = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(assistants) == (2 if which == "arithmetic" else 3)
    enc = ChatEncoder(tok)
    ids, labels = encode_sft_example(tok, messages, enc)
    assert len(ids) == len(labels)
    # trained tokens are exactly the assistant turns, each closed by the end-of-turn token
    assert [tok.decode(s) for s in _segments(ids, labels)] == [a + "<|im_end|>" for a in assistants]
    # the ids are the template's rendering of the whole conversation, up to its final newline
    full = enc.render(messages, add_generation_prompt=False)
    assert full[:len(ids)] == ids and tok.decode(full[len(ids):]) == "\n"
    # every call parses with the hermes parser and the tool message is what the calculator answers
    parser = get_tool_parser("hermes")
    tool = CalculatorTool({}, {"type": "function", "function": {"name": "calculator"}})
    for k, text in enumerate(assistants[:-1]):
        parsed = parser.parse(text)
        assert not parsed.errors and [c.name for c in parsed.calls] == ["calculator"]
        answer = asyncio.run(tool.execute("i", parsed.calls[0].arguments)).text
        assert answer == messages[3 + 2 * k]["content"]
    assert rule_reward(row, assistants[-1]) == 1.0


class ReplayClient:
    """Replies with the trace's assistant turns in order, as an engine that stops on <|im_end|>."""

    def __init__(self, tok: Any, replies: list[str]) -> None:
        self.tok, self.replies, self.n = tok, replies, itertools.count()

    async def generate(self, prompt_ids: Any, sampling: dict, session_id: str | None = None,
                       group_id: str | None = None) -> GenerateResult:
        i = next(self.n)
        ids = self.tok.encode(self.replies[i], add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateResult(ids, [-0.1] * len(ids), "stop", 0, "e0", 0, 0, 1, f"r{i}")

    def end_session(self, session_id: str) -> None:
        pass


def test_sft_layout_equals_tool_agent_trajectory(tok: Any) -> None:
    """tool_agent, loaded with tools_calculator.yaml and replaying the trace, builds the same ids;
    its mask-1 tokens are exactly the SFT labels, and the trace earns the full reward."""
    tools = load_tools(TOOLS_YAML)
    assert sorted(tools) == ["calculator"]
    schemas = {n: t.tool_schema for n, t in tools.items()}
    for row in [arithmetic_rows(1, "test", seed=2)[0], gsm8k_rows([JANET], "train")[0]]:
        messages = trace_messages(row)
        ids, labels = encode_sft_example(tok, messages, encoder_for_row(tok, row, schemas))
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        ctx = AgentContext(client=ReplayClient(tok, replies), tokenizer=tok, tools=tools)
        out = with_outcome(row, asyncio.run(ToolAgentLoop(ctx).run({"temperature": 1.0}, **row)), tok)
        assert out.termination == "stop" and out.error == "" and out.reward == 1.0
        assert out.prompt_ids + out.response_ids == ids
        assert [0] * len(out.prompt_ids) + out.response_mask == [int(x != IGNORE_INDEX) for x in labels]


def test_sft_examples_and_batches(tok: Any) -> None:
    rows = arithmetic_rows(5, "train") + gsm8k_rows([JANET, {"question": "q", "answer": "no calls\n#### 3"}], "test")
    examples = build_sft_examples(rows, tok)
    assert len(examples) == 6  # the row without <<expr=value>> annotations is skipped
    with pytest.raises(TraceError, match="no SFT trace"):
        build_sft_examples(rows[-1:], tok)
    assert len(build_sft_examples(rows, tok, max_calls=1)) == 5  # Janet needs 2 calls
    batches = list(sft_batches(examples, batch_size=4, pad_token_id=tok.pad_token_id, seed=1))
    assert [b["input_ids"].shape[0] for b in batches] == [4, 2]
    seen = []
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape
        for ids, lab, att in zip(b["input_ids"].tolist(), b["labels"].tolist(), b["attention_mask"].tolist()):
            n = sum(att)
            assert att == [1] * n + [0] * (len(att) - n) and lab[n:] == [IGNORE_INDEX] * (len(att) - n)
            seen.append((ids[:n], lab[:n]))
    assert sorted(seen) == sorted((list(i), list(l)) for i, l in examples)  # each example once, unchanged
    assert len(list(sft_batches(examples, 4, tok.pad_token_id, drop_last=True))) == 1
    order = [b["input_ids"].tolist() for b in sft_batches(examples, 4, tok.pad_token_id, seed=1)]
    assert order == [b["input_ids"].tolist() for b in batches]


def test_calculator_result_matches_tool() -> None:
    tool = CalculatorTool({}, {"type": "function", "function": {"name": "calculator"}})
    for expr in ["16-3-4", "48/2", "7/2", "2**10", "10/3", "5*0.5"]:
        assert calculator_result(expr) == asyncio.run(tool.execute("i", {"expression": expr})).text


def test_prompts_over_the_token_limit_are_found_as_the_template_counts_them() -> None:
    """too_long counts plain chats in one batch (texts + the template's own tokens, within a slack) and
    renders only those near the limit: the rows it names are exactly those whose rendered prompt is
    over the limit, at limits that cut through the middle of the lengths."""
    from engines.models import load_tokenizer
    from launch.data.rows import _rendered_tokens, too_long, tool_row

    tok = load_tokenizer("smollm2-135m-instruct")
    rng = random.Random(0)
    words = ["apples", "12", "Janet's", "ducks", "+", "lay", "eggs", "per", "day.", "How", "many", "$3", "\n"]
    rows = [tool_row("gsm8k", "Solve it. " * rng.randrange(1, 30), " ".join(rng.choices(words, k=rng.randrange(5, 120))),
                     "1", {}) for _ in range(300)]
    rows.append({"prompt": [{"role": "user", "content": [{"type": "text", "text": "parts " * 80}]}]})  # not plain
    exact = [_rendered_tokens(tok, r["prompt"]) for r in rows]
    for limit in sorted(exact)[::60]:
        assert too_long(rows, tok, limit) == [i for i, n in enumerate(exact) if n > limit], limit
