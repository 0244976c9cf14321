"""python -m bench.agents [--quick] [--seeds N] [--modes ...] [--clients]: the agents benchmark, scaled for
development."""

from bench.agents.cli import main

if __name__ == "__main__":
    main()
