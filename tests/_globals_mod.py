"""A module whose values tests/test_globals_cpu.py's forwards read (``mod.K``)."""
K = 2.0


class Cfg:
    scale = 1.0


cfg = Cfg()
