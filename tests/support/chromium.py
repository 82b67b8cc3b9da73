"""Debian's headless Chromium for page tests: never skipped when absent (the test fails and says
how to install it; `make test` installs it as root). Run offline: no network services, no
first-run, sync, component updates or QUIC, a throwaway profile; each call bounded in time."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

__all__ = ["HINT", "chromium", "dump_dom", "screenshot"]

HINT = ("install Debian's chromium package (sh scripts/apt-install-no-services.sh chromium as root; "
        "`make test` does it)")
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--disable-extensions", "--hide-scrollbars", "--mute-audio")


def chromium() -> str:
    path = shutil.which("chromium")
    assert path is not None, f"chromium is missing: {HINT}"
    return path


_DEADLINE_S = 60.0


async def _run(profile: Path, *args: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(chromium(), *_FLAGS, f"--user-data-dir={profile}", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(_DEADLINE_S):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out, err


async def dump_dom(url: str, profile: Path) -> str:
    """The DOM Chromium builds for `url`, serialized."""
    code, out, err = await _run(profile, "--dump-dom", url)
    assert code == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


async def screenshot(url: str, profile: Path, png: Path, size: tuple[int, int] = (1280, 900)) -> bytes:
    """A PNG of `url` rendered in a window of `size`."""
    code, _, err = await _run(profile, f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", url)
    assert code == 0, err.decode(errors="replace")[-2000:]
    return await asyncio.to_thread(png.read_bytes)
