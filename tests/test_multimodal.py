"""Images in trajectories: a row's image and a tool's image reach a vision-language policy (the
built-in tiny-vlm, LLaVA-style) on a real hf engine over the bus; the trajectory stays token-exact
with the images' tokens as context; the batch carries the pixel values and the actor, given the
same pixel values, scores the model tokens as the engine sampled them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agent.loop import AgentContext
from agent.tool_agent import ToolAgentLoop
from agent.tools.chart import BarChartTool
from test_tool_agent import _server_log, check_against_server
from vlm_agent import SHORT_REPLIES
from procs import pythonpath

SERVER = str(Path(__file__).parent / "fixtures" / "mcp_server.py")
CHART_SCHEMA = {"type": "function", "function": {
    "name": "bar_chart", "description": "Draw a bar chart of numbers",
    "parameters": {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "number"}}},
                   "required": ["values"]}}}


def png_data_url(color: tuple[int, int, int], size: int = 40) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).ellipse([4, 4, size - 4, size - 4], fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_row(color: tuple[int, int, int] = (200, 30, 30)) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": [
        {"type": "image", "image": png_data_url(color)},
        {"type": "text", "text": "Plot the sizes of the three shapes, then describe the chart."}]}]}


def run_loop(addresses: list[str], tools: dict[str, Any], row: dict[str, Any]) -> Any:
    from agent.vision import Vision
    from engines.models import load_tokenizer, resolve_model
    from rollout.bus.client import GenerateClient

    async def go() -> Any:
        async with GenerateClient(addresses) as client:
            await client.wait_ready(timeout_s=300)
            ctx = AgentContext(client, load_tokenizer("tiny-vlm"), tools, {},
                               {"tool_parser": "vlm_agent.CallEveryTool", "max_assistant_turns": 2,
                                "max_turn_tokens": 12, "max_response_tokens": 400},
                               Vision.from_model(resolve_model("tiny-vlm")))
            # replies end after a few tokens (vlm_agent), drawn with a seed: the same run every time
            sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 0, **SHORT_REPLIES}
            return await ToolAgentLoop(ctx).run(sampling, **row, session_id="s0")
    return asyncio.run(go())


def test_a_tool_image_reaches_the_engine_and_the_actor_scores_it_the_same(servers):
    from engines.models import load_tokenizer, resolve_model
    from engines.training.batch import pad_outputs
    from engines.training.hf_model import load_causal_lm, response_logprobs

    srv = servers(1, backend="hf", model="tiny-vlm")
    tok = load_tokenizer("tiny-vlm")
    out = run_loop(srv.addresses, {"bar_chart": BarChartTool({}, CHART_SCHEMA)}, image_row())
    assert out.termination == "max_assistant_turns" and not out.error, out.error
    check_against_server(out, _server_log(srv.request_logs))  # token-exact, as for text trajectories

    image_id = tok.convert_tokens_to_ids("<image>")
    ids = out.prompt_ids + out.response_ids
    mask = [0] * len(out.prompt_ids) + out.response_mask
    assert ids.count(image_id) == 2 * 16  # the row's image and the tool's chart, 16 tokens each
    assert all(m == 0 for t, m in zip(ids, mask) if t == image_id)  # image tokens are context, never trained
    assert out.prompt_ids.count(image_id) == 16
    assert out.messages[-2]["role"] == "tool" and out.messages[-2]["content"][0] == {"type": "image"}
    pv = out.multi_modal["pixel_values"]
    assert pv.shape == (2, 3, 32, 32) and pv.dtype == np.float32

    batch = pad_outputs([out], tok.pad_token_id, [0])
    assert len(batch.pixel_values) == 1 and tuple(batch.pixel_values[0].shape) == (2, 3, 32, 32)
    mb = batch.micro_batch(torch.tensor([0]))
    assert mb.pixel_values is not None and torch.equal(mb.pixel_values, torch.from_numpy(pv))

    model = load_causal_lm(str(resolve_model("tiny-vlm")), torch.float32, torch.device("cpu")).eval()
    with torch.no_grad():
        actor = response_logprobs(model, batch, torch.tensor([0]), 1.0, torch.device("cpu"))[0]
        batch.pixel_values[0] = batch.pixel_values[0].clone()
        batch.pixel_values[0][1] = 0.0  # the chart the engine saw, replaced by a blank one
        blind = response_logprobs(model, batch, torch.tensor([0]), 1.0, torch.device("cpu"))[0]
    m = batch.response_mask[0].bool()
    engine = batch.rollout_logprobs[0]
    after_tool = torch.zeros_like(m)
    after_tool[out.response_ids.index(image_id):] = True  # model tokens generated after seeing the chart
    # same fp32 weights and pixel values; what is left is batched-vs-single kernels (measured ~1e-6)
    diff = (actor - engine)[m].abs()
    assert float(diff.max()) < 1e-4, float(diff.max())
    # the chart matters: without it the actor scores the second reply's tokens differently
    changed = (blind - engine)[m & after_tool].abs()
    assert changed.numel() > 0 and float(changed.max()) > 1e-3, float(changed.max())
    assert torch.equal(blind[m & ~after_tool], actor[m & ~after_tool])  # before the chart nothing changes


def test_an_mcp_image_reaches_the_vlm_as_an_image(servers):
    from agent.tools.mcp import mcp_tools_from_server

    srv = servers(1, backend="hf", model="tiny-vlm")

    async def tools() -> dict[str, Any]:
        return await mcp_tools_from_server(sys.executable, [SERVER], include=["picture"])

    found = asyncio.run(tools())
    try:
        out = run_loop(srv.addresses, found, image_row((20, 20, 200)))
    finally:
        asyncio.run(found["picture"].close())
    assert out.termination == "max_assistant_turns" and not out.error, out.error
    check_against_server(out, _server_log(srv.request_logs))
    tool_msg = out.messages[-2]
    assert tool_msg["role"] == "tool" and tool_msg["content"][0] == {"type": "image"}, tool_msg
    assert tool_msg["content"][1]["text"] == "a red dot"  # the caption; the PNG went in as pixels
    pv = out.multi_modal["pixel_values"]
    assert pv.shape[0] == 2  # the row's image and the server's PNG
    # the 1x1 red PNG, resized to 32x32 by the model's processor: every pixel the same red
    red = pv[1]
    assert np.allclose(red, red[:, :1, :1]) and red[0, 0, 0] > red[1, 0, 0]


def test_one_grpo_step_of_a_vlm_with_an_image_tool_through_train_py(tmp_path: Path, monkeypatch):
    """Rows with images (content parts, and verl's `images` column with `<image>` placeholders),
    a tools.yaml with the bar_chart tool, tiny-vlm on an hf engine: one GRPO step, weights pushed."""
    from test_train import metrics, train

    tests_dir = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    rows = tmp_path / "rows.jsonl"
    verl_style = {"prompt": [{"role": "user", "content": "<image>What is drawn? Plot 3 numbers."}],
                  "images": [{"bytes": None, "path": None}], "agent_name": "vlm_tool_agent"}
    with rows.open("w") as f:
        for i, color in enumerate([(200, 30, 30), (30, 200, 30)]):
            f.write(json.dumps({**image_row(color), "agent_name": "vlm_tool_agent"}) + "\n")
            png = base64.b64decode(png_data_url(color[::-1]).split(",", 1)[1])
            path = tmp_path / f"img{i}.png"
            path.write_bytes(png)
            f.write(json.dumps({**verl_style, "images": [{"bytes": None, "path": str(path)}]}) + "\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "agent.tools.chart.BarChartTool", "config": {},
                                            "tool_schema": CHART_SCHEMA}]}))
    out = tmp_path / "run"
    proc = train(["model.path=tiny-vlm", "model.dtype=float32", "data.val_path=null", "rollout.engine=hf",
                  "rollout.in_process=true",
                  "sft.enabled=false", "data.task=rows", f"data.train_path={rows}", "data.prompts_per_step=2",
                  "rollout.n=2", "rollout.max_tokens=48",
                  "trainer.steps=2", f"rollout.tools_config={tools}",
                  "rollout.agent_loops.vlm_tool_agent=vlm_agent.ShortReplyToolAgent",
                  "rollout.agent.vlm_tool_agent.tool_parser=vlm_agent.CallEveryTool",
                  "rollout.agent.vlm_tool_agent.max_assistant_turns=2", f"trainer.output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    ms = metrics(out)
    assert len(ms) == 2, ms
    for m in ms:
        assert m["rollout/trajectories"] == 4 and m["rollout/invalid"] == 0, m
        # every trajectory's first reply called the chart tool: a reply ends at its first token id
        # divisible by 4, so one that runs into max_tokens (48) without one has odds 0.75^48 ~ 1e-6
        # (at 12 tokens they were 3%, and one run in a clean CI met them)
        assert m["rollout/tool_calls"] >= 4, m
        # the actor's logprobs (pixel values from the batch) equal the engine's (pixel values over
        # the bus); an actor without the images scores image tokens as text and is off by far more
        assert m["drift/max"] < 1e-4, m
    assert any(m["actor/grad_norm"] > 0 for m in ms), ms  # a real update, pushed before step 2's rollout
    from agent.vision import Vision  # the exported model is a vision-language model with its processor
    from engines.models import load_pretrained

    assert Vision.from_model(out / "hf").tokens_per_image == 16
    assert type(load_pretrained(out / "hf", torch.float32)).__name__ == "LlavaForConditionalGeneration"


def test_rows_with_images_and_an_engine_without_them_stop_before_any_model_loads(tmp_path: Path):
    from test_train import train

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**image_row((9, 9, 9)), "agent_name": "single_turn_agent"}) + "\n"
                            for _ in range(2)))
    proc = train(["model.path=tiny-vlm", "data.val_path=null", "rollout.engine=sglang", "data.task=rows",
                  f"data.train_path={rows}", f"trainer.output_dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rollout.engine=sglang does not take them" in proc.stderr and "['hf', 'vllm']" in proc.stderr


def _image_rows(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({**image_row((40 * i % 255, 90, 200)), "agent_name": "vlm_tool_agent"}) + "\n")
    return path


@pytest.mark.slow
def test_two_fsdp_ranks_train_a_vlm_with_the_images_handed_to_both(tmp_path: Path):
    """torchrun with 2 ranks: rank 0's rollout hands each rank its rows with their pixel values;
    the sharded actor's logprobs equal the engine's on every rank's rows."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "agent.tools.chart.BarChartTool", "config": {},
                                            "tool_schema": CHART_SCHEMA}]}))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "launch/train.py",
           "model.path=tiny-vlm", "model.dtype=float32", "data.val_path=null", "rollout.engine=hf", "sft.enabled=false",
           "data.task=rows",
           f"data.train_path={_image_rows(tmp_path / 'rows.jsonl', 4)}", "data.prompts_per_step=2", "rollout.n=2",
           "rollout.max_tokens=48", "trainer.steps=1", f"rollout.tools_config={tools}", "actor.sharding=fsdp",
           "rollout.agent_loops.vlm_tool_agent=vlm_agent.ShortReplyToolAgent",
           "rollout.agent.vlm_tool_agent.tool_parser=vlm_agent.CallEveryTool",
           "rollout.agent.vlm_tool_agent.max_assistant_turns=2", f"trainer.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": pythonpath(repo, Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert m["handoff/rows_local"] == 2 and m["handoff/rows_sent"] == 2, m  # one GRPO group per rank
    assert m["rollout/tool_calls"] >= 4 and m["drift/max"] < 1e-4, m


class ZoomTool:
    """A tool written to verl's contract (no switchyard import): its response carries `image`."""

    def __init__(self, config: dict, tool_schema: Any) -> None:
        self.name = tool_schema.function.name

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, dict]:
        return instance_id or "z0", {}

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[dict, float, dict]:
        from PIL import Image

        return {"text": "zoomed in", "image": [Image.new("RGB", (8, 8), (0, 0, 255))]}, 0.5, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


def test_a_verl_contract_tool_image_reaches_the_vlm(servers):
    from agent.tools.verl_compat import VerlTool

    srv = servers(1, backend="hf", model="tiny-vlm")
    schema = {"type": "function", "function": {"name": "zoom", "description": "Zoom into the picture",
                                               "parameters": {"type": "object", "properties": {}}}}
    out = run_loop(srv.addresses, {"zoom": VerlTool(ZoomTool, {}, schema)}, image_row())
    assert out.termination == "max_assistant_turns" and not out.error, out.error
    check_against_server(out, _server_log(srv.request_logs))
    assert out.messages[-2]["content"] == [{"type": "image"}, {"type": "text", "text": "zoomed in"}]
    pv = out.multi_modal["pixel_values"]
    assert pv.shape[0] == 2 and np.allclose(pv[1], pv[1][:, :1, :1])  # the tool's blue square, resized
    assert pv[1][2, 0, 0] > pv[1][0, 0, 0]  # blue over red (normalized channels)


def test_images_are_read_from_every_row_form_and_bad_ones_are_named(tmp_path: Path):
    from PIL import Image

    from agent.vision import images_in, placeholders_to_parts, to_pil, without_pixels

    img = Image.new("RGB", (5, 3), (1, 2, 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    png = buf.getvalue()
    path = tmp_path / "a.png"
    path.write_bytes(png)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    for form in (img, np.asarray(img), png, {"bytes": png}, {"bytes": None, "path": str(path)}, url, str(path)):
        got = to_pil(form)
        assert got.size == (5, 3) and got.getpixel((0, 0)) == (1, 2, 3), type(form)
    with pytest.raises(ValueError, match="neither a data URL nor an existing file"):
        to_pil("http://example.invalid/cat.png")
    with pytest.raises(TypeError, match="cannot read an image from a int"):
        to_pil(7)
    msgs = placeholders_to_parts([{"role": "user", "content": "<image>left <image> right"}], [img, png])
    assert [p["type"] for p in msgs[0]["content"]] == ["image", "text", "image", "text"]
    assert images_in(msgs) == [img, png]
    assert without_pixels(msgs)[0]["content"][0] == {"type": "image"}
    with pytest.raises(ValueError, match="2 images but only 1"):
        placeholders_to_parts([{"role": "user", "content": "<image> one"}], [img, img])
    with pytest.raises(ValueError, match="more '<image>' placeholders"):
        placeholders_to_parts([{"role": "user", "content": "<image><image>"}], [img])


def test_pixel_values_cross_the_bus_intact_and_malformed_ones_are_refused():
    from rollout.bus import protocol as P

    pv = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    msg = P.Generate(rid="r", prompt_ids=np.arange(1, 5, dtype=np.int32), pixel_values=pv)
    frames = [bytes(f) for f in msg.encode()]
    back = P.decode(frames)
    assert np.array_equal(back.pixel_values, pv) and back.prompt_ids.tolist() == [1, 2, 3, 4]
    assert P.decode([bytes(f) for f in P.Generate(rid="r", prompt_ids=np.arange(1, 3)).encode()]).pixel_values is None
    with pytest.raises(P.ProtocolError, match=r"shape \[2, 3, 4, 4\] of float32 needs 384"):
        P.decode(frames[:2] + [frames[2][:-4]])
    with pytest.raises(P.ProtocolError, match="names a pixel_values frame but carries no frame"):
        P.decode(frames[:2])
    import msgpack
    head = msgpack.unpackb(frames[0])
    with pytest.raises(P.ProtocolError, match="non-negative ints"):
        P.decode([msgpack.packb({**head, "pixel_values": [2, -3, 4, 4]})] + frames[1:])


def test_the_hf_engine_refuses_images_that_do_not_match_the_image_tokens(servers):
    from rollout.bus.client import GenerateClient, RequestFailed

    srv = servers(1, backend="hf", model="tiny-vlm")
    pv = np.zeros((1, 3, 32, 32), np.float32)

    async def go() -> None:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            ok = await client.generate([1, 2] + [49152] * 16 + [3], {"max_tokens": 2}, pixel_values=pv)
            assert len(ok.token_ids) == 2
            with pytest.raises(RequestFailed, match="holds 15 image tokens but 1 images"):
                await client.generate([1, 2] + [49152] * 15 + [3], {"max_tokens": 2}, pixel_values=pv)
            with pytest.raises(RequestFailed, match="holds 16 image tokens but 0 images"):
                await client.generate([1, 2] + [49152] * 16, {"max_tokens": 2})
        async with GenerateClient(echo.addresses) as client:  # an engine without image support says so
            await client.wait_ready(timeout_s=60)
            with pytest.raises(RequestFailed, match="does not take images; serve the vision-language model"):
                await client.generate([1, 2, 3], {"max_tokens": 2}, pixel_values=pv)
    echo = servers(1, backend="echo", model="echo")
    asyncio.run(go())


def test_langgraph_messages_with_image_blocks_reach_the_vlm(servers):
    pytest.importorskip("langgraph.prebuilt", reason="langgraph is not installed")
    from langchain_core.messages import HumanMessage, ToolMessage

    from agent.langgraph import SwitchyardChatModel
    from agent.vision import Vision
    from engines.models import load_tokenizer, resolve_model
    from rollout.bus.client import GenerateClient

    srv = servers(1, backend="hf", model="tiny-vlm")
    red, blue = png_data_url((220, 0, 0)), png_data_url((0, 0, 220))

    async def go() -> Any:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            model = SwitchyardChatModel(client=client, tokenizer=load_tokenizer("tiny-vlm"),
                                        sampling_params={"temperature": 1.0, "max_tokens": 6, "seed": 1},
                                        vision=Vision.from_model(resolve_model("tiny-vlm")))
            first = HumanMessage(content=[  # langchain's own image block, base64 data
                {"type": "image", "base64": red.split(",", 1)[1], "mime_type": "image/png"},
                {"type": "text", "text": "What colour is the dot?"}])
            reply = await model.ainvoke([first])
            tool = ToolMessage(content=[{"type": "image_url", "image_url": {"url": blue}},  # OpenAI's block
                                        {"type": "text", "text": "here is another"}], tool_call_id="c1")
            await model.ainvoke([first, reply, tool])
            return model.to_agent_loop_output()

    out = asyncio.run(go())
    check_against_server(out, _server_log(srv.request_logs))
    pv = out.multi_modal["pixel_values"]
    assert pv.shape == (2, 3, 32, 32)
    assert pv[0][0].mean() > pv[0][2].mean() and pv[1][2].mean() > pv[1][0].mean()  # red first, then blue
    assert (out.prompt_ids + out.response_ids).count(49152) == 32
    assert out.messages[0]["content"][0] == {"type": "image"}  # the payload is not kept twice


def test_the_openai_gateway_takes_image_url_parts_for_a_vlm(servers):
    openai = pytest.importorskip("openai")
    from agent.gateway import Gateway
    from agent.vision import Vision
    from engines.models import load_tokenizer, resolve_model
    from rollout.bus.client import GenerateClient

    srv = servers(1, backend="hf", model="tiny-vlm")
    tok = load_tokenizer("tiny-vlm")
    red, blue = png_data_url((220, 0, 0)), png_data_url((0, 0, 220))

    async def go() -> Any:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            gw = Gateway(client, tok, vision=Vision.from_model(resolve_model("tiny-vlm")))
            blind = Gateway(client, tok)  # the same model served as if it took no images
            await gw.start()
            await blind.start()
            try:
                key = gw.open_session()
                api = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
                msgs: list[dict[str, Any]] = [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": red}}, {"type": "text", "text": "Colour?"}]}]
                r = await api.chat.completions.create(model="switchyard", messages=msgs, max_tokens=5, temperature=1.0)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                                      {"type": "image_url", "image_url": {"url": blue}}]}]
                await api.chat.completions.create(model="switchyard", messages=msgs, max_tokens=5, temperature=1.0)
                conv = gw.close_session(key)
                no = openai.AsyncOpenAI(base_url=blind.base_url, api_key="k", max_retries=0)
                with pytest.raises(openai.BadRequestError, match="takes none"):
                    await no.chat.completions.create(model="switchyard", messages=msgs[:1], max_tokens=5)
                return conv
            finally:
                await gw.stop()
                await blind.stop()

    conv = asyncio.run(go())
    assert len(conv.segments) == 1  # the second call continued the first: one token-exact trajectory
    out = conv.segments[0].to_output()
    check_against_server(out, _server_log(srv.request_logs))
    pv = out.multi_modal["pixel_values"]
    assert pv.shape == (2, 3, 32, 32) and pv[0][0].mean() > pv[0][2].mean() and pv[1][2].mean() > pv[1][0].mean()
    assert (out.prompt_ids + out.response_ids).count(49152) == 32


def test_a_batch_shard_carries_its_rows_images_to_another_rank():
    """What `hand_out` sends another data-parallel rank: the shard's tensors and its rows' images."""
    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs
    from rollout.handoff import pack, unpack

    def out(n_images: int, seed: int) -> AgentLoopOutput:
        pv = np.random.default_rng(seed).standard_normal((n_images, 3, 4, 4)).astype(np.float32)
        return AgentLoopOutput([1, 2, 3], [4, 5], [1, 1], [-0.1, -0.2], 1.0, 1, "stop",
                               multi_modal={"pixel_values": pv} if n_images else {})

    batch = pad_outputs([out(2, 0), out(0, 1), out(1, 2), out(0, 3)], 0, [0, 0, 1, 1])
    for rows in (torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2]), torch.tensor([1, 3])):
        shard = batch.shard(rows)
        back = unpack(*pack(shard), len(batch))
        assert len(back.pixel_values) == len(rows)
        for got, want in zip(back.pixel_values, shard.pixel_values):
            assert (got is None and want is None) or torch.equal(got, want)
        assert torch.equal(back.prompts, shard.prompts)
    plain = pad_outputs([out(0, 0)], 0, [0])
    assert unpack(*pack(plain), 1).pixel_values == []
