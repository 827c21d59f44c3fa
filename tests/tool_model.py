"""A tiny llama taught, in a few seconds of SFT, to call the calculator in hermes format.

Random tiny-llama weights never emit a `<tool_call>`, so a test of the tool loop on a real engine
needs a model that does. This one is trained on two-turn GSM8K traces (a calculator call with
the first expression of the reference solution, the tool's answer, then `#### <answer>`), built
with the same ChatEncoder the loop uses, so its tool calls are the real multi-turn path. It
samples imperfectly at temperature 1, which also exercises malformed-call handling.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SYSTEM = ("You can call the calculator tool: write <tool_call>{\"name\": \"calculator\", \"arguments\": "
          "{\"expression\": \"...\"}}</tool_call>. End with '#### <answer>'.")

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


TRACE_ROWS = 64  # the GSM8K rows the traces are made from


def gsm8k_rows(path: Path, n: int, agent_name: str = "tool_agent") -> list[dict[str, Any]]:
    """The first `n` GSM8K rows in the verl format the loops take."""
    rows = []
    for line in path.read_text().splitlines()[:n]:
        r = json.loads(line)
        answer = r["answer"].split("####")[-1].strip().replace(",", "")
        rows.append({
            "data_source": "openai/gsm8k", "agent_name": agent_name,
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"solution": r["answer"]},
        })
    return rows


def _trace(row: dict[str, Any]) -> tuple[str, str, str]:
    m = re.search(r"<<([^=<>]+)=([^<>]+)>>", row["extra_info"]["solution"])
    expr, value = (m.group(1), m.group(2)) if m else ("1+1", "2")
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
    return call, value, f"#### {row['reward_model']['ground_truth']}"


def train_tool_caller(out: Path, gsm8k_path: Path, steps: int = 150, seed: int = 0) -> Path:
    """Fine-tune tiny-llama on tool traces and save it (model + tokenizer) to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.chat import ChatEncoder
    from engines.models import resolve_model

    src = resolve_model("tiny-llama")
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    enc = ChatEncoder(tok)
    seqs: list[tuple[list[int], list[int]]] = []
    for row in gsm8k_rows(gsm8k_path, TRACE_ROWS):
        call, value, final = _trace(row)
        ids, labels = enc.initial(row["prompt"]), []
        labels = [-100] * len(ids)
        for text, then in ((call, [{"role": "tool", "content": value}]), (final, None)):
            reply = tok.encode(text, add_special_tokens=False) + [enc.end_of_turn_id]
            ids += reply
            labels += reply
            if then:
                glue = enc.turn_tokens(then)
                ids += glue
                labels += [-100] * len(glue)
        seqs.append((ids, labels))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [seqs[int(i)] for i in torch.randint(len(seqs), (8,), generator=g)]
        width = max(len(s) for s, _ in batch)
        ids = torch.tensor([s + [0] * (width - len(s)) for s, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in batch])
        # the LM head only where there is a label: most positions are prompt, and the 49k-wide
        # head is the cost of this model
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        logits = model.lm_head(hidden[keep])
        loss = torch.nn.functional.cross_entropy(logits, targets[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
