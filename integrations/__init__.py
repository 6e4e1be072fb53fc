"""Thin adapters for the loops users already have (shipped as ``accelerate_ssl.integrations``)."""
