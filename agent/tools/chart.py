"""A tool that answers with an image: a bar chart of the numbers the model passes.

For vision-language policies (the tool message carries the image, which the model sees on its
next turn) and as the image tool of the tests and the docs. PIL only, no plotting library.

    tools:
      - class_name: agent.tools.chart.BarChartTool
        config: {size: 64}
        tool_schema: {type: function, function: {name: bar_chart, description: Draw a bar chart of numbers,
                      parameters: {type: object, properties: {values: {type: array, items: {type: number}}},
                                   required: [values]}}}
"""

from __future__ import annotations

from typing import Any

from agent.tools.base import BaseTool, ToolResponse

MAX_BARS = 64


def bar_chart(values: list[float], size: int = 64) -> Any:
    """A size x size RGB image: one bar per value, heights relative to the largest magnitude,
    negative values drawn below a middle axis."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    top = max((abs(v) for v in values), default=0.0) or 1.0
    signed = any(v < 0 for v in values)
    axis = size // 2 if signed else size - 1
    reach = axis if signed else size - 1
    width = size / max(1, len(values))
    for i, v in enumerate(values):
        h = round(abs(v) / top * reach)
        x0, x1 = round(i * width), max(round(i * width), round((i + 1) * width) - 2)
        y0, y1 = (axis - h, axis) if v >= 0 else (axis, axis + h)
        draw.rectangle([x0, y0, x1, y1], fill=(31, 119, 180) if v >= 0 else (214, 39, 40))
    draw.line([0, axis, size - 1, axis], fill="black")
    return img


class BarChartTool(BaseTool):
    """`bar_chart(values)` -> an image of the chart and a one-line text summary."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        values = arguments.get("values")
        if not isinstance(values, list) or not values:
            return ToolResponse(f"Error: 'values' must be a non-empty list of numbers, got {values!r}", False,
                                {"invalid": True})
        try:
            nums = [float(v) for v in values[:MAX_BARS]]
        except (TypeError, ValueError):
            return ToolResponse(f"Error: every value must be a number, got {values!r}", False, {"invalid": True})
        size = int(self.config.get("size", 64))
        note = f" (first {MAX_BARS} of {len(values)})" if len(values) > MAX_BARS else ""
        return ToolResponse(f"bar chart of {len(nums)} values{note}, max {max(nums):g}, min {min(nums):g}",
                            images=[bar_chart(nums, size)])
