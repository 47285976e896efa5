"""Drafters: strategies that propose tokens for the target to verify."""

from specdec.algorithm.draft import Draft, Drafter

__all__ = ["Draft", "Drafter"]
