"""What every process of the mesh agrees on beyond the protos: how a call's end reads and what
each caller does about it (outcomes.py), the limits on a request, and the worker roles by name."""
