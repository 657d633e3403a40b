"""Shared pieces of the drafter / target / router services (no Ray imports)."""
