"""The algorithm: the decoding and verification math, and the one decode loop.

It loads no model and runs no request: it works on the ModelRunner protocol (specdec.backends.base) and
the drafters' Draft.  Verification of a chain (verify), of a block (block) and of a token tree (trees),
what one verification decides (verdict), stairs verification for targets that only predict the next token
(stairs), the logits -> probabilities warp and its draws (sampling), the controller that picks k per step
(control), and the decode loop that drives a drafter and a target through them (loop).  It imports no module
of specdec.runtime, specdec.serve, specdec.bench, specdec.head or specdec.cli (tests/test_structure.py).

Nothing is imported here: ``import specdec.request`` needs control without torch.
"""
