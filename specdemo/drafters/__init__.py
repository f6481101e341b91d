"""Drafters: the protocol every drafter follows, the registry of kinds, and one module per kind."""
