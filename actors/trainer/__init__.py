"""rlbus.actors.trainer.actor."""
