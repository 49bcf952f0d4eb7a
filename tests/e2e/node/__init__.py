"""The real Node clients of the Responses e2e tests: the Vercel AI SDK (`ai`, `@ai-sdk/openai`)
and Codex CLI (`@openai/codex`, which ships its binary), installed with `npm ci` from the
package.json and package-lock.json beside this file into a folder of the test session, once per
session, with the scripts that drive them. The folder (Codex's binary is ~400 MB) is removed when
the session's process ends."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
INSTALL_TIMEOUT_S = 600  # a cold npm cache fetches Codex's ~150 MB binary package
RUN_TIMEOUT_S = 60


def installed(base: Path) -> Path:
    """The folder under `base` where the clients are installed: installs them the first time."""
    folder = base / "node-clients"
    done = folder / ".installed"
    if done.exists():
        return folder
    folder.mkdir(exist_ok=True)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for source in HERE.iterdir():
        if source.suffix in (".json", ".mjs"):
            shutil.copy(source, folder / source.name)
    npm = shutil.which("npm")
    assert npm is not None, "the Responses client tests need Node.js and npm on the PATH"
    args = [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"]
    finished = subprocess.run(
        args, cwd=folder, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
    )
    assert finished.returncode == 0, f"npm ci failed:\n{finished.stdout}\n{finished.stderr}"
    done.touch()
    return folder


def run_ai_sdk(folder: Path, scenario: dict[str, Any]) -> dict[str, Any]:
    """Runs ai_sdk.mjs with `scenario`; returns the report it prints."""
    node = shutil.which("node")
    assert node is not None
    finished = subprocess.run(
        [node, "ai_sdk.mjs", json.dumps(scenario)],
        cwd=folder,
        env={**os.environ, "NODE_NO_WARNINGS": "1"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert finished.returncode == 0, f"the AI SDK failed:\n{finished.stdout}\n{finished.stderr}"
    report: dict[str, Any] = json.loads(finished.stdout.strip().splitlines()[-1])
    return report
