"""Parameterized compact self-supervised data sets (paper 002)."""
