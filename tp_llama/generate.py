"""`python -m tp_llama.generate`: the offline CLI, kept at its documented name (tp_llama.cli.generate)."""

import sys

from tp_llama.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
