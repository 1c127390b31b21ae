"""For tools that look for setup.py: setuptools reads the metadata from pyproject.toml (PEP 621)."""

from setuptools import setup

setup()
