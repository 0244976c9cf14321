"""python -m bench.agents [--quick] [--seeds N] [--modes ...]: the agents benchmark, scaled for development."""

from bench.agents.run import main

if __name__ == "__main__":
    main()
