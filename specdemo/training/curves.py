"""The training curves as a picture (Pillow, no plotting stack): the training loss, and the held-out acceptance α of
each draft position with the greedy tokens per target pass it implies."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

from specdemo.training.fit import Curves

WIDTH, HEIGHT, MARGIN = 1000, 420, 60
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _panel(
    draw: ImageDraw.ImageDraw,
    left: int,
    title: str,
    steps: list[int],
    series: list[tuple[str, list[float]]],
    top: float,
) -> None:
    """One chart of lines over the steps, from 0 to `top`, with a legend."""
    right, bottom, upper = left + WIDTH // 2 - MARGIN, HEIGHT - MARGIN, MARGIN
    draw.rectangle([left, upper, right, bottom], outline="#888888")
    draw.text((left, upper - 40), title, fill="#000000")
    for tick in range(5):
        value = top * tick / 4
        y = bottom - (bottom - upper) * tick / 4
        draw.text((left - 40, y - 6), f"{value:.2f}", fill="#444444")
    last = max(steps) if steps else 1
    draw.text((left, bottom + 8), "0", fill="#444444")
    draw.text((right - 40, bottom + 8), f"{last} steps", fill="#444444")
    for index, (name, values) in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        points = [
            (left + (right - left) * step / last, bottom - (bottom - upper) * min(value, top) / top)
            for step, value in zip(steps, values, strict=True)
        ]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points[-1:]:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((left + 10, upper + 8 + 16 * index), f"{name}: {values[-1]:.3f}" if values else name, fill=colour)


def draw_curves(curves: Curves, path: Path, title: str) -> None:
    image = Image.new("RGB", (WIDTH + MARGIN, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    draw.text((MARGIN, 6), title, fill="#000000")
    _panel(draw, MARGIN, "training loss", curves.steps, [("loss", curves.loss)], max(curves.loss, default=1.0) * 1.1)
    depth = len(curves.alpha[0]) if curves.alpha else 0
    alpha = [(f"alpha at draft position {k + 1}", [row[k] for row in curves.alpha]) for k in range(depth)]
    per_pass = [("tokens per pass - 1", [value - 1 for value in curves.tokens_per_pass])]
    top = max([1.0] + per_pass[0][1])
    _panel(draw, MARGIN + WIDTH // 2, "held out, greedy", curves.steps, alpha + per_pass, top)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
