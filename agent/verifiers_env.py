"""Train a verifiers environment through the gateway: one episode per trajectory, its reward the
environment's own.

verifiers (prime-rl's environment library) runs an episode the way its evaluations do: the seat's
harness program (its plain chat loop `null`, a shell agent `bash`, or the taskset's own) talks to
the model through an OpenAI-compatible endpoint, and the task's `@vf.reward` functions score the
finished trace. `run_episode` is an `openai_agent` function: it points that endpoint at the
gateway with the trajectory's key, so every model call of the episode is recorded token-exactly in
the trajectory's session, and it returns the trace's reward (the weighted sum of the reward
functions). verifiers is imported only here, on first use; it pins openai and mcp versions of its
own, so it usually lives in a virtual environment of its own (see the README).

A row names the episode (`python -m agent.verifiers_env` writes one per task):

    {"agent_name": "openai_agent", "data_source": "verifiers/my-taskset",
     "prompt": [{"role": "user", "content": "..."}],          # the task's prompt: row checks and logs
     "verifiers": {"env": {"taskset": {"id": "my-taskset"},    # verifiers' env config, as its CLI takes it
                           "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}},
                   "task": 3,                                  # the task's position in the taskset
                   "key": "<the task's key>",                  # checked: the taskset still holds that task
                   "client": {"type": "train"}}}               # optional: verifiers' token client (below)

    python launch/train.py data.task=rows data.train_path=rows.jsonl data.agent_name=openai_agent \\
        rollout.agent.openai_agent.agent_function=agent.verifiers_env.run_episode

The model is reached through one of verifiers' two clients (`verifiers.client`): `eval` (the
default) relays the harness's chat requests to the gateway's `/v1/chat/completions`, where the
gateway applies the chat template; `train` is the client prime-rl trains with: it renders each
prompt to token ids itself and calls the gateway's `/inference/v1/generate`, which records those
ids as they are. Its renderer defaults to agent/verifiers_renderer.py (the chat route's template
and tool parser, `tool_parser` to pick another; turns bridged by appending), loaded for the
tokenizer the gateway serves (`GET /v1/models`: `root`); `renderer` takes a renderers-package
config instead (e.g. `{"name": "qwen3"}`) and `renderer_model_name` another tokenizer.

An episode whose harness or scoring failed raises, so its trajectory is kept out of the update
(`termination: error`) instead of being trained with a made-up reward. With several trainable
traces (a multi-agent env) the reward is their mean; all their model calls share the trajectory's
session, each conversation a segment of its own.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping

INSTALL_HINT = ("the verifiers adapter needs the verifiers package: `pip install verifiers==0.4.0 uv` (it pins "
                "openai and mcp versions of its own, so install it in a virtual environment over this one: "
                "`python -m launch.venv .venv-vf`; see the README's verifiers recipe)")
KEY_VAR_PREFIX = "SWITCHYARD_API_KEY_"  # verifiers reads keys from the environment; its runtimes hide *API_KEY*

_TASKS: dict[str, list[Any]] = {}  # per taskset config: the tasks loaded so far, in load() order
_MODELS: dict[str, dict[str, Any]] = {}  # per gateway base_url: the model card it serves
CLIENT_KEYS = {"eval": {"type"}, "train": {"type", "renderer", "renderer_model_name", "tool_parser"}}


class EpisodeFailed(RuntimeError):
    """A verifiers episode that did not finish: its trajectory is an error, not a zero reward."""


def verifiers() -> Any:
    """`verifiers.v1`, imported on first use."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
    return vf


def _spec(row: Mapping[str, Any]) -> dict[str, Any]:
    spec = row.get("verifiers")
    if not isinstance(spec, Mapping):
        raise ValueError(f"row has no 'verifiers' mapping (got {str(spec)[:80]!r}); write the rows with "
                         "`python -m agent.verifiers_env --taskset ID --out rows.jsonl`")
    env = spec.get("env")
    if not isinstance(env, Mapping) or not isinstance(env.get("taskset"), Mapping) or not env["taskset"].get("id"):
        raise ValueError(f"row's verifiers.env={str(env)[:120]!r} must be an env config naming its taskset, "
                         "like {'taskset': {'id': 'my-taskset'}}")
    idx = spec.get("task")
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
        raise ValueError(f"row's verifiers.task={idx!r} must be the task's position in the taskset (an integer >= 0)")
    return {"env": copy.deepcopy(dict(env)), "task": idx, "key": spec.get("key"), "client": _client(spec.get("client"))}


def _client(value: Any) -> dict[str, Any]:
    """The row's `verifiers.client`: absent or "eval", "train", or a mapping with `type` and options."""
    spec = {"type": "eval"} if value is None else {"type": value} if isinstance(value, str) else value
    kind = spec.get("type", "eval") if isinstance(spec, Mapping) else None
    if not isinstance(kind, str) or kind not in CLIENT_KEYS:
        raise ValueError(f"row's verifiers.client={str(value)[:120]!r} must be 'eval' (chat requests relayed to the "
                         "gateway), 'train' (token ids rendered by verifiers, sent to /inference/v1/generate) or a "
                         "mapping like {'type': 'train', 'renderer': {'name': 'qwen3'}}")
    unknown = sorted(set(spec) - CLIENT_KEYS[kind])
    if unknown:
        raise ValueError(f"row's verifiers.client has option(s) {unknown} that the {kind!r} client does not take; "
                         f"it takes {sorted(CLIENT_KEYS[kind])}")
    if "renderer" in spec and "tool_parser" in spec:
        raise ValueError("row's verifiers.client gives both 'renderer' and 'tool_parser': tool_parser configures the "
                         "default renderer (agent/verifiers_renderer.py); put it inside 'renderer' or drop one")
    return {**copy.deepcopy(dict(spec)), "type": kind}


def _task(env: Any, idx: int, key: str | None) -> Any:
    """Task `idx` of the env's taskset; load() runs once per process and taskset config."""
    cache_key = env.config.taskset.model_dump_json()
    tasks = _TASKS.setdefault(cache_key, [])
    if len(tasks) <= idx:
        for i, task in enumerate(env.taskset):
            if i >= len(tasks):
                tasks.append(task)
            if len(tasks) > idx:
                break
    name = env.config.taskset.id
    if len(tasks) <= idx:
        raise ValueError(f"verifiers.task={idx} is past the end of taskset {name!r}, which holds {len(tasks)} "
                         "task(s); rewrite the rows with `python -m agent.verifiers_env`")
    task = tasks[idx]
    if key is not None and task.key != key:
        raise ValueError(f"task {idx} of taskset {name!r} has key {task.key[:12]}..., the row expects "
                         f"{str(key)[:12]}...: the taskset changed since the rows were written; rewrite them "
                         "with `python -m agent.verifiers_env`")
    return task


async def _model_card(base_url: str) -> dict[str, Any]:
    """The gateway's model card (its GET /models): `id`, the name the episode's requests must use;
    `root`, the tokenizer it serves."""
    if base_url not in _MODELS:
        import aiohttp

        async with aiohttp.ClientSession() as http, http.get(base_url.rstrip("/") + "/models") as r:
            status, text = r.status, await r.text()
        try:
            data = json.loads(text).get("data") if status == 200 else None
        except (ValueError, AttributeError):
            data = None
        if not data:
            raise RuntimeError(f"GET {base_url}/models answered {status} {text[:200]!r}; base_url must be a "
                               "switchyard gateway's (the openai_agent loop passes it)")
        _MODELS[base_url] = dict(data[0])
    return _MODELS[base_url]


async def _client_config(vf: Any, client: dict[str, Any], base_url: str, key_var: str) -> Any:
    """verifiers' client config for the row's `client`, pointed at the gateway with the key in `key_var`."""
    if client["type"] == "eval":
        return vf.EvalClientConfig(base_url=base_url, api_key_var=key_var)
    from agent.verifiers_renderer import IMPORT_PATH

    renderer = client.get("renderer") or {"name": "custom", "import_path": IMPORT_PATH,
                                          "tool_parser": client.get("tool_parser", "hermes")}
    name = client.get("renderer_model_name") or (await _model_card(base_url)).get("root")
    if not name:
        raise ValueError(f"the gateway at {base_url} does not say which tokenizer it serves (no 'root' in GET "
                         "/models); give verifiers.client.renderer_model_name, the model path or id to render with")
    return vf.TrainClientConfig(base_url=base_url, api_key_var=key_var, renderer=renderer, renderer_model_name=name)


def _failure(episode: Any) -> str:
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if not errors:
        return "it ended without a verdict (episode.ok is False)"
    return "; ".join(f"{e.type}: {str(e.message)[:400]}" for e in errors[:3])


async def run_episode(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """One verifiers episode of the row's task against the gateway; returns its reward. An
    `openai_agent` function: `rollout.agent.openai_agent.agent_function=agent.verifiers_env.run_episode`."""
    spec = _spec(row)  # a malformed row is named before verifiers is needed
    vf = verifiers()
    config = vf.resolve_env_config(spec["env"])
    env = vf.load_environment(config)  # one per episode: its serving resources are the episode's own
    task = _task(env, spec["task"], spec["key"])
    var = KEY_VAR_PREFIX + uuid.uuid4().hex
    os.environ[var] = api_key
    try:
        client = await _client_config(vf, spec["client"], base_url, var)
        ctx = vf.ModelContext(model=str((await _model_card(base_url))["id"]), client=client)
        async with env.serving():
            episode = await env.run_episode(task, ctx)
    finally:
        os.environ.pop(var, None)
    if not episode.ok:
        raise EpisodeFailed(f"the verifiers episode of task {spec['task']} ({config.taskset.id}) failed: "
                            f"{_failure(episode)}")
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    return sum(float(t.reward) for t in traces) / len(traces)


# ------------------------------------------------------------------ rows


def _messages(task: Any, idx: int) -> list[dict[str, str]]:
    """The task's opening as chat messages (text only), for the row's `prompt`."""
    from verifiers.v1.types import content_text

    data = task.data
    out: list[dict[str, str]] = []
    if data.system_prompt:
        out.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        for m in data.prompt:
            text = content_text(m.content) or ""
            if m.role in ("system", "developer") and not out:
                out.append({"role": "system", "content": text})
            elif m.role in ("user", "assistant"):
                out.append({"role": m.role, "content": text})
    if not any(m["role"] == "user" for m in out):  # a task the user opens: the row still needs a user turn
        out.append({"role": "user", "content": data.description or data.name or f"task {idx}"})
    return out


def env_config(taskset: str, harness: str | None = None, runtime: str = "subprocess",
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An env config for `taskset`: the seat's runtime, and its harness (default: the taskset's
    own when it ships one, else `null`, verifiers' plain chat loop), merged under `extra`."""
    vf = verifiers()
    agent: dict[str, Any] = {"runtime": {"type": runtime}}
    if harness is None and vf.default_harness_id(taskset) == "bash":  # no harness of its own
        harness = "null"
    if harness is not None:
        agent["harness"] = {"id": harness}
    return _merge({"taskset": {"id": taskset}, "agent": agent}, dict(extra or {}))


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def rows(env: Mapping[str, Any], limit: int | None = None, client: Any = None) -> list[dict[str, Any]]:
    """One openai_agent row per task of the env config's taskset (the first `limit`); `client` is
    the rows' `verifiers.client` (None: the default, eval)."""
    if client is not None:
        _client(client)  # named before verifiers loads the taskset
    vf = verifiers()
    config = vf.resolve_env_config(copy.deepcopy(dict(env)))
    taskset = vf.load_taskset(config.taskset)
    if limit is None and not taskset.bounded:
        raise ValueError(f"taskset {config.taskset.id!r} is infinite: give --limit N")
    out = []
    for idx, task in enumerate(taskset):
        if limit is not None and idx >= limit:
            break
        out.append({"agent_name": "openai_agent", "data_source": f"verifiers/{config.taskset.id}",
                    "prompt": _messages(task, idx),
                    "verifiers": {"env": copy.deepcopy(dict(env)), "task": idx, "key": task.key,
                                  **({"client": copy.deepcopy(client)} if client is not None else {})}})
    if not out:
        raise ValueError(f"taskset {config.taskset.id!r} yielded no tasks")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m agent.verifiers_env",
                                 description="Write openai_agent rows, one per task of a verifiers taskset.")
    ap.add_argument("--taskset", required=True, help="the installed taskset's id (importable as a module)")
    ap.add_argument("--harness", default=None,
                    help="the seat's harness (default: the taskset's own, else null, the plain chat loop)")
    ap.add_argument("--runtime", default="subprocess", help="where the harness program runs (verifiers' runtime type)")
    ap.add_argument("--env", default="{}", help="more env config as JSON, merged over the above")
    ap.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    ap.add_argument("--client", default=None,
                    help="verifiers' model client: eval (default: chat requests relayed to the gateway), train "
                         "(token ids rendered by verifiers, sent to /inference/v1/generate), or a JSON object like "
                         "'{\"type\": \"train\", \"renderer\": {\"name\": \"qwen3\"}}'")
    ap.add_argument("--out", required=True, help="the .jsonl file to write")
    args = ap.parse_args(argv)
    try:
        extra = json.loads(args.env)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--env {args.env!r} is not JSON ({e.msg}); give an object like "
                         "'{\"agent\": {\"max_turns\": 4}}'") from None
    if not isinstance(extra, dict):
        raise SystemExit(f"--env {args.env!r} must be a JSON object")
    client: Any = args.client
    if client is not None and client.lstrip().startswith("{"):
        try:
            client = json.loads(client)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--client {args.client!r} is not JSON ({e.msg}); give eval, train or an object like "
                             "'{\"type\": \"train\"}'") from None
    try:
        written = rows(env_config(args.taskset, args.harness, args.runtime, extra), args.limit,
                       None if client == "eval" else client)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = Path(args.out)
    out.write_text("".join(json.dumps(r) + "\n" for r in written))
    print(json.dumps({"rows": len(written), "taskset": args.taskset, "output": str(out)}), file=sys.stdout)


if __name__ == "__main__":
    main()
