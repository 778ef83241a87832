"""Helpers every layer may use: byte and duration units, dtype names, the transformers version check.

Imports: the standard library, torch and `ponytail.errors` only.
"""
