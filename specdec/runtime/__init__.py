"""The runtime: models loaded, requests run, forwards measured.

Model names to loaded runners (loading), the Engine that sets a request up (engine), how it lends its runners
to requests one at a time or in a continuous batch (pool, batching), what a request needs in memory and a
server's budget for it (memory), and the measured forward costs t(k) the controller plans with (profile).
It builds on specdec.algorithm, specdec.backends and specdec.drafters, and imports no module of
specdec.serve, specdec.bench or specdec.cli (tests/test_structure.py).

Nothing is imported here: ``import specdec`` stays free of torch until an Engine is asked for.
"""
