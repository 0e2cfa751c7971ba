"""rlbus.messages."""
