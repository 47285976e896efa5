"""Draft heads trained from the target itself (issue 38): an EAGLE-style head on the target's features.

- ``specdec.head.model``: the head (one decoder layer of the target's architecture over the target's
  final hidden state and the next token's embedding, a reduced draft vocabulary) and its KV cache;
- ``specdec.head.features``: the target's features for training (teacher-forced text, its own answers);
- ``specdec.head.data``: the offline training material (installed sources and docs, manual pages, prompts);
- ``specdec.head.train``: distillation from the frozen target within a time budget;
- ``specdec.head.command``: ``specdec train-drafter``;
- ``specdec.head.store``: save/load with a manifest tying a head to its target (``specdec.head.manifest``: reading it, no torch);
- ``specdec.head.drafter``: the head as a drafter of the decode loop, reading the target runner's hidden states.
- ``specdec.head.use``: the drafter specs that name a head (``head``, ``lookup+head``), loading it for a target, its cost.
- ``specdec.head.fast``: the head's inference form, its linears on specdec's int8 (or int4) kernels;
- ``specdec.head.cost``: its cost per drafted token against the target's one-token step (``specdec profile``).
"""
