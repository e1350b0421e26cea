"""`python -m posttrain …` (and `torchrun --nproc-per-node N -m posttrain sft …`)."""

import os
import sys

from posttrain.cli import main

if __name__ == "__main__":  # a spawned child (vLLM's engine, a DataLoader worker) imports this file again
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a torchrun rank: its process group is closed (cli.main); skip interpreter finalisation, where gloo
        # threads torn down late can abort the process ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
