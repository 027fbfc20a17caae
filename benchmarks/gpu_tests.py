"""The suite's CUDA tests (`pytest -m gpu`) as a phase of the GPU check: each test's outcome, time
and, for a failure, its message, in one JSON file written when pytest ends (a temporary file
renamed). CI has no GPU, so these tests run only here.

    python benchmarks/gpu_tests.py --write OUT.json [--paths tests]

Outcomes are pytest's, read from its JUnit XML: passed, failed, error, skipped (on a machine
without CUDA every one of them is skipped: "needs CUDA").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from relpos_ablate.io import atomic_write_text

REPO = Path(__file__).resolve().parent.parent


def outcomes(junit_xml: str) -> list[dict]:
    """One row per test case of a JUnit XML report: name, seconds, outcome and message."""
    rows = []
    for case in ET.fromstring(junit_xml).iter("testcase"):
        row = {"test": f"{case.get('classname')}::{case.get('name')}"}
        row["seconds"] = float(case.get("time") or 0.0)
        row["outcome"], row["message"] = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                row["outcome"] = {"failure": "failed"}.get(kind, kind)
                row["message"] = (found.get("message") or "")[:500]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", required=True, help="the phase's JSON (written when it ends)")
    parser.add_argument("--paths", default="tests", help="test paths, comma-separated")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        command += [f"--junitxml={xml}", *args.paths.split(",")]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        rows = outcomes(xml.read_text()) if xml.exists() else []
    result = {"rows": rows, "exit_code": done.returncode, "seconds": time.perf_counter() - start}
    counts = {kind: sum(r["outcome"] == kind for r in rows) for kind in ("passed", "failed")}
    result.update(counts, tail=(done.stdout + done.stderr)[-2000:] if done.returncode else "")
    atomic_write_text(args.write, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
