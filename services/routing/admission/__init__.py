"""Admission: where the decode pool's requests wait for a worker, in what order, and which are
refused at once because they would miss their objective (gate.py holds it together)."""
