"""Draft heads trained from the target itself (issue 38): an EAGLE-style head on the target's features, as it drafts.

- ``specdec.head.model``: the head (one decoder layer of the target's architecture over the target's
  final hidden state and the next token's embedding, a reduced draft vocabulary) and its KV cache;
- ``specdec.head.fast``: the head's inference form, its linears on specdec's int8 (or int4) kernels;
- ``specdec.head.drafter``: the head as a drafter of the decode loop, reading the target runner's hidden states;
- ``specdec.head.store``: save/load with a manifest tying a head to its target (``specdec.head.manifest``: reading it, no torch);
- ``specdec.head.use``: the drafter specs that name a head (``head``, ``lookup+head``), finding and loading it for a target.

The head shares the drafters' floor (specdec.drafters: the registry names it, it builds on their trees).  Training
one is specdec.training (``specdec train-drafter``); what a head costs per drafted token is specdec.runtime.head_cost.
"""
