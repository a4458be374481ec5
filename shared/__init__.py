"""Pieces every side of embedfleet agrees on: settings, wire protocol, Redis key names, logging.

This package imports nothing else of the project, so producers in other services can depend on it
alone.
"""
