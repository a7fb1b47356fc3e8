"""Render the README's screenshots from the console itself: the frozen states the snapshot tests draw, saved as SVG.

    .venv/bin/python scripts/screenshots.py [OUT_DIR]     (default: docs/images)

The states are the test suite's (tests/fixtures/console_states.py): a host with two H200s, a training job with a loss
spike and a foreign server; and a finished stop & bench of that job. Clocks are frozen and read in UTC, so the pictures
change only when what a screen draws changes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from console.app import build_app  # noqa: E402
from tests.fixtures.console_states import chain_records, chain_state, frozen_state  # noqa: E402

SIZE = (160, 48)
SHOTS = {"dashboard": ("1", frozen_state), "training": ("2", frozen_state), "bench": ("5", lambda: chain_state(chain_records()))}


async def render(name: str, key: str, state_of, out: Path) -> Path:
    app = build_app(state=state_of(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        await pilot.press(key)
        await pilot.pause()
        app.redraw_now()
        await pilot.pause()
        path = out / f"{name}.svg"
        path.write_text(app.export_screenshot(title=f"eagle3-console · {name}"))
    return path


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "docs" / "images"
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TZ"] = "UTC"
    time.tzset()
    for name, (key, state_of) in SHOTS.items():
        print(asyncio.run(render(name, key, state_of, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
