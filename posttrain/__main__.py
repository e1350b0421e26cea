"""`python -m posttrain …` (and `torchrun --nproc-per-node N -m posttrain sft …`)."""

from posttrain.cli import main

raise SystemExit(main())
