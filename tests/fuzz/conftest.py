"""Hypothesis profiles of the op fuzzers (see tests/fuzz/strategies.py: ``tiered``).

* ``fastamp-fuzz``: the default ``pytest`` tier. Fixed seed (``derandomize``), so CI runs the same
  examples every time and a failure reproduces; few examples, so tests/fuzz stays near a minute.
* ``fastamp-fuzz-slow``: the ``slow`` tier (``pytest -m slow tests/fuzz``): random seeds, many more
  examples. A failure prints the ``@reproduce_failure`` blob.

Neither keeps an example database: the tree is shared and ``.hypothesis/`` is not ignored by git.
``deadline=None`` because an example's time depends on the drawn sizes (up to ~140k elements) and
on the machine's load, not on a regression. No health check is suppressed.
"""

from hypothesis import settings

settings.register_profile(
    "fastamp-fuzz",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
)
settings.register_profile(
    "fastamp-fuzz-slow",
    derandomize=False,
    deadline=None,
    database=None,
    print_blob=True,
)
