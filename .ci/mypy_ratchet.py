"""mypy, strict over python/fastamp ([tool.mypy] in pyproject.toml), held by a ratchet: the errors
left per file (.ci/mypy_baseline.json) may only go down. A file with more errors than its
baseline, or errors in a file the baseline does not list, fails; a file with fewer prints the new
count to record (``--update`` writes it). New modules are therefore held to strict mypy, and the
baseline's count reaches 0 as the package's remaining annotations are fixed (issue 43).

    .venv/bin/python .ci/mypy_ratchet.py            # make lint runs this
    .venv/bin/python .ci/mypy_ratchet.py --update   # after fixing errors: lower the baseline
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "mypy_baseline.json"
_ERROR = re.compile(r"^(?P<file>[^:]+):\d+(?::\d+)?: error: ")


def run_mypy() -> tuple[Counter[str], str]:
    mypy = pathlib.Path(sys.executable).parent / "mypy"
    proc = subprocess.run(
        [str(mypy), "--no-error-summary"], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (config, crash)
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"mypy failed to run (exit {proc.returncode})")
    counts: Counter[str] = Counter()
    for line in proc.stdout.splitlines():
        m = _ERROR.match(line)
        if m:
            counts[m["file"]] += 1
    return counts, proc.stdout


def main() -> int:
    counts, out = run_mypy()
    if "--update" in sys.argv:
        BASELINE.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n")
        print(f"mypy: baseline written, {sum(counts.values())} errors in {len(counts)} files")
        return 0
    base: dict[str, int] = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    worse = {f: (n, base.get(f, 0)) for f, n in counts.items() if n > base.get(f, 0)}
    better = {f: (counts.get(f, 0), b) for f, b in base.items() if counts.get(f, 0) < b}
    total, allowed = sum(counts.values()), sum(base.values())
    if worse:
        print(out, end="")
        for f, (n, b) in sorted(worse.items()):
            print(f"mypy: {f}: {n} errors, the baseline allows {b}")
        print(
            "mypy: new type errors (above). Fix them: the baseline (.ci/mypy_baseline.json) may "
            "only go down."
        )
        return 1
    note = ""
    if better:
        note = (
            f"; fewer than the baseline in {len(better)} file(s): record it with "
            "`.venv/bin/python .ci/mypy_ratchet.py --update`"
        )
    print(f"mypy (strict, python/fastamp): {total} errors left, baseline {allowed}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
