"""Python runs this at start-up when this folder is on PYTHONPATH: the test faults of
TP_LLAMA_FAULT_FILE are installed in every process of a test's server or CLI run."""

import os

if os.environ.get("TP_LLAMA_FAULT_FILE"):
    from tp_llama.testing import faults

    faults.install()
