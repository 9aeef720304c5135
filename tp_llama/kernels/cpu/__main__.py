"""`python -m tp_llama.kernels.cpu`: build the C kernels ahead of the first load (setup_model.sh runs it).
The package's entry point rather than build.py's own, which tp_llama.kernels imports before `-m` would
run it again."""

import sys

from tp_llama.kernels.cpu.build import main

sys.exit(main())
