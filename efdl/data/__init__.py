"""Streamed data whose epoch survives a change of world size (issue 37; in progress: the
order is here, the readers are not yet)."""
