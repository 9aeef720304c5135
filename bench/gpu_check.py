"""`python -m bench.gpu_check`: the team's guide tells every session to run exactly this command, so it
stays here; the check itself (an acceptance check, not a benchmark) is checks/gpu_check.py."""
from checks.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
