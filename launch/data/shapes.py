"""A procedural image task for vision-language policies: count the dots in a picture.

    image: 1 to 6 filled circles of one colour on white, 64x64, seeded
    question "How many dots are in the picture? Answer with a number." ground truth "4"

Rows carry the image as an OpenAI-style content part (a base64 PNG data URL, so a jsonl file
holds everything) next to the question; data_source "shapes" is scored by the last number of
the reply. The `bar_chart` tool (launch/configs/tools_chart.yaml) is offered, so a policy that
calls it gets an image back mid-trajectory.

    python -m launch.data.shapes --n 64 --output shapes.jsonl
"""

from __future__ import annotations

import argparse
import base64
import io
import random
from typing import Any

from launch.data.rows import save_rows

DATA_SOURCE = "shapes"
_COLORS = [(214, 39, 40), (31, 119, 180), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


def dots_image(count: int, rng: random.Random, size: int = 64) -> Any:
    """`count` non-overlapping dots (radius 5) at random places."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    color, placed = rng.choice(_COLORS), []
    while len(placed) < count:
        x, y = rng.randint(6, size - 7), rng.randint(6, size - 7)
        if all((x - a) ** 2 + (y - b) ** 2 > 144 for a, b in placed):
            placed.append((x, y))
            draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=color)
    return img


def data_url(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def shapes_rows(n: int, seed: int = 0, agent_name: str = "tool_agent") -> list[dict[str, Any]]:
    """`n` rows; a pure function of (n, seed)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        count = rng.randint(1, 6)
        rows.append({
            "data_source": DATA_SOURCE, "agent_name": agent_name,
            "prompt": [{"role": "user", "content": [
                {"type": "image", "image": data_url(dots_image(count, rng))},
                {"type": "text", "text": "How many dots are in the picture? Answer with a number."}]}],
            "reward_model": {"style": "rule", "ground_truth": str(count)},
            "extra_info": {"index": i, "tools": ["bar_chart"]}})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True, help="a .jsonl, .json or .parquet path")
    args = ap.parse_args(argv)
    path = save_rows(shapes_rows(args.n, args.seed), args.output)
    print(f"wrote {args.n} rows to {path}")


if __name__ == "__main__":
    main()
