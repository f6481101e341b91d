"""The GPU check's scripts: preparing what a call of the device tool carries, and running the check there."""
