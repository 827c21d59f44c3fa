"""Tool-call SFT traces for the warm-up before RL.

A small model (SmolLM2-135M) never emits `<tool_call>` on its own, so GRPO would start from a
reward of ~0 with nothing to reinforce. A short supervised pass on ideal trajectories teaches it
the format first. The traces are built by the project from the rows themselves:

    [system, user] + assistant `<tool_call>{"name": "calculator", ...}</tool_call>` + tool `<result>`
                   (+ more call/result pairs for multi-step GSM8K solutions)
                   + assistant "The answer is 31.\n#### 31"

and tokenized exactly the way tool_agent builds a trajectory (ChatEncoder.initial, then model
tokens + end-of-turn, then ChatEncoder.turn_tokens for tool messages), with labels only on the
assistant tokens. So SFT trains on the very token layout and mask RL will see.
"""

from __future__ import annotations

import json
import logging
import random
import re
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from agent.chat import ChatEncoder
from agent.tools.calculator import CalculatorError, safe_eval
from engines.training.losses import IGNORE_INDEX

if TYPE_CHECKING:
    import torch

log = logging.getLogger("switchyard.data.sft")

_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]*)>>")


class TraceError(ValueError):
    """A row for which no ideal calculator trace can be built; the message says why, `kind`
    groups rows skipped for the same reason in the log."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind or message


def calculator_result(expression: str) -> str:
    """What CalculatorTool answers for `expression`: the safe_eval value, an integral float shown
    as an int. SFT must show the model the same tool text it will read during RL."""
    value = safe_eval(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def tool_call_text(expression: str) -> str:
    """A hermes calculator call, laid out as the system prompt shows it."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def final_answer_text(answer: str) -> str:
    """One sentence ending in `#### n`: scored by the strict (GSM8K) and flexible (arithmetic) rules."""
    return f"The answer is {answer}.\n#### {answer}"


def trace_expressions(row: Mapping[str, Any]) -> list[str]:
    """The calculator inputs of the ideal trace: `extra_info.expression` (arithmetic rows), else
    the `<<expr=value>>` annotations of `extra_info.solution` (GSM8K rows), in order."""
    extra = row.get("extra_info") or {}
    if extra.get("expression"):
        return [str(extra["expression"])]
    return [m.group(1).strip() for m in _ANNOTATION.finditer(str(extra.get("solution") or ""))]


def trace_messages(row: Mapping[str, Any], max_calls: int = 4) -> list[dict[str, str]]:
    """The row's prompt followed by the ideal trajectory: one calculator call per assistant turn
    with the calculator's real result as the tool message, then the final answer."""
    gt = (row.get("reward_model") or {}).get("ground_truth")
    if gt is None:
        raise TraceError("row has no reward_model.ground_truth to end the trace with", "no ground truth")
    exprs = trace_expressions(row)
    if not exprs:
        raise TraceError("row has neither extra_info.expression nor <<expr=value>> annotations in "
                         "extra_info.solution; no calculator trace can be built", "no expression")
    if len(exprs) > max_calls:
        raise TraceError(f"the solution needs {len(exprs)} calculator calls, more than max_calls={max_calls}",
                         f"more than {max_calls} calls")
    messages = [dict(m) for m in row["prompt"]]
    for expr in exprs:
        try:
            result = calculator_result(expr)
        except CalculatorError as e:
            raise TraceError(f"the calculator refuses {expr!r}: {e}", "calculator error") from None
        messages += [{"role": "assistant", "content": tool_call_text(expr)}, {"role": "tool", "content": result}]
    messages.append({"role": "assistant", "content": final_answer_text(str(gt))})
    return messages


def encoder_for_row(tokenizer: Any, row: Mapping[str, Any],
                    tool_schemas: Mapping[str, Mapping[str, Any]] | None = None) -> ChatEncoder:
    """The ChatEncoder tool_agent would use for `row`: the loaded tools' schemas (in config order)
    narrowed to `extra_info.tools` when the row lists some. Templates that render tools into the
    prompt (Qwen2.5) need the same list, or SFT would train on a different prompt."""
    offered = (row.get("extra_info") or {}).get("tools")
    schemas = [dict(s) for name, s in (tool_schemas or {}).items() if not offered or name in offered]
    return ChatEncoder(tokenizer, tools=schemas or None)


def encode_sft_example(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                       encoder: ChatEncoder | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for a conversation, built as tool_agent builds a trajectory:

        initial(messages before the first assistant turn)                 labels -100
        + encode(assistant content) + end_of_turn (+ close_assistant_turn) labels = ids
        + turn_tokens(the following tool/user messages)                   labels -100  ...

    Labels are aligned with input_ids (a HF model shifts them itself). The conversation must
    end with an assistant turn: trailing context would be tokens nobody learns from.
    """
    enc = encoder or ChatEncoder(tokenizer)
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("encode_sft_example needs prompt messages followed by at least one assistant turn; got roles "
                         f"{[m.get('role') for m in messages]}")
    if messages[-1].get("role") != "assistant":
        raise ValueError(f"the conversation ends with a {messages[-1].get('role')!r} message; end it with the "
                         "assistant turn to train on (drop the trailing messages)")
    ids = enc.initial(list(messages[:first]))
    labels = [IGNORE_INDEX] * len(ids)
    i = first
    while i < len(messages):
        if messages[i].get("role") == "assistant":
            reply = tokenizer.encode(str(messages[i].get("content") or ""), add_special_tokens=False)
            reply.append(enc.end_of_turn_id)
            glue = enc.close_assistant_turn(reply)
            ids += reply + glue
            labels += reply + [IGNORE_INDEX] * len(glue)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        glue = enc.turn_tokens([dict(m) for m in messages[i:j]])
        ids += glue
        labels += [IGNORE_INDEX] * len(glue)
        i = j
    return ids, labels


def build_sft_examples(rows: Sequence[Mapping[str, Any]], tokenizer: Any,
                       tool_schemas: Mapping[str, Mapping[str, Any]] | None = None, max_calls: int = 4,
                       max_length: int | None = None) -> list[tuple[list[int], list[int]]]:
    """SFT examples for every row a trace can be built for. Rows without one (a GSM8K solution
    the calculator cannot follow, or too long) are skipped and counted in a log line; none at
    all is an error, since the warm-up would silently do nothing."""
    encoders: dict[tuple[str, ...], ChatEncoder] = {}
    examples: list[tuple[list[int], list[int]]] = []
    skipped: dict[str, int] = {}
    for row in rows:
        offered = tuple((row.get("extra_info") or {}).get("tools") or ())
        if offered not in encoders:
            encoders[offered] = encoder_for_row(tokenizer, row, tool_schemas)
        try:
            ids, labels = encode_sft_example(tokenizer, trace_messages(row, max_calls), encoders[offered])
        except TraceError as e:
            skipped[e.kind] = skipped.get(e.kind, 0) + 1
            continue
        if max_length is not None and len(ids) > max_length:
            key = f"longer than {max_length} tokens"
            skipped[key] = skipped.get(key, 0) + 1
            continue
        examples.append((ids, labels))
    if skipped:
        log.info("SFT traces: %d built, %d rows skipped %s", len(examples), sum(skipped.values()), skipped)
    if not examples:
        raise TraceError(f"no SFT trace could be built from {len(rows)} rows (skipped: {skipped}); use rows with "
                         "extra_info.expression or a GSM8K solution, or raise max_calls/max_length")
    return examples


def sft_batches(examples: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int, pad_token_id: int,
                seed: int = 0, shuffle: bool = True, drop_last: bool = False) -> Iterator[dict[str, "torch.Tensor"]]:
    """One pass over `examples` as right-padded batches {input_ids, labels, attention_mask}
    (long tensors; padding has label -100 and mask 0). Pass a new seed per epoch to reshuffle."""
    import torch

    if batch_size < 1:
        raise ValueError(f"sft batch_size={batch_size} must be >= 1")
    order = list(range(len(examples)))
    if shuffle:
        random.Random(seed).shuffle(order)
    for start in range(0, len(order), batch_size):
        chunk = [examples[i] for i in order[start:start + batch_size]]
        if drop_last and len(chunk) < batch_size:
            return
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), int(pad_token_id), dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, (ids, lab) in enumerate(chunk):
            if len(ids) != len(lab):
                raise ValueError(f"SFT example has {len(ids)} input ids but {len(lab)} labels; they must be equal")
            input_ids[b, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            labels[b, :len(lab)] = torch.tensor(list(lab), dtype=torch.long)
            attention_mask[b, :len(ids)] = 1
        yield {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def warm_up(actor: Any, rows: Sequence[Mapping[str, Any]], tools: Mapping[str, Any], model_dir: str, sft: Any,
            max_calls: int, show: bool = True) -> None:
    """The supervised warm-up (`sft:` config section): `sft.steps` optimizer steps over traces built
    from the first `sft.examples` rows, laid out exactly like rollouts, at `sft.lr`. The actor's
    learning rate is left as it found it."""
    from tqdm import tqdm

    from engines.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    schemas = {name: t.tool_schema for name, t in tools.items()}
    examples = build_sft_examples(rows[:sft.examples], tok, schemas, max_calls=max(1, max_calls))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    bar = tqdm(total=sft.steps, desc="sft", unit="step", disable=not show)
    done, epoch, lr = 0, 0, actor.lr
    actor.set_lr(sft.lr)
    while done < sft.steps:
        for b in sft_batches(examples, sft.batch_size, pad, seed=epoch):
            m = actor.sft_step(b["input_ids"], b["labels"], b["attention_mask"])
            done += 1
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            if done >= sft.steps:
                break
        epoch += 1
    bar.close()
    actor.set_lr(lr)


def warm_up_run(cfg: Any, run: Any, ckpt: Any, sharded: bool, config: dict[str, Any] | None = None) -> None:
    """The SFT warm-up (`sft.*`) of a fresh run, saved as step 0 (a rerun resumes past it) with the
    run's resolved `config` (what a resume compares with)."""
    from launch.checkpoint import save_run

    warm_up(run.actor, run.rows, run.tools, run.model_dir, cfg.sft, cfg.rollout.assistant_turns - 1, show=run.rank == 0)
    save_run(ckpt, 0, run.actor, run.stream, run.plane.version, run.rank, sharded, run.barrier, critic=run.critic,
             config=config)
