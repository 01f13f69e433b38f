"""A module whose values tests/frontend/test_globals.py's forwards read (``mod.K``)."""
K = 2.0


class Cfg:
    scale = 1.0


cfg = Cfg()
