"""Measurement tables (contract 3): the columns, the folder layout and the checked loader. Table
importers (issue 12) go beside `table.py`."""
