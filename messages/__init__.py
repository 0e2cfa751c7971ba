"""rlbus.messages.

Importing it (every rlbus process does) makes AST building thread-safe in the process (messages/astlock.py).
"""

from rlbus.messages import astlock as _astlock

_astlock.install()
