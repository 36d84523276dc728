import sys
from pathlib import Path

# The harness modules (emu, harness, build, mutants) are imported by name from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
