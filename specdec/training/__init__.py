"""Training a draft head (specdec.head) from its frozen target: ``specdec train-drafter``.

- ``specdec.training.features``: the target's features for training (teacher-forced text, its own answers);
- ``specdec.training.data``: the offline training material (installed sources and docs, manual pages, prompts);
- ``specdec.training.train``: distillation from the frozen target within a time budget;
- ``specdec.training.command``: ``specdec train-drafter``: the target loaded (specdec.runtime.loading), the
  material gathered, the head trained and saved (specdec.head.store).

It sits on the top floors, beside the bench and the server: it loads a target through the runtime.
"""
