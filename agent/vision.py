"""Images in trajectories: what a vision-language policy sees, encoded once on the agent side.

A message's content may be a list of parts, OpenAI style: `{"type": "text", "text": ...}` and
`{"type": "image", "image": X}` (or `{"type": "image_url", "image_url": {"url": X}}`), where X is
a PIL image, an HxWx3 uint8 array, PNG/JPEG bytes, `{"bytes": ...}` / `{"path": ...}` (how
parquet datasets store images), a `data:image/...;base64,` URL or a local file path.

The chat template renders one image token per image part; `Vision.expand` repeats it to the
number of embeddings the model puts there, so the trajectory's token ids are exactly the ids the
engine and the actor run (image tokens are context: mask 0). `Vision.pixels` turns the images
into the model's pixel values with the model's own image processor; the trajectory keeps them
in order, the engine receives them with every generation and the trainer with the batch, so
both compute on the same numbers.

Supported: LLaVA-style models (a fixed number of image tokens per image, e.g. the built-in
`tiny-vlm`). Models whose image token count depends on the image size (Qwen2-VL's dynamic
resolution) are refused with an error at load time.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

IMAGE_PART_TYPES = ("image", "image_url")


class Vision:
    """The image side of a vision-language model: its image token, tokens per image, processor."""

    def __init__(self, processor: Any, image_token_id: int, tokens_per_image: int) -> None:
        self.processor = processor
        self.image_token_id = int(image_token_id)
        self.tokens_per_image = int(tokens_per_image)

    @classmethod
    def from_model(cls, path: str | Path) -> "Vision | None":
        """The Vision of the model at `path` (a local directory), or None for a text-only model."""
        from transformers import AutoConfig

        from engines.models import image_token_layout, is_vision_language

        config = AutoConfig.from_pretrained(path)
        if not is_vision_language(config):
            return None
        image_id, per_image = image_token_layout(config, path)
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(path), image_id, per_image)

    def expand(self, ids: Sequence[int]) -> list[int]:
        """`ids` with every image token repeated `tokens_per_image` times."""
        out: list[int] = []
        for t in ids:
            if t == self.image_token_id:
                out += [t] * self.tokens_per_image
            else:
                out.append(t)
        return out

    def pixels_in(self, messages: Iterable[dict[str, Any]]) -> np.ndarray | None:
        """Pixel values of the images in `messages`, in token order; None when they hold none."""
        found = images_in(messages)
        return self.pixels(found) if found else None

    def pixels(self, images: Sequence[Any]) -> np.ndarray:
        """[n, C, H, W] float32 pixel values of `images` (any form `to_pil` takes)."""
        if not images:
            return np.zeros((0, 3, 1, 1), np.float32)
        out = self.processor(images=[to_pil(x) for x in images], return_tensors="np")["pixel_values"]
        return np.ascontiguousarray(out, dtype=np.float32)


def to_pil(x: Any) -> Any:
    """A PIL RGB image from any of the forms the module docstring lists."""
    from PIL import Image

    if isinstance(x, Image.Image):
        return x.convert("RGB")
    if isinstance(x, np.ndarray):
        return Image.fromarray(x.astype(np.uint8)).convert("RGB")
    if isinstance(x, dict):
        if x.get("bytes") is not None:
            return to_pil(bytes(x["bytes"]))
        if x.get("path"):
            return to_pil(str(x["path"]))
        if "url" in x:
            return to_pil(x["url"])
        raise ValueError(f"an image given as a mapping needs 'bytes', 'path' or 'url', got keys {sorted(x)}")
    if isinstance(x, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(bytes(x))).convert("RGB")
    if isinstance(x, str):
        if x.startswith("data:"):
            head, _, data = x.partition(",")
            if ";base64" not in head:
                raise ValueError(f"image data URL must be base64 ('data:image/png;base64,...'), got {head[:40]!r}")
            return to_pil(base64.b64decode(data))
        if Path(x).is_file():
            return Image.open(x).convert("RGB")
        raise ValueError(f"image {x[:60]!r} is neither a data URL nor an existing file; pass a PIL image, bytes, "
                         "a data:image/...;base64 URL or a local path (remote URLs are not fetched)")
    raise TypeError(f"cannot read an image from a {type(x).__name__}; pass a PIL image, an HxWx3 uint8 array, "
                    "PNG/JPEG bytes, a data URL or a path")


def part_image(part: dict[str, Any]) -> Any:
    """The image of one image content part."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def images_in(messages: Iterable[dict[str, Any]]) -> list[Any]:
    """The images of `messages` in the order a chat template renders their image tokens."""
    found = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            found += [part_image(p) for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES]
    return found


def has_images(messages: Iterable[dict[str, Any]]) -> bool:
    return bool(images_in(messages))


def placeholders_to_parts(messages: Sequence[dict[str, Any]], images: Sequence[Any],
                          placeholder: str = "<image>") -> list[dict[str, Any]]:
    """verl-style rows (an `images` column and `<image>` in the message text) as content parts."""
    left = list(images)
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and placeholder in content:
            parts: list[dict[str, Any]] = []
            for i, piece in enumerate(content.split(placeholder)):
                if i:
                    if not left:
                        raise ValueError(f"the messages have more {placeholder!r} placeholders than the row's "
                                         f"{len(images)} images")
                    parts.append({"type": "image", "image": left.pop(0)})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
        out.append(m)
    if left:
        raise ValueError(f"the row has {len(images)} images but only {len(images) - len(left)} {placeholder!r} "
                         "placeholders in its messages; put one where each image goes")
    return out


def without_pixels(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each image part's payload dropped (`{"type": "image"}` stays): what outputs
    and traces keep, since the pixel values travel once, in `AgentLoopOutput.multi_modal`."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [{"type": "image"} if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                  else p for p in content]}
        out.append(m)
    return out


def data_url(x: Any) -> str:
    """An image (any form `to_pil` reads) as a `data:image/png;base64,` URL; data URLs pass through."""
    if isinstance(x, str) and x.startswith("data:"):
        return x
    buf = io.BytesIO()
    to_pil(x).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def as_image_url_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose image parts are OpenAI `image_url` parts with data URLs: the form chat
    clients (langchain, the openai package) accept."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and has_images([m]):
            m = {**m, "content": [{"type": "image_url", "image_url": {"url": data_url(part_image(p))}}
                                  if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES else p for p in content]}
        out.append(m)
    return out
