"""The config: every field declared once (sections.py), the schema derived from it (schema.py).

`fields` says how a field is declared, `paper` holds the paper's settings the
configs/*.py files build on. Checks of relations between fields, which need
the code that defines them, are config_check.py's.
"""
