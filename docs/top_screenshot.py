#!/usr/bin/env python
"""Render a ``boltzlabs-gym top --once`` frame of a pool with one straggler to docs/top.png.

    PYTHONPATH=. python docs/top_screenshot.py

A local pool of 8 faulty envs steps a few times, one env hangs past its 0.5 s deadline,
then ``top``'s table (``boltzlabs_gym.cli.top.render``, what the command prints) is exported by
``rich`` as text and drawn with Pillow in DejaVu Sans Mono (offline: no browser, no SVG renderer).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAULTY = os.path.join(ROOT, "tests", "envs", "faulty")
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"


def frame_text() -> str:
    from rich.console import Console

    from boltzlabs_gym import RLPool
    from boltzlabs_gym.cli.top import fetch_status, render

    with RLPool(FAULTY, n=8, step_timeout=0.5, metrics_port=0) as pool:
        pool.reset(seed=0)
        for _ in range(200):
            pool.step([1] * 8)
        pool.step([1, 1, 1, {"hang": True}, 1, 1, 1, 1])
        pool.reset()
        for _ in range(200):
            pool.step([1] * 8)
        pool.stats(memory=False)  # the lane's steps reported to the worker
        address = pool.workers[0]
        console = Console(record=True, width=200, file=open(os.devnull, "w"))
        console.print(render([("local worker (ipc)", fetch_status(address))]))
        return console.export_text()


def draw(text: str, path: str) -> None:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(FONT, 15)
    lines = text.rstrip("\n").splitlines()
    width = max(len(line.rstrip()) for line in lines)
    cw, ch = font.getbbox("M")[2], 20
    image = Image.new("RGB", (width * cw + 32, len(lines) * ch + 32), (24, 24, 32))
    pen = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        red = i > 2 and ("(1)" in line)  # the straggler's row, as top colours it
        pen.text((16, 16 + i * ch), line.rstrip(), font=font, fill=(255, 110, 110) if red else (220, 220, 220))
    image.save(path)


if __name__ == "__main__":
    text = frame_text()
    print(text)
    draw(text, sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "top.png"))
