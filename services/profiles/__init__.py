"""What a worker costs: how long a prefill of n tokens and a decode step of a batch take on one
engine, model and machine. One file format (profile_file.py) for what `python -m services.planner
profile` measures, what the planner predicts from and what the mocker runs as its timing; the
presets shipped in `presets/` are such files. A leaf: it imports nothing else of kvmesh, so the
planner and the engines share it without depending on each other."""
