"""Drafters: strategies that propose tokens for the target to verify."""

from specdec.drafters.base import Draft, Drafter

__all__ = ["Draft", "Drafter"]
