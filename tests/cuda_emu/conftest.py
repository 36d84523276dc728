import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# The harness modules (emu, harness, build, mutants) are imported by name from this folder.
sys.path.insert(0, str(HERE))


# Tiers: the quick tier (`make test`) runs each parametrised test of this folder on its first case,
# so every emulated op and launcher path still runs (about 40 s on 2 cores); the rest of the
# dtype x size x alignment matrix (about 3 minutes) is marked `full` and runs in the full tier
# (`make test-all`, what CI runs). tryfirst: before pytest's -m selection reads the marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        if HERE not in item.path.parents or getattr(item, "callspec", None) is None:
            continue
        key = (item.path, item.originalname)
        if key in seen:
            item.add_marker(pytest.mark.full)
        seen.add(key)
