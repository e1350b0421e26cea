"""posttrain: LLM post-training in one coherent, readable package."""

import os as _os
import sys as _sys

# Transparent huge pages for PyTorch's CPU tensors of 2 MiB and more (posttrain/ops/host_memory.py). PyTorch
# reads the variable once, at its first CPU allocation, so it is set here, before anything of ours imports
# torch; THP_MEM_ALLOC_ENABLE=0 in the environment keeps 4 KiB pages.
THP_SET_TOO_LATE = "torch" in _sys.modules and "THP_MEM_ALLOC_ENABLE" not in _os.environ
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
