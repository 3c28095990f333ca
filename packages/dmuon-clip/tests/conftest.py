import sys
from pathlib import Path

# The tests share small helpers (tests/_reference.py); pytest's rootdir-relative imports need this.
sys.path.insert(0, str(Path(__file__).parent))
