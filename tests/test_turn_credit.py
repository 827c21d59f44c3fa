"""Turn-level credit: rewards attached to turns reach the trainer per turn, and `turn_grpo`
credits each turn with the reward still to come against the other samples at the same turn.
Hand-computed advantages for samples with different numbers of turns, its reduction to RLOO,
its baseline's independence from the sample itself, and one training step through
launch/train.py where a tool gives step rewards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.loop import AgentLoopOutput  # noqa: E402
from engines.training.advantages import compute_advantages, rloo, turn_grpo  # noqa: E402
from engines.training.batch import pad_outputs  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def _row(T: int, runs: list[tuple[int, int]], rewards_at: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    mask, tr = torch.zeros(T), torch.zeros(T)
    for a, b in runs:
        mask[a:b] = 1
    for j, v in rewards_at.items():
        tr[j] = v
    return mask, tr


def _hand_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three samples of one prompt: a has 2 turns (turn 0 earned 1.0), b 1 turn, c 3 turns
    (0.5 after each of its first two)."""
    rows = [_row(8, [(0, 2), (4, 6)], {3: 1.0}),
            _row(8, [(0, 3)], {}),
            _row(8, [(0, 1), (2, 3), (4, 6)], {1: 0.5, 3: 0.5})]
    mask = torch.stack([m for m, _ in rows])
    tr = torch.stack([t for _, t in rows])
    return torch.tensor([3.0, 1.0, 2.0]), mask, tr, torch.tensor([7, 7, 7])


def test_turn_grpo_matches_a_hand_computation_with_different_turn_counts():
    rewards, mask, tr, groups = _hand_batch()
    adv = turn_grpo(rewards, groups, mask, tr)
    # returns per turn: a (3, 2), b (1,), c (2, 1.5, 1)
    # a: turn 0 vs mean(b, c) = 1.5 -> 1.5; turn 1 vs c's turn 1 (1.5) -> 0.5
    # b: turn 0 vs mean(3, 2) = 2.5 -> -1.5
    # c: turn 0 vs 2 -> 0; turn 1 vs a's turn 1 (2) -> -0.5; turn 2: nobody else has one, so the
    #    others' latest turns (a: 2, b: 1) -> 1.5 -> -0.5
    expected = torch.tensor([[1.5, 1.5, 0, 0, 0.5, 0.5, 0, 0],
                             [-1.5, -1.5, -1.5, 0, 0, 0, 0, 0],
                             [0, 0, -0.5, 0, -0.5, -0.5, 0, 0]])
    assert torch.allclose(adv, expected)
    assert torch.equal(adv != 0, (mask != 0) & (expected != 0))  # never on a mask-0 token


def test_without_turn_rewards_and_with_one_turn_it_is_rloo():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g)
    groups = torch.arange(12) // 4
    mask = (torch.rand(12, 9, generator=g) > 0.3).float()
    mask[:, 0], mask[:, 5:] = 1, 0
    mask[:, 1:5] = 1  # one run of model tokens per row
    assert torch.allclose(compute_advantages("turn_grpo", rewards, mask, group_index=groups,
                                             turn_rewards=torch.zeros(12, 9), norm_by_std=False),
                          rloo(rewards, groups, mask))


def test_the_baseline_does_not_depend_on_the_sample_itself():
    """Raising a sample's own reward by d raises each of its advantages by exactly d: its baseline
    is made of the other samples only (what keeps the gradient unbiased)."""
    rewards, mask, tr, groups = _hand_batch()
    before = turn_grpo(rewards, groups, mask, tr)
    for i in range(3):
        bumped = rewards.clone()
        bumped[i] += 0.75
        after = turn_grpo(bumped, groups, mask, tr)
        assert torch.allclose((after - before)[i], 0.75 * mask[i])


def test_invalid_and_lonely_samples_get_nothing_and_move_nobody():
    rewards, mask, tr, groups = _hand_batch()
    base = turn_grpo(rewards, groups, mask, tr)
    r4 = torch.cat([rewards, torch.tensor([9.0, 4.0])])
    m4 = torch.cat([mask, torch.ones(2, 8)])
    t4 = torch.cat([tr, torch.zeros(2, 8)])
    g4 = torch.tensor([7, 7, 7, 7, 8])  # row 3: invalid member of group 7; row 4: alone in group 8
    valid = torch.tensor([True, True, True, False, True])
    adv = turn_grpo(r4, g4, m4, t4, valid=valid)
    assert torch.allclose(adv[:3], base) and not adv[3:].any()
    normed = turn_grpo(rewards, groups, mask, tr, norm_by_std=True)
    assert torch.allclose(normed, base / (rewards.std() + 1e-6))


def test_turn_rewards_are_padded_at_their_positions_and_checked():
    def out(n: int, turn_rewards: list[list[float]]) -> AgentLoopOutput:
        return AgentLoopOutput(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), response_mask=[1] * n,
                               response_logprobs=[0.0] * n, reward=1.0, num_turns=1, termination="stop",
                               turn_rewards=turn_rewards)

    batch = pad_outputs([out(4, [[2, 0.5], [2, 0.25], [4, 1.0]]), out(2, [])], pad_id=0, group_index=[0, 0])
    assert batch.turn_rewards.tolist() == [[0.0, 0.75, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert batch.shard(torch.tensor([0])).turn_rewards.tolist() == [[0.0, 0.75, 0.0, 1.0]]
    assert batch.metrics()["rollout/turn_rewards_per_trajectory"] == 1.0
    with pytest.raises(ValueError, match="response position 5 but its response has 4 tokens"):
        pad_outputs([out(4, [[5, 1.0]])], pad_id=0, group_index=[0])


STEP_TOOLS = '''
from agent.tools import ToolResponse

def calculator(expression: str):
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. (16 - 3 - 4) * 2
    """
    try:
        value = eval(expression, {"__builtins__": {}})
    except Exception as e:
        return ToolResponse(f"Error: {e}", success=False)
    return ToolResponse(str(value), reward=0.5)  # a step reward for every call that computed
'''


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason=f"GSM8K jsonl not found in {GSM8K}")
def test_one_turn_grpo_step_with_per_turn_tool_rewards(tmp_path: Path, tool_caller: Path):
    from test_train import metrics, train
    from tool_model import gsm8k_rows

    (tmp_path / "step_tools.py").write_text(STEP_TOOLS)
    (tmp_path / "tools.yaml").write_text("functions:\n  - source: step_tools.py\n    names: [calculator]\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(GSM8K / "train.jsonl", 16)))
    out = tmp_path / "run"
    proc = train([f"model.path={tool_caller}", "data.task=rows", f"data.train_path={rows}", "data.val_path=null",
                  "rollout.engine=hf", "rollout.in_process=true",
                  "data.prompts_per_step=3", "rollout.n=3", "rollout.max_tokens=48",
                  f"rollout.tools_config={tmp_path / 'tools.yaml'}", "algorithm.advantage=turn_grpo",
                  "sft.enabled=false", "trainer.steps=1", f"trainer.output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = [m for m in metrics(out) if m.get("step") == 1][0]
    assert step["rollout/tool_calls"] > 0
    assert step["rollout/reward_extra/tool_step"] > 0  # the step rewards are in the total ...
    assert step["rollout/turn_rewards_per_trajectory"] > 0  # ... and attached to their turns
    assert step["actor/grad_norm"] > 0
