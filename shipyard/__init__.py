"""shipyard: train coding agents with RL in the harness they ship in."""

__version__ = "0.1.0"
